"""Which package may import which: the shared package imports no role, a role imports no other role (but
for the few pure pieces named here), and protobuf stays at the gRPC edges."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.procs import REPO

ROLES = ("frontend", "master", "backend", "gateway")
PACKAGES = ("kvyard", "launcher", "renderers", *ROLES)

# Imports across role lines that are meant: each names the module imported and why.
ALLOWED = {
    ("frontend", "renderers"),          # chat templates and tool-call formats are the frontend's
    ("gateway", "master.policy"),       # the gateway routes with the master's pure policy (no state)
}
# The gRPC edges: the only files that see protobuf messages.
PROTO_EDGES = {
    "kvyard/pb_errors.py",              # the error table's protobuf side
    "frontend/backend_client.py",
    "frontend/rtp_backend_client.py",   # the same seam over RTP-LLM's RpcService (BACKEND_PROTOCOL=rtp_llm)
    "master/backend_poller.py",
    "backend/server.py", "backend/pb_convert.py", "backend/grpc_server.py",
    "backend/pd_transfer.py",           # the KV hand-over stream is itself a gRPC protocol
    "backend/mock_backend.py",          # the real servicer's set-up, over a scripted engine
    "backend/rtp_rpc.py",               # RTP-LLM's RpcService, translated to kvyard's
    "backend/vit_server.py", "backend/vit_client.py",  # the VIT's EmbedImages call: its servicer and its caller
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((Path(REPO) / package).rglob("*.py"))


def _allowed(package: str, module: str) -> bool:
    return any(package == src and (module == dst or module.startswith(dst + ".")) for src, dst in ALLOWED)


def test_packages_import_only_what_they_may() -> None:
    wrong = []
    for package in PACKAGES:
        if package == "launcher":
            continue  # the command line starts every role: the one package that knows them all
        for path in _files(package):
            if path == Path(REPO) / "kvyard/__main__.py":
                continue  # `python -m kvyard` is the command line: it calls launcher.cli, nothing else
            for module in _imports(path):
                top = module.split(".")[0]
                if top in PACKAGES and top not in (package, "kvyard") and not _allowed(package, module):
                    wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_protobuf_only_at_the_edges() -> None:
    seen = {str(path.relative_to(REPO)) for package in PACKAGES for path in _files(package)
            if any(m == "proto" or m.startswith("proto.") for m in _imports(path))}
    assert seen <= PROTO_EDGES, sorted(seen - PROTO_EDGES)


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom master.registry import Registry\nif True:\n    from proto import model_rpc_pb2\n")
    assert {"master.registry", "proto", "os"} <= _imports(bad)
    assert not _allowed("frontend", "master.registry") and _allowed("gateway", "master.policy")


def _module_graph() -> dict[str, set[str]]:
    """Project module → the project modules it imports anywhere in the file (at the top, inside a function, or
    only for type checking: each is a dependency of its design), `from package import name` resolved to the
    module `name` when it is one."""
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for package in (*PACKAGES, "proto") for p in _files(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
                    break
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_import_cycles() -> None:
    """No circle of modules importing each other, however lazily: each file's dependencies point one way."""
    assert import_cycles(_module_graph()) == []


def test_the_cycle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    graph = _module_graph()
    assert "backend.sequence" in graph["backend.scheduler"]  # a real edge is seen
    graph["backend.sequence"].add("backend.scheduler")
    assert ["backend.block_pool", "backend.scheduler", "backend.sequence"] in import_cycles(graph)
