"""`kvyard cluster`: a master, backends that register with it and frontends that route through it, as
processes on this machine sharing one generated cluster token; printed once serving, stopped together.

Each part is `python -m kvyard` with its ROLE_TYPE, so it runs exactly as a deployed role would. Output
lines are prefixed with the part's name. Ctrl-C / SIGTERM stops the frontends first (they drain), then
the backends, then the master; a second signal kills what is left (each part's process group), and every
part dies with the cluster process even when that is killed (kvyard/parent_death.py).

A part that exits on its own once the cluster serves is restarted with backoff (launcher/restarts.py,
--max-restarts) while the others keep serving: the frontends retry a request whose backend is gone on
another one and the master stops routing to it. The cluster exits (code 1) only when nothing could serve:
no frontend or no backend left to restart. A part exiting while the cluster starts stops it at once.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

import httpx

from launcher.cluster_probe import healthy, routable
from launcher.restarts import RestartPolicy, Restarts
from launcher.usage import USAGE_ERROR, UsageError
from kvyard.cluster_auth import is_loopback, new_token, read_cluster_token
from kvyard.model_path import ModelFileError
from kvyard.parent_death import die_with_parent
from kvyard.ports import backend_grpc_port, backend_http_port
from kvyard.roles import Role

log = logging.getLogger("kvyard.cluster")

MAX_FRONTENDS = 10      # frontends take PORT .. PORT+9
MASTER_OFFSET = 10      # the master listens on PORT+10
BACKEND_OFFSET = 20     # backend k's START_PORT is PORT+20+10k (gRPC +1, HTTP +5)
BACKEND_STRIDE = 10
LOOPBACK = "127.0.0.1"
EMBEDDING_PART = "embedding"  # the name of the pooling model's backends


@dataclass(frozen=True)
class Part:
    """One process of the local cluster."""
    name: str            # "frontend-1", "master", "backend-2", "prefill-1", "decode-1"
    role: Role           # its ROLE_TYPE
    start_port: int      # its START_PORT

    @property
    def is_backend(self) -> bool:
        """A process with a backend's ports (gRPC +1, HTTP +5): the backends, and VIT processes."""
        return self.role.is_backend or self.role is Role.VIT

    @property
    def grpc_address(self) -> str:
        return f"{LOOPBACK}:{backend_grpc_port(self.start_port)}"

    @property
    def health_url(self) -> str:
        port = backend_http_port(self.start_port) if self.is_backend else self.start_port
        return f"http://{LOOPBACK}:{port}/health"


@dataclass(frozen=True)
class Layout:
    """Where every part of a local cluster listens: the one port layout `kvyard cluster` uses."""
    master: Part
    backends: tuple[Part, ...]
    frontends: tuple[Part, ...]

    @property
    def parts(self) -> tuple[Part, ...]:
        """In start order; stopped in reverse."""
        return (self.master, *self.backends, *self.frontends)

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.master.start_port}"


def plan(port: int, frontends: int, pdfusion: int, prefill: int, decode: int, embedding: int = 0,
         vit: int = 0) -> Layout:
    """Raises UsageError for a shape that cannot run. embedding: backends of the pooling model
    (EMBEDDING_MODEL_PATH), last; vit: ROLE_TYPE=VIT processes, before them (in `backends`)."""
    if frontends < 1 or frontends > MAX_FRONTENDS:
        raise UsageError(f"--frontends must be 1..{MAX_FRONTENDS}, got {frontends}")
    if (prefill > 0) != (decode > 0):
        raise UsageError(f"--prefill and --decode go together (got --prefill {prefill} --decode {decode}): a "
                         "PREFILL backend hands every request to a DECODE one")
    if pdfusion + prefill == 0:
        raise UsageError("no backend: give --backends N (N >= 1) or --prefill P --decode D")
    kinds = [("backend", Role.PDFUSION, pdfusion), ("prefill", Role.PREFILL, prefill), ("decode", Role.DECODE, decode),
             ("vit", Role.VIT, vit), (EMBEDDING_PART, Role.PDFUSION, embedding)]
    backends: list[Part] = []
    for name, role, count in kinds:
        for i in range(count):
            backends.append(Part(f"{name}-{i + 1}", role, port + BACKEND_OFFSET + BACKEND_STRIDE * len(backends)))
    last = backend_http_port(backends[-1].start_port)
    if last > 65535:
        raise UsageError(f"--port {port} leaves no room for {len(backends)} backends (they need ports up to {last})")
    return Layout(master=Part("master", Role.MASTER, port + MASTER_OFFSET),
                  backends=tuple(backends),
                  frontends=tuple(Part(f"frontend-{i + 1}", Role.FRONTEND, port + i) for i in range(frontends)))


