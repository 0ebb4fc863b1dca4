"""Starts the role processes ROLE_TYPE names (`kvyard serve`, `python -m kvyard`; flags parsed in launcher/cli.py)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Mapping

from kvyard.logs import check_log_level, setup_logging
from kvyard.model_path import ModelFileError
from kvyard.parent_death import die_with_parent
from kvyard.roles import Role, parse_role
from launcher.safe_path import harden

log = logging.getLogger("kvyard.launcher")


def run_backend(env: Mapping[str, str]) -> None:
    from backend.config import BackendConfig
    from backend.main import serve_backend

    setup_logging("backend", env)
    asyncio.run(serve_backend(BackendConfig.from_env(env)))


def run_vit(env: Mapping[str, str]) -> None:
    """ROLE_TYPE=VIT: the vision model's image tower alone (backend/vit_server.py)."""
    from backend.config import BackendConfig
    from backend.vit_server import serve_vit

    setup_logging("vit", env)
    asyncio.run(serve_vit(BackendConfig.from_env(env)))


def run_embedding_backend(env: Mapping[str, str]) -> None:
    """PDFUSION's second backend: the pooling model EMBEDDING_MODEL_PATH names, on START_PORT + 10."""
    run_backend(embedding_env(env))


def embedding_env(env: Mapping[str, str], start: int | None = None) -> Mapping[str, str]:
    """The environment of the backend serving EMBEDDING_MODEL_PATH (START_PORT: `start`, else PDFUSION's +10):
    its own settings over `env`, which is looked up by name, never copied whole."""
    from collections import ChainMap
    from kvyard.pooling_model import embedding_model_name, resolve_embedding_path
    from kvyard.ports import embedding_start_port, start_port
    path = resolve_embedding_path(env["EMBEDDING_MODEL_PATH"])
    own = {"CHECKPOINT_PATH": str(path), "TOKENIZER_PATH": str(path),
           "START_PORT": str(start if start is not None else embedding_start_port(start_port(env))),
           "MODEL_NAME": env.get("EMBEDDING_MODEL_NAME") or embedding_model_name(path)}
    return ChainMap(own, env)  # type: ignore[arg-type]


def run_frontend(env: Mapping[str, str]) -> None:
    from frontend.config import FrontendConfig
    from frontend.main import serve_frontend

    setup_logging("frontend", env)
    asyncio.run(serve_frontend(FrontendConfig.from_env(env)))


def run_master(env: Mapping[str, str]) -> None:
    from master.config import MasterConfig
    from master.main import serve_master

    setup_logging("master", env)
    asyncio.run(serve_master(MasterConfig.from_env(env)))


def run_gateway(env: Mapping[str, str]) -> None:
    from gateway.config import GatewayConfig
    from gateway.main import serve_gateway

    setup_logging("gateway", env)
    asyncio.run(serve_gateway(GatewayConfig.from_env(env)))


def run_mock_backend(env: Mapping[str, str]) -> None:
    from backend.mock_backend import MockBackendConfig, serve_mock_backend

    setup_logging("mock_backend", env)
    asyncio.run(serve_mock_backend(MockBackendConfig.from_env(env)))


def run_mock_master(env: Mapping[str, str]) -> None:
    from master.mock_master import MockMasterConfig, serve_mock_master

    setup_logging("mock_master", env)
    asyncio.run(serve_mock_master(MockMasterConfig.from_env(env)))


def frontend_count(env: Mapping[str, str]) -> int:
    """FRONTEND_SERVER_COUNT: 1 (default) runs a frontend beside a PDFUSION backend; 0 the backend alone."""
    from kvyard.env import env_int
    count = env_int(env, "FRONTEND_SERVER_COUNT", 1, minimum=0)
    if count > 1:
        raise ValueError(f"FRONTEND_SERVER_COUNT must be 0 or 1, got {count}: CONCURRENCY_LIMIT and the metrics "
                         "are per frontend process, so several sharing START_PORT would each admit the whole "
                         "limit; run more frontends on their own ports (kvyard cluster --frontends N)")
    return count


def with_cluster_token(role: Role, env: dict[str, str]) -> dict[str, str]:
    """PDFUSION starts both ends of its internal gRPC port itself: unless a cluster token is configured it
    makes one that only its own processes know, so nothing else on the machine can call the backend."""
    configured = env.get("CLUSTER_TOKEN") or env.get("CLUSTER_TOKEN_FILE")
    if role is not Role.PDFUSION or not frontend_count(env) or configured:
        return env
    from kvyard.cluster_auth import new_token
    return {**env, "CLUSTER_TOKEN": new_token()}


