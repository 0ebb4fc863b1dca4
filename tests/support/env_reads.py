"""Which environment variables a role reads: its config builders run over a mapping that records every
name looked up, so a manifest or a flag that sets a variable no role reads is caught."""
from __future__ import annotations

from collections.abc import Iterator, Mapping


class RecordingEnv(Mapping[str, str]):
    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._values[key]

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.read.add(key)
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("a config builder must look variables up by name, not list them")

    def __len__(self) -> int:
        return len(self._values)


def role_reads(values: Mapping[str, str]) -> set[str]:
    """The variables the launcher and the configs of the role ROLE_TYPE names read, given these values
    (they must form a valid configuration: a config that fails stops reading)."""
    from launcher.launch import _check_configs, drain_grace_s, frontend_count
    from kvyard.roles import parse_role
    from kvyard.logs import check_log_level

    # The C++ kernels' build is no part of reading a config (and takes seconds on a first load).
    env = RecordingEnv({"KVYARD_KERNELS": "0", **values})
    role = parse_role(env.get("ROLE_TYPE"))  # type: ignore[arg-type]
    check_log_level(env)
    _check_configs(role, env)
    if role.name == "PDFUSION":
        frontend_count(env)
        drain_grace_s(env)
    return env.read
