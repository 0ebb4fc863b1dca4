"""Which environment variables a role reads: its config builders run over a mapping that records every
name looked up, so a manifest or a flag that sets a variable no role reads is caught; and which the code
reads at all, found by scanning the source (so a read behind a branch no test takes is not missed)."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path


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


# What the static scan looks for: a mapping named like the environment, and a variable's spelling.
ENV_MAPPINGS = ("env", "environ")
VAR_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|[A-Z]{2,}[A-Z0-9]*")


def _is_env(node: ast.AST) -> bool:
    """`env`, `environ` or `os.environ`."""
    return (isinstance(node, ast.Name) and node.id in ENV_MAPPINGS) or \
        (isinstance(node, ast.Attribute) and node.attr == "environ")


def _name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and VAR_NAME.fullmatch(node.value):
        return node.value
    return None


def static_reads(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Every environment variable the code reads, by scanning the source: `env.get("X")`, `env["X"]`,
    `"X" in env` and any call that is handed the environment and a variable's name (`env_int(env, "X", 1)`,
    `_flag(env, "X")`); writes (`env["X"] = ...`) are not reads. Variable → the files that read it."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str | None] = []
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and _is_env(func.value):
                    names.append(_name(node.args[0]) if node.args else None)
                elif any(_is_env(a) for a in node.args):
                    names.extend(_name(a) for a in node.args)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_env(node.value):
                names.append(_name(node.slice))
            elif isinstance(node, ast.Compare) and any(_is_env(c) for c in node.comparators):
                names.append(_name(node.left))
            for name in names:
                if name:
                    found.setdefault(name, set()).add(str(path))
    return found
