"""The checked-in gRPC modules are what `make proto` generates from proto/model_rpc.proto and
proto/rtp_llm_rpc.proto (RTP-LLM's service, as kvyard serves it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ("model_rpc", "rtp_llm_rpc")
# RTP-LLM's service is registered by hand (backend/rtp_rpc.py): only its messages are generated.
GENERATED = ("model_rpc_pb2.py", "model_rpc_pb2.pyi", "model_rpc_pb2_grpc.py", "rtp_llm_rpc_pb2.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    *(str(REPO / "proto" / f"{p}.proto") for p in PROTOS)], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "proto" / name).read_text()
        checked_in = (REPO / "proto" / name).read_text()
        assert fresh == checked_in, f"proto/{name} is stale: run `make proto` and commit the result"


def test_every_proto_field_is_documented() -> None:
    """Each field line in the .proto has a comment on it or right above it."""
    lines = [line for p in PROTOS for line in (REPO / "proto" / f"{p}.proto").read_text().splitlines()]
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option", "//"))
        if is_field and "//" not in s and not lines[i - 1].strip().startswith("//"):
            undocumented.append(s)
    assert undocumented == []