def _check_configs(role: Role, env: Mapping[str, str]) -> None:
    """Validate every config this role needs before starting anything, so mistakes fail fast."""
    if role is Role.FRONTEND or (role is Role.PDFUSION and frontend_count(env)):
        from frontend.config import FrontendConfig
        FrontendConfig.from_env(env)
    if role.is_backend or role is Role.VIT:
        from backend.config import BackendConfig
        BackendConfig.from_env(env)
        if role is Role.PDFUSION and frontend_count(env) and env.get("EMBEDDING_MODEL_PATH"):
            BackendConfig.from_env(embedding_env(env))
    if role is Role.MASTER:
        from master.config import MasterConfig
        MasterConfig.from_env(env)
    if role is Role.GATEWAY:
        from gateway.config import GatewayConfig
        GatewayConfig.from_env(env)
    if role is Role.MOCK_BACKEND:
        from backend.mock_backend import MockBackendConfig
        MockBackendConfig.from_env(env)
    if role is Role.MOCK_MASTER:
        from master.mock_master import MockMasterConfig
        MockMasterConfig.from_env(env)


def drain_grace_s(env: Mapping[str, str]) -> float:
    """DRAIN_GRACE_S, read the way the frontend and backend configs read it."""
    from kvyard.env import env_int
    return float(env_int(env, "DRAIN_GRACE_S", 30, minimum=0))


def _role_child(fn: Callable[[Mapping[str, str]], None], env: Mapping[str, str], launcher_pid: int) -> None:
    """A role process's first steps: die with the launcher (however it dies), and take a process group of
    its own, so a terminal's Ctrl-C reaches only the launcher (which stops the roles in order) and a second
    signal can kill the role with anything it started."""
    die_with_parent(launcher_pid)
    os.setpgid(0, 0)
    fn(env)


def _kill_group(p: mp.process.BaseProcess) -> None:
    """SIGKILL a role process and its process group (it may not have made its group yet)."""
    if p.pid is None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()


def _supervise(targets: dict[str, Callable[[Mapping[str, str]], None]], env: dict[str, str]) -> int:
    """Start each role in its own process; when one exits, stop the rest and exit with its code.

    SIGTERM/SIGINT stop them in the reverse order of `targets`: the frontend first, which drains (its
    requests in flight finish, up to DRAIN_GRACE_S) while the backend still serves them, then the backend.
    A second signal kills whatever is left (each role's process group) at once; a role process dies with
    the launcher even when the launcher is killed (kvyard/parent_death.py)."""
    grace = drain_grace_s(env)
    harden()  # the spawned roles' own `python -c` start: no imports from the start directory
    ctx = mp.get_context("spawn")
    procs = {name: ctx.Process(target=_role_child, args=(fn, env, os.getpid()), name=name, daemon=False)
             for name, fn in targets.items()}
    stop_order = list(reversed(procs.values()))
    for p in procs.values():
        p.start()
    signalled = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal signalled
        if signalled:
            log.info("signal %d again: killing %s", signum, ", ".join(procs))
            for p in procs.values():
                if p.is_alive():
                    _kill_group(p)
            return
        signalled = True
        first = next((p for p in stop_order if p.is_alive()), None)
        log.info("signal %d: stopping %s (up to %.0f s to drain each)", signum,
                 ", ".join(p.name for p in stop_order), grace)
        if first is not None:
            first.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        from multiprocessing.connection import wait
        wait([p.sentinel for p in procs.values()])
    finally:
        for p in stop_order:  # one at a time: the backend outlives the frontend's drain
            if p.is_alive():
                p.terminate()
            p.join(timeout=grace + 10)
            if p.is_alive():
                _kill_group(p)
                p.join()
    codes = {name: p.exitcode for name, p in procs.items()}
    log.info("role processes exited: %s", codes)
    first_bad = next((c for c in codes.values() if c not in (0, None, -signal.SIGTERM)), 0)
    return abs(first_bad or 0)


def start(env: dict[str, str], explain: Callable[[str], str] = str) -> int:
    """Start the role(s) ROLE_TYPE names in `env` (the environment with the CLI's flags applied); 2 for a
    bad configuration, after one error line (`explain` names the flag that set a variable)."""
    try:
        role = parse_role(env.get("ROLE_TYPE"))
        check_log_level(env)
        configured = env
        env = with_cluster_token(role, env)
        _check_configs(role, env)
    except (ValueError, ModelFileError) as exc:
        print(f"kvyard: error: {explain(str(exc))}", file=sys.stderr)
        return 2
    generated = env.get("CLUSTER_TOKEN", "") != configured.get("CLUSTER_TOKEN", "")
    log.info("starting ROLE_TYPE=%s%s", role.name, ", its backend and frontend sharing a cluster token generated "
             "for this launch (no CLUSTER_TOKEN set)" if generated else "")
    if role is Role.FRONTEND:
        run_frontend(env)
        return 0
    single = {Role.MASTER: run_master, Role.GATEWAY: run_gateway, Role.MOCK_BACKEND: run_mock_backend,
              Role.MOCK_MASTER: run_mock_master, Role.VIT: run_vit}
    if role in single:
        single[role](env)
        return 0
    if role in (Role.PREFILL, Role.DECODE) or not frontend_count(env):
        return _supervise({"backend": run_backend}, env)
    if env.get("EMBEDDING_MODEL_PATH"):  # the pooling model's backend beside the chat model's
        return _supervise({"backend": run_backend, "embedding": run_embedding_backend, "frontend": run_frontend}, env)
    return _supervise({"backend": run_backend, "frontend": run_frontend}, env)