def part_env(layout: Layout, part: Part, base: Mapping[str, str], frontend_host: str) -> dict[str, str]:
    """The environment of one part: the shared settings, then what its place in the cluster fixes."""
    env = {**base, "ROLE_TYPE": part.role.value, "START_PORT": str(part.start_port), "HOST": LOOPBACK}
    for wired in ("MASTER_ADDRESS", "BACKEND_ADDRESS", "BACKEND_ADDRESSES", "DECODE_ADDRESS", "ADVERTISE_HOST",
                  "FRONTEND_SERVER_COUNT", "MASTER_BACKENDS", "MASTER_BACKEND_DNS", "MODEL_SERVICE_CONFIG",
                  "EMBEDDING_BACKEND_ADDRESS", "VIT_ADDRESSES"):
        env.pop(wired, None)  # the cluster wires these itself
    if part.name.startswith(EMBEDDING_PART):
        from launcher.launch import embedding_env
        env = dict(embedding_env(env, part.start_port))
    if part.is_backend:
        env["MASTER_ADDRESS"] = layout.master_address
        if part.role == Role.PDFUSION:  # the cluster's frontends are parts of their own
            env["FRONTEND_SERVER_COUNT"] = "0"
        if part.role == Role.PREFILL:  # used when the master is unreachable and a frontend calls it directly
            decodes = [b for b in layout.backends if b.role == Role.DECODE]
            prefills = [b for b in layout.backends if b.role == Role.PREFILL]
            env["DECODE_ADDRESS"] = decodes[prefills.index(part) % len(decodes)].grpc_address
        vits = [b.grpc_address for b in layout.backends if b.role == Role.VIT]
        if vits and part.role in (Role.PDFUSION, Role.PREFILL) and not _embedding(part):
            env["VIT_ADDRESSES"] = ",".join(vits)  # their images go there: they load no tower of their own
    elif part.role == Role.FRONTEND:
        direct = [b.grpc_address for b in layout.backends if b.role in (Role.PDFUSION, Role.PREFILL)
                  and not _embedding(b)]
        env.update(HOST=frontend_host, MASTER_ADDRESS=layout.master_address, BACKEND_ADDRESS=direct[0],
                   BACKEND_ADDRESSES=",".join(direct))
        pooling = [b.grpc_address for b in layout.backends if _embedding(b)]
        if pooling:
            env["EMBEDDING_BACKEND_ADDRESS"] = pooling[0]
    return env


def _embedding(part: Part) -> bool:
    return part.name.startswith(EMBEDDING_PART)


