"""Run on a host without the cluster token (tests/multihost/test_across_hosts.py): tries what a stranger on
the network would, and prints one line per attempt, `what result` (an HTTP status or a gRPC code).

    python -m tests.multihost.intruder MASTER_HOST:PORT BACKEND_HOST:GRPC_PORT [TOKEN]
"""
from __future__ import annotations

import sys

import grpc
import httpx

from kvyard.ports import backend_http_for_grpc
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc


def main(master: str, backend: str, token: str = "") -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    register = {"model": "SmolLM2-135M-Instruct", "role": "PDFUSION", "server_ip": "", "grpc_port": 8089,
                "http_port": 8093}
    print("register", httpx.post(f"http://{master}/rtp_llm/register", json=register, headers=headers,
                                 timeout=10).status_code)
    schedule = {"model": "SmolLM2-135M-Instruct", "block_cache_keys": [1, 2], "seq_len": 40}
    print("schedule", httpx.post(f"http://{master}/rtp_llm/schedule", json=schedule, headers=headers,
                                 timeout=10).status_code)
    with grpc.insecure_channel(backend) as channel:
        stub = pb_grpc.ModelRpcServiceStub(channel)
        request = pb.GenerateInputPB(request_id="intruder", token_ids=[1, 2, 3],
                                     generate_config=pb.GenerateConfigPB(max_new_tokens=4))
        print("generate", _code(lambda: list(stub.GenerateStreamCall(request, metadata=metadata, timeout=30))))
        print("worker_status", _code(lambda: stub.GetWorkerStatus(pb.WorkerStatusRequestPB(latest_version=-1),
                                                                   metadata=metadata, timeout=30)))
    host, _, port = backend.rpartition(":")
    print("backend_http", httpx.post(f"http://{host}:{backend_http_for_grpc(int(port))}/set_log_level",
                                     json={"log_level": "DEBUG"}, headers=headers, timeout=10).status_code)


def _code(call) -> str:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


if __name__ == "__main__":
    main(*sys.argv[1:])
