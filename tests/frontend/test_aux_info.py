"""Every AuxInfoPB field reaches the HTTP aux_info: the backend's figures (the prefill/decode hand-over's
kv_* ones too) survive the gRPC edge (frontend/backend_client.py) and the response builders."""
from __future__ import annotations

from dataclasses import fields

from frontend.backend_client import _from_pb
from frontend.respond import aux_info
from proto import model_rpc_pb2 as pb


def _http_name(pb_name: str) -> str:
    return pb_name[:-3] + "_ms" if pb_name.endswith("_us") else pb_name


def test_every_aux_info_pb_field_reaches_http() -> None:
    names = [f.name for f in pb.AuxInfoPB.DESCRIPTOR.fields]
    assert {"kv_transfer_bytes", "kv_blocks_sent", "kv_blocks_skipped", "kv_transfer_time_us"} <= set(names)
    values = {name: 1000 * (k + 1) for k, name in enumerate(names)}  # distinct, so a mix-up shows
    out = pb.GenerateOutputPB(index=0, output_ids=[5], aux_info=pb.AuxInfoPB(**values))
    aux = aux_info([_from_pb(out)])
    for name, value in values.items():
        expected = value / 1000 if name.endswith("_us") else value
        assert aux.get(_http_name(name)) == expected, name
    assert set(aux) == {_http_name(n) for n in names}


def test_several_sequences_sum_their_output_and_keep_the_longest_times() -> None:
    outs = [_from_pb(pb.GenerateOutputPB(index=i, aux_info=pb.AuxInfoPB(
        input_len=7, reuse_len=3, output_len=4 + i, iter_count=5 + i, cost_time_us=2000 * (i + 1),
        kv_blocks_sent=2 + i))) for i in range(2)]
    aux = aux_info(outs)
    assert aux["input_len"] == 7 and aux["reuse_len"] == 3
    assert aux["output_len"] == 9 and aux["iter_count"] == 6 and aux["cost_time_ms"] == 4.0
    assert aux["kv_blocks_sent"] == 3


def test_one_aux_info_type_crosses_the_grpc_edge_whole() -> None:
    """kvyard.aux_info.AuxInfo is AuxInfoPB field for field; the backend's edge writes every field and the
    frontend's reads every field back."""
    from backend.pb_convert import aux_to_pb
    from frontend.backend_client import aux_from_pb
    from kvyard.aux_info import AuxInfo

    assert [f.name for f in fields(AuxInfo)] == [f.name for f in pb.AuxInfoPB.DESCRIPTOR.fields]
    sent = AuxInfo(*range(1, len(fields(AuxInfo)) + 1))
    assert aux_from_pb(aux_to_pb(sent)) == sent