def shared_env(environ: Mapping[str, str], overrides: Mapping[str, str], layout: Layout) -> dict[str, str]:
    """What every part shares: the environment, the flags over it, one cluster token, and a share of the
    cores for each backend unless TORCH_NUM_THREADS says otherwise."""
    env = {**environ, **overrides}
    if not read_cluster_token(env):
        env["CLUSTER_TOKEN"] = new_token()
    if not env.get("TORCH_NUM_THREADS"):
        env["TORCH_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(layout.backends)))
    return env


def check(layout: Layout, shared: Mapping[str, str], frontend_host: str) -> None:
    """Every role's config, built here once, so a bad flag fails before anything starts."""
    from backend.config import BackendConfig
    from frontend.config import FrontendConfig
    from kvyard.logs import check_log_level
    from master.config import MasterConfig

    check_log_level(shared)
    MasterConfig.from_env(part_env(layout, layout.master, shared, frontend_host))
    for part in layout.backends:
        BackendConfig.from_env(part_env(layout, part, shared, frontend_host))
    FrontendConfig.from_env(part_env(layout, layout.frontends[0], shared, frontend_host))


def run_cluster(ns: argparse.Namespace, overrides: Mapping[str, str], explain: Callable[[str], str] = str) -> int:
    """Start the cluster `ns` describes; `explain` names the flag behind a config error's variable."""
    try:
        pdfusion = ns.backends if ns.backends is not None else (0 if ns.prefill or ns.decode else 2)
        embedding = int(bool({**os.environ, **overrides}.get("EMBEDDING_MODEL_PATH")))
        layout = plan(ns.port, ns.frontends, pdfusion, ns.prefill, ns.decode, embedding, ns.vit)
        shared = shared_env(os.environ, overrides, layout)
        check(layout, shared, ns.host)
        if not is_loopback(ns.host) and not shared.get("API_KEY"):
            log.warning("the frontends listen on %s with no --api-key: anyone who reaches it may use them", ns.host)
    except UsageError as exc:
        print(f"kvyard: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except (ValueError, ModelFileError) as exc:
        print(f"kvyard: error: {explain(str(exc))}", file=sys.stderr)
        return USAGE_ERROR
    generated = not read_cluster_token({**os.environ, **overrides})
    return LocalCluster(layout, shared, ns.host, ns.ready_timeout_s, generated,
                        RestartPolicy(max_restarts=ns.max_restarts)).run()


class LocalCluster:
    """Owns the part processes: starts them, waits until the cluster serves, stops them in order."""

    def __init__(self, layout: Layout, shared: Mapping[str, str], frontend_host: str, ready_timeout_s: float,
                 token_generated: bool, restart_policy: RestartPolicy = RestartPolicy(max_restarts=5)) -> None:
        self.layout = layout
        self.token_generated = token_generated
        self.shared = shared
        self.frontend_host = frontend_host
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[Part, subprocess.Popen[bytes]] = {}
        self.started_at: dict[Part, float] = {}
        self.restarts = Restarts(restart_policy)
        self.restart_at: dict[Part, float] = {}   # exited parts waiting out their backoff
        self.recovering: set[Part] = set()        # restarted parts not healthy yet
        self.left_down: set[Part] = set()         # parts past their restart bound
        self.stopping = threading.Event()
        self._signals = 0
        self.started = time.monotonic()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            # Frontends last, once there is something to route to: their first requests then find it.
            for part in (self.layout.master, *self.layout.backends):
                self._start(part)
            if not self._wait_ready([*self.layout.backends, self.layout.master]):
                return 1
            for part in self.layout.frontends:
                self._start(part)
            if not self._wait_ready(list(self.layout.frontends)):
                return 1
            print(self.summary(), flush=True)
            return self._watch()
        finally:
            self._stop_all()

    def _start(self, part: Part) -> None:
        env = part_env(self.layout, part, self.shared, self.frontend_host)
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen([sys.executable, "-m", "kvyard"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                process_group=0,  # our Ctrl-C is ours: we stop the parts in order
                                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self.procs[part] = proc
        self.started_at[part] = time.monotonic()
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(part.name, proc.stdout), name=f"log-{part.name}", daemon=True).start()

    def _exited(self) -> Part | None:
        return next((p for p, proc in self.procs.items() if proc.poll() is not None), None)

    def _wait_ready(self, parts: list[Part]) -> bool:
        """These parts healthy and every backend routable in the master."""
        deadline = self.started + self.ready_timeout_s
        pending = parts
        expected = {b.grpc_address for b in self.layout.backends}
        with httpx.Client(timeout=2.0) as client:
            while not self.stopping.is_set():
                dead = self._exited()
                if dead is not None:
                    print(f"kvyard: error: {dead.name} exited with code {self.procs[dead].returncode} while the "
                          "cluster was starting (its lines above say why)", file=sys.stderr, flush=True)
                    return False
                if time.monotonic() > deadline:
                    print(f"kvyard: error: the cluster was not serving after {self.ready_timeout_s:.0f} s; still "
                          f"waiting for {', '.join(p.name for p in pending) or 'the master to see every backend'}",
                          file=sys.stderr, flush=True)
                    return False
                pending = [p for p in pending if not healthy(client, p.health_url)]
                if not pending and expected <= routable(client, self.layout.master_address):
                    return True
                time.sleep(0.5)
        return False

    def summary(self) -> str:
        lay = self.layout
        host = LOOPBACK if self.frontend_host in ("0.0.0.0", "::") else self.frontend_host
        first = f"http://{host}:{lay.frontends[0].start_port}"
        lines = ["", f"kvyard cluster is serving: {len(lay.backends)} backends, {len(lay.frontends)} "
                     f"frontend{'s' if len(lay.frontends) > 1 else ''}, one master (Ctrl-C stops it all)", ""]
        for f in lay.frontends:
            lines.append(f"  {f.name:<12} http://{host}:{f.start_port}  (OpenAI API)")
        lines.append(f"  {'master':<12} http://{lay.master_address}  (dashboard: http://{lay.master_address}/dashboard)")
        for b in lay.backends:
            lines.append(f"  {b.name:<12} {b.role:<8} gRPC {b.grpc_address}  HTTP {LOOPBACK}:{backend_http_port(b.start_port)}")
        model = self.shared.get("MODEL_NAME", "").split(",")[0]
        model_field = f'"model": "{model}", ' if model else ""
        key = self.shared.get("API_KEY")
        auth = " -H 'Authorization: Bearer <your --api-key>'" if key else ""
        lines += ["", "  its parts share a cluster token generated for this launch (set CLUSTER_TOKEN to choose it)"
                  if self.token_generated else "  its parts share the cluster token you configured", "",
                  f"  curl {first}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
                  f"    -d '{{{model_field}\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital "
                  "of France?\"}], \"temperature\": 0}'",
                  f"  # any OpenAI client: base_url=\"{first}/v1\"", ""]
        if any(_embedding(b) for b in lay.backends):  # the pooling model answers beside the chat model
            lines[-1:] = [f"  curl {first}/v1/embeddings{auth} -H 'Content-Type: application/json' \\",
                          "    -d '{\"input\": [\"The cat sat on the mat.\", \"A dog barked.\"]}'", ""]
        return "\n".join(lines)

    def _watch(self) -> int:
        """Until a signal: restart parts that exit, tell when they serve again; 1 when nothing can serve."""
        with httpx.Client(timeout=1.0) as client:
            while not self.stopping.wait(0.5):
                now = time.monotonic()
                for part, proc in list(self.procs.items()):
                    if proc.poll() is not None and part not in self.restart_at and part not in self.left_down:
                        self._on_exit(part, proc.returncode, now)
                for part, at in list(self.restart_at.items()):
                    if now >= at and not self.stopping.is_set():
                        del self.restart_at[part]
                        self._start(part)
                        self.recovering.add(part)
                for part in list(self.recovering):
                    if self.procs[part].poll() is None and healthy(client, part.health_url):
                        self.recovering.discard(part)
                        print(f"kvyard: {part.name} is serving again", file=sys.stderr, flush=True)
                if not self._can_serve():
                    print("kvyard: error: no frontend or no backend is left to serve; stopping the cluster",
                          file=sys.stderr, flush=True)
                    return 1
        return 0

    def _on_exit(self, part: Part, code: int | None, now: float) -> None:
        """One line says what happened and what the cluster does about it."""
        self.recovering.discard(part)
        delay = self.restarts.on_exit(part.name, self.started_at[part], now)
        if delay is None:
            self.left_down.add(part)
            p = self.restarts.policy
            print(f"kvyard: error: {part.name} exited with code {code}; not restarting it ({p.max_restarts} "
                  f"restarts within {p.window_s:.0f} s, --max-restarts); the rest of the cluster keeps serving",
                  file=sys.stderr, flush=True)
            return
        self.restart_at[part] = now + delay
        print(f"kvyard: {part.name} exited with code {code}; restarting it in {delay:.0f} s (restart "
              f"{self.restarts.count(part.name)} of at most {self.restarts.policy.max_restarts} within "
              f"{self.restarts.policy.window_s:.0f} s); the rest of the cluster keeps serving",
              file=sys.stderr, flush=True)

    def _can_serve(self) -> bool:
        """A frontend and a backend that takes requests (and a DECODE one for PREFILL) are up or coming back."""
        def any_left(parts: list[Part]) -> bool:
            return any(p not in self.left_down for p in parts)
        lay = self.layout
        decodes = [b for b in lay.backends if b.role == Role.DECODE]
        return (any_left(list(lay.frontends))
                and any_left([b for b in lay.backends if b.role in (Role.PDFUSION, Role.PREFILL)])
                and (not decodes or any_left(decodes)))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal %d: stopping the cluster (frontends drain first)", signum)
            self.stopping.set()
            return
        log.info("signal %d again: killing every part", signum)
        for proc in self.procs.values():
            if proc.poll() is None:
                _kill_group(proc)

    def _stop_all(self) -> None:
        """Frontends (they drain), then backends, then the master: each group stopped together."""
        grace = float(self.shared.get("DRAIN_GRACE_S") or 30)
        parts = self.layout.parts
        groups = [[p for p in parts if p.role == Role.FRONTEND], [p for p in parts if p.is_backend],
                  [p for p in parts if p.role == Role.MASTER]]
        for group in groups:
            running = [self.procs[p] for p in group if p in self.procs and self.procs[p].poll() is None]
            for proc in running:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 10
            for proc in running:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    proc.wait()


def _pump(name: str, stream: IO[bytes]) -> None:
    """Copy a part's output to ours, each line prefixed with its name."""
    prefix = f"{name:<11}| ".encode()
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        out.write(prefix + line)
        out.flush()
    stream.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a part and whatever it started (its process group: the part leads one of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
