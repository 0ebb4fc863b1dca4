"""Typed readers for environment variables, used only by the roles' config builders."""
from __future__ import annotations

from collections.abc import Mapping

# Where internal ports (backend gRPC and HTTP, master HTTP) listen unless HOST says otherwise: they
# have no authentication of their own, so only this machine may reach them by default.
INTERNAL_HOST = "127.0.0.1"


def env_int(env: Mapping[str, str], name: str, default: int, minimum: int | None = None) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name, "") or default


def env_choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (env.get(name, "") or default).lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_names(env: Mapping[str, str], name: str, default: str) -> tuple[str, ...]:
    """A comma-separated list of names (MODEL_NAME: the model's name, then its aliases); never empty."""
    raw = env.get(name, "")
    if not raw:
        return (default,)
    names = tuple(n.strip() for n in raw.split(","))
    if any(not n for n in names):
        raise ValueError(f"{name} must be names separated by commas, with none empty, got {raw!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{name} names one model twice: {raw!r}")
    return names
