"""Shared fixtures: the embedded model's tokenizer, and a PDFUSION cluster started once per session."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvyard.model_path import embedded_model_path
from kvyard.tokenizer import TextTokenizer
from tests.support.procs import RoleProcess, free_port_block


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_path(embedded_model_path())


@dataclass
class Cluster:
    base_url: str        # http://127.0.0.1:PORT
    grpc_address: str    # 127.0.0.1:PORT+1
    process: RoleProcess


@pytest.fixture(scope="session")
def pdfusion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    port = free_port_block()
    proc = RoleProcess({"ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "KV_CACHE_MB": "256"},
                       tmp_path_factory.mktemp("pdfusion") / "cluster.log")
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health")
        yield Cluster(f"http://127.0.0.1:{port}", f"127.0.0.1:{port + 1}", proc)
    finally:
        proc.stop()
