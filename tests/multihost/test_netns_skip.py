"""Where network namespaces cannot be made, the multi-host checks skip with the reason (no root, no `ip`)."""
from __future__ import annotations

import pytest

from tests.multihost import netns


def test_no_root_and_no_ip_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.Unavailable, match="need root"):
        netns.check_available()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda _name: None)
    with pytest.raises(netns.Unavailable, match="iproute2"):
        netns.check_available()
