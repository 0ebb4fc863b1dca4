"""docs/configuration.md against the code: every environment variable the code reads is in exactly one table,
every variable a table lists is read, and each role's reads are in its own table or in the shared table that
names it (`read by`). Reads are found two ways: by scanning the source (a read behind any branch counts) and
by running each role's config builder over a recording mapping (a read in kvyard/'s shared helpers counts
for the role that calls it)."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvyard.model_path import embedded_model_path
from tests.support.env_reads import VAR_NAME, RecordingEnv, static_reads

REPO = Path(__file__).resolve().parent.parent
CONFIG_DOC = REPO / "docs" / "configuration.md"
PACKAGES = ("kvyard", "launcher", "proto", "frontend", "master", "backend", "renderers", "gateway")
FOREIGN = {"PATH"}  # read to find the compiler, not a setting of ours
ROLES = ("launcher", "frontend", "backend", "master", "gateway", "mock backend", "mock master")
# Which role a file's reads belong to (kvyard/'s helpers belong to whichever role calls them: see role_reads).
FILE_ROLES = (("backend/mock_backend.py", "mock backend"), ("master/mock_master.py", "mock master"),
              ("launcher/", "launcher"), ("frontend/", "frontend"), ("backend/", "backend"),
              ("master/", "master"), ("gateway/", "gateway"))


def doc_tables() -> list[tuple[Path, str, list[str], list[list[str]]]]:
    """Every markdown table of the README and docs/ whose first column is `variable`: (page, the heading
    above it, header cells, rows of cells)."""
    out = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        heading, table, fence = "", None, False
        for line in page.read_text().splitlines() + [""]:
            if line.startswith("```"):
                fence = not fence
            if fence:
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells is None:
                if table is not None:
                    out.append(table)
                table = None
                if line.startswith("#"):
                    heading = line.lstrip("#").strip()
            elif table is None:
                table = (page, heading, [c.lower() for c in cells], []) if cells[0] == "variable" else None
                if table is None:
                    table = (page, heading, ["-"], [])  # some other table: followed but not kept
            elif not set(cells[0]) <= set("-: "):
                table[3].append(cells)
    return [t for t in out if t[2][0] == "variable"]


def documented() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Variable → every (table heading, roles) it is listed under; a role table's heading names its role,
    the shared table's rows name theirs in `read by`."""
    out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for page, heading, header, rows in doc_tables():
        for cells in rows:
            if "read by" in header:
                roles = tuple(r.strip() for r in cells[header.index("read by")].split(","))
            else:
                roles = tuple(r for r in sorted(ROLES, key=len, reverse=True) if heading.lower().startswith(r))[:1]
            for name in re.findall(r"`([^`]+)`", cells[0]):
                if VAR_NAME.fullmatch(name):
                    out.setdefault(name, []).append((f"{page.name}: {heading}", roles))
    return out


def code_reads() -> dict[str, set[str]]:
    files = (p for d in PACKAGES for p in sorted((REPO / d).rglob("*.py")))
    return {name: {str(Path(f).relative_to(REPO)) for f in files_} for name, files_ in static_reads(files).items()
            if name not in FOREIGN}


def _record(build, values: dict[str, str]) -> set[str]:
    from kvyard.logs import check_log_level
    env = RecordingEnv({"KVYARD_KERNELS": "0", **values})
    check_log_level(env)  # every role process sets up its logging from LOG_LEVEL
    build(env)
    return env.read - ({"KVYARD_KERNELS"} - set(values))


def role_reads() -> dict[str, set[str]]:
    """What each role's config builders read (a few settings each, so branches are taken), plus what the
    files of the role's package read."""
    from backend.config import BackendConfig
    from backend.mock_backend import MockBackendConfig
    from frontend.config import FrontendConfig
    from gateway.config import GatewayConfig
    from kvyard.roles import Role, parse_role
    from launcher.launch import drain_grace_s, frontend_count, with_cluster_token
    from master.config import MasterConfig
    from master.mock_master import MockMasterConfig

    model = str(embedded_model_path())

    def launcher(env: RecordingEnv) -> None:
        parse_role(env.get("ROLE_TYPE"))  # type: ignore[arg-type]
        frontend_count(env), drain_grace_s(env), with_cluster_token(Role.PDFUSION, env)  # type: ignore[arg-type]

    runs = {
        "launcher": [(launcher, {"CLUSTER_TOKEN": "t" * 32})],  # none set: it makes one (a copy of env)
        "frontend": [(FrontendConfig.from_env, {"CHECKPOINT_PATH": model})],
        "backend": [(BackendConfig.from_env, {"CHECKPOINT_PATH": model})],
        "master": [(MasterConfig.from_env, {})],
        "gateway": [(GatewayConfig.from_env, {"UPSTREAMS": "http://127.0.0.1:9"})],
        "mock backend": [(MockBackendConfig.from_env, {"MOCK_TOKEN_IDS": "[1, 2]"})],
        "mock master": [(MockMasterConfig.from_env, {"MOCK_MASTER_BACKENDS": "127.0.0.1:9",
                                                     "MOCK_MASTER_ERROR": "overloaded"})],
    }
    reads = {role: set().union(*(_record(build, values) for build, values in builds)) for role, builds in runs.items()}
    for name, files in code_reads().items():
        for f in files:
            role = next((r for prefix, r in FILE_ROLES if f.startswith(prefix)), None)
            if role:
                reads[role].add(name)
    return reads


def test_every_variable_is_in_exactly_one_table() -> None:
    twice = {name: [where for where, _ in places] for name, places in documented().items() if len(places) > 1}
    assert twice == {}


def test_the_tables_and_the_code_read_the_same_variables() -> None:
    read, listed = code_reads(), set(documented())
    assert {n: sorted(f) for n, f in read.items() if n not in listed} == {}, "read by the code, in no docs table"
    assert sorted(listed - set(read)) == [], "in a docs table, read by no code"


def test_every_flag_sets_a_documented_variable() -> None:
    from launcher.cli import FLAGS, GATEWAY_FLAGS
    assert sorted({f.env for f in FLAGS + GATEWAY_FLAGS} - set(documented())) == []


def test_each_role_reads_what_its_tables_say() -> None:
    docs = documented()
    for places in docs.values():
        for _, roles in places:
            assert roles and set(roles) <= set(ROLES), places
    reads = role_reads()
    for role in ROLES:
        listed = {name for name, places in docs.items() if any(role in roles for _, roles in places)}
        assert sorted(reads[role] - listed) == [], f"{role} reads these; its table and `read by` miss it"
        assert sorted(listed - reads[role]) == [], f"documented as read by the {role}, which does not read them"


@pytest.mark.parametrize("name", ["MASTER_POLL_INTERVAL_MS", "TIB_PORT"])
def test_a_variable_missing_from_the_tables_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check bites: drop one row and the code's read of it is reported."""
    real = doc_tables()
    trimmed = [(p, h, hd, [r for r in rows if name not in r[0]]) for p, h, hd, rows in real]
    monkeypatch.setattr(sys.modules[__name__], "doc_tables", lambda: trimmed)
    assert name in set(code_reads()) - set(documented())
