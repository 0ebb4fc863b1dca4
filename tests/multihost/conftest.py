"""One multi-host cluster for every check in tests/multihost/ (started once: five model loads), skipped with
the reason where network namespaces cannot be made."""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.cluster import MultiHostCluster, multihost_cluster
from tests.multihost.netns import Unavailable, check_available


@pytest.fixture(scope="package")
def cluster() -> Iterator[MultiHostCluster]:
    try:
        check_available()
    except Unavailable as exc:
        pytest.skip(f"multi-host tests need network namespaces: {exc}")
    # Not pytest's tmp_path: it keeps three runs, and other runs on this machine may delete ours mid-run.
    logs = Path(tempfile.mkdtemp(prefix="kvyard-multihost-"))
    with multihost_cluster(logs) as c:
        yield c
