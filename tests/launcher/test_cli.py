"""The command line: `kvyard --help` prints help, every flag is its environment variable (a flag wins, the
variable alone still works, some role reads it), bad input is one line and exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import FLAGS, UsageError, cluster_parser, explain, flag_env, main, parse_cluster_args, serve_env
from kvyard.pooling_model import embedded_embedding_path
from launcher.local_cluster import check, part_env, plan
from kvyard.model_path import embedded_model_path
from tests.support.env_reads import role_reads
from tests.support.procs import CLUSTER_TOKEN, REPO

ROLE_FOR_FLAG = {"MASTER_BACKENDS": "MASTER", "MASTER_BACKEND_DNS": "MASTER", "DECODE_ADDRESS": "PREFILL",
                 "ADVERTISE_HOST": "MASTER"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("ROLE_TYPE", "CHECKPOINT_PATH", "START_PORT")}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvyard", *args], env={**full, **(env or {})}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["--help"], ["cluster", "--help"]])
def test_help_prints_help_and_starts_nothing(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: kvyard"), proc.stdout[:200]
    for needle in (["--backends", "--prefill", "--decode", "--frontends"] if "cluster" in args else
                   ["--model", "--host", "--port", "--served-model-name", "--api-key", "--role", "--max-num-seqs",
                    "--kv-cache-mb", "--dtype", "START_PORT", "kvyard cluster"]):
        assert needle in proc.stdout, needle


@pytest.mark.parametrize("args,needle", [
    (["--port", "abc"], "--port (START_PORT) must be an integer, got 'abc'"),
    (["serve", "--bogus"], "unrecognized arguments: --bogus"),
    (["sevre"], "unknown command 'sevre'"),
    (["--role", "nope"], "unknown --role (ROLE_TYPE) 'nope'"),
    (["serve", "/does/not/exist.gguf"], "/does/not/exist.gguf"),
    (["--kv-cache-mb", "0"], "--kv-cache-mb (KV_CACHE_MB) must be >= 1"),
    (["--log-level", "loud"], "--log-level (LOG_LEVEL) must be one of"),
    (["--served-model-name", "a", "a"], "names one model twice"),
    (["--served-model-name", "a,b"], "takes values separated by spaces"),
    (["--model", "x.gguf", "y.gguf"], "MODEL or --model, not both"),
    (["--host", "0.0.0.0", "--role", "master"], "--host (HOST)=0.0.0.0 opens the internal ports"),
    (["cluster", "--backends", "-1"], "--backends"),
    (["cluster", "--prefill", "1"], "--prefill and --decode go together"),
    (["cluster", "--backends", "0"], "no backend"),
    (["cluster", "--frontends", "11"], "--frontends must be 1..10"),
    (["cluster", "--port", "65530"], "leaves no room"),
    (["cluster", "--kv-cache-mb", "x"], "--kv-cache-mb (KV_CACHE_MB) must be an integer"),
    (["cluster", "--role", "MASTER"], "unrecognized arguments: --role"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CLUSTER_TOKEN", "CLUSTER_TOKEN_FILE", "ROLE_TYPE", "START_PORT", "CHECKPOINT_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvyard: error: "), lines
    assert needle in lines[0], lines[0]


def test_python_m_kvyard_refuses_bad_input_in_one_line() -> None:
    proc = run_cli("--port", "abc", env={"CLUSTER_TOKEN": ""})
    assert proc.returncode == 2 and proc.stderr.strip() == "kvyard: error: --port (START_PORT) must be an integer, got 'abc'"
    proc = run_cli(env={"ROLE_TYPE": "NOPE"})  # the environment alone, as before the flags
    assert proc.returncode == 2 and proc.stderr.strip().startswith("kvyard: error: unknown ROLE_TYPE 'NOPE'")


def test_a_flag_wins_over_its_variable_and_the_variable_alone_still_works() -> None:
    environ = {"START_PORT": "9000", "KV_CACHE_MB": "64", "ROLE_TYPE": "FRONTEND"}
    env = serve_env(["--port", "9100", "--served-model-name", "small", "tiny"], environ)
    assert env["START_PORT"] == "9100" and env["KV_CACHE_MB"] == "64" and env["ROLE_TYPE"] == "FRONTEND"
    assert env["MODEL_NAME"] == "small,tiny"
    assert serve_env([], environ) == {**environ, "HOST": "127.0.0.1"}  # local commands listen on loopback
    assert serve_env([], {"HOST": "0.0.0.0"})["HOST"] == "0.0.0.0"
    assert serve_env(["--host", "::1"], {"HOST": "0.0.0.0"})["HOST"] == "::1"
    assert serve_env(["serve-me.gguf"], {})["CHECKPOINT_PATH"] == "serve-me.gguf"


def test_every_flag_is_read_by_a_role() -> None:
    """A flag that sets a variable no role reads would be accepted and ignored."""
    model = str(embedded_model_path())
    values = {"CHECKPOINT_PATH": model, "TOKENIZER_PATH": model, "MODEL_NAME": "m,alias", "MODEL_TYPE": "default",
              "HOST": "127.0.0.1", "START_PORT": "9000", "API_KEY": "k", "MASTER_ADDRESS": "127.0.0.1:9010",
              "BACKEND_ADDRESS": "127.0.0.1:9001", "BACKEND_ADDRESSES": "127.0.0.1:9001",
              "DECODE_ADDRESS": "127.0.0.1:9021", "ADVERTISE_HOST": "127.0.0.1", "FRONTEND_SERVER_COUNT": "1",
              "DEVICE": "cpu", "DTYPE": "float32", "WEIGHT_FORMAT": "auto", "ACTIVATIONS": "auto",
              "KV_CACHE_MB": "64", "KV_CACHE_DTYPE": "auto", "BLOCK_SIZE": "16", "MAX_NUM_SEQS": "8",
              "MAX_NUM_BATCHED_TOKENS": "512", "MAX_SEQ_LEN": "1024", "TORCH_NUM_THREADS": "1",
              "TOOL_CALL_PARSER": "hermes", "CORS_ALLOW_ORIGINS": "http://a.example", "CONCURRENCY_LIMIT": "8",
              "MAX_BODY_BYTES": "65536", "REQUEST_TIMEOUT_S": "60", "DRAIN_GRACE_S": "5",
              "MASTER_BACKENDS": "127.0.0.1:9001", "MASTER_BACKEND_DNS": "localhost:9001", "LOG_LEVEL": "info",
              "CLUSTER_TOKEN": CLUSTER_TOKEN, "EMBEDDING_MODEL_PATH": "embedded", "EMBEDDING_MODEL_NAME": "e"}
    read = set()
    for role in ("PDFUSION", "MASTER", "PREFILL", "FRONTEND"):
        read |= role_reads({**values, "ROLE_TYPE": role})
    flag_vars = {f.env for f in FLAGS} - {"CLUSTER_TOKEN_FILE"}  # one of the two: CLUSTER_TOKEN is set here
    assert flag_vars - read == set()
    assert {"CLUSTER_TOKEN_FILE", "ROLE_TYPE"} <= read


def test_flag_errors_name_the_flag() -> None:
    assert explain("START_PORT must be an integer, got 'x'", {"START_PORT": "x"}) == \
        "--port (START_PORT) must be an integer, got 'x'"
    assert explain("CLUSTER_TOKEN_FILE 'f' cannot be read", {"CLUSTER_TOKEN_FILE": "f"}).startswith("--cluster-token-file")
    assert explain("START_PORT must be an integer", {}) == "START_PORT must be an integer"  # set by the environment
    with pytest.raises(UsageError):
        flag_env(cluster_parser().parse_args(["--model", " "]), cluster=True)


def test_cluster_port_layout() -> None:
    lay = plan(8088, frontends=2, pdfusion=2, prefill=1, decode=1)
    assert [f.start_port for f in lay.frontends] == [8088, 8089]
    assert lay.master.start_port == 8098
    assert [(b.name, b.role, b.start_port) for b in lay.backends] == [
        ("backend-1", "PDFUSION", 8108), ("backend-2", "PDFUSION", 8118), ("prefill-1", "PREFILL", 8128),
        ("decode-1", "DECODE", 8138)]
    ports = [p for part in lay.parts for p in ((part.start_port + 1, part.start_port + 5) if part.is_backend
                                                 else (part.start_port,))]
    assert len(ports) == len(set(ports))


def test_a_split_cluster_is_wired_through_the_master() -> None:
    """`kvyard cluster --backends 1 --prefill 2 --decode 1 --frontends 2`: every backend registers with the master, a
    PREFILL one knows a DECODE one for when the master is away, frontends fall back to the non-DECODE
    backends only; addresses from the caller's environment never leak in; each part's config builds, and
    every variable the cluster sets is one its role reads."""
    lay = plan(9000, frontends=2, pdfusion=1, prefill=2, decode=1)
    model = str(embedded_model_path())
    base = {"CLUSTER_TOKEN": CLUSTER_TOKEN, "CHECKPOINT_PATH": model, "KV_CACHE_MB": "64",
            "MASTER_BACKENDS": "10.9.9.9:1", "DECODE_ADDRESS": "10.9.9.9:2", "BACKEND_ADDRESS": "10.9.9.9:3"}
    check(lay, base, "127.0.0.1")
    envs = {p.name: part_env(lay, p, base, "0.0.0.0") for p in lay.parts}
    assert all(e["MASTER_ADDRESS"] == "127.0.0.1:9010" for n, e in envs.items() if n != "master")
    assert "MASTER_BACKENDS" not in envs["master"]  # it learns them by registration
    assert envs["prefill-1"]["DECODE_ADDRESS"] == envs["prefill-2"]["DECODE_ADDRESS"] == "127.0.0.1:9051"
    assert "DECODE_ADDRESS" not in envs["decode-1"] and "DECODE_ADDRESS" not in envs["backend-1"]
    assert envs["backend-1"]["FRONTEND_SERVER_COUNT"] == "0"  # the cluster's frontends are parts of their own
    for name in ("frontend-1", "frontend-2"):
        assert envs[name]["HOST"] == "0.0.0.0" and envs[name]["BACKEND_ADDRESS"] == "127.0.0.1:9021"
        assert envs[name]["BACKEND_ADDRESSES"] == "127.0.0.1:9021,127.0.0.1:9031,127.0.0.1:9041"
    assert {e["HOST"] for n, e in envs.items() if not n.startswith("frontend")} == {"127.0.0.1"}
    for name, env in envs.items():
        assert set(env) - set(base) <= role_reads(env), name  # what the cluster wires is used


def test_a_cluster_with_a_vit(tmp_path: Path) -> None:
    """`kvyard cluster --vit 1 --prefill 1 --decode 1` on a vision model: the VIT registers with the master,
    the PREFILL backend (not the DECODE one) sends its images there, frontends never call it."""
    from tests.support.tiny_vision import save_llava_dir, tiny_llava
    lay = plan(9000, frontends=1, pdfusion=0, prefill=1, decode=1,
               vit=cluster_parser().parse_args(["--vit", "1"]).vit)
    base = {"CLUSTER_TOKEN": CLUSTER_TOKEN, "CHECKPOINT_PATH": str(save_llava_dir(tiny_llava(), tmp_path / "llava")),
            "KV_CACHE_MB": "16", "VIT_ADDRESSES": "10.9.9.9:1"}
    check(lay, base, "127.0.0.1")
    envs = {p.name: part_env(lay, p, base, "127.0.0.1") for p in lay.parts}
    assert envs["vit-1"]["ROLE_TYPE"] == "VIT" and envs["vit-1"]["MASTER_ADDRESS"] == "127.0.0.1:9010"
    assert "VIT_ADDRESSES" not in envs["vit-1"] and "VIT_ADDRESSES" not in envs["decode-1"]
    assert envs["prefill-1"]["VIT_ADDRESSES"] == "127.0.0.1:9041"
    assert envs["frontend-1"]["BACKEND_ADDRESSES"] == "127.0.0.1:9021"
    for name, env in envs.items():
        assert set(env) - set(base) <= role_reads(env), name


def test_a_cluster_with_an_embedding_model() -> None:
    """`kvyard cluster --embedding-model embedded`: one more backend serving all-MiniLM-L6-v2 under its own name,
    registered with the master; frontends know it as the pooling model's direct backend, not a chat one."""
    lay = plan(9000, frontends=1, pdfusion=1, prefill=0, decode=0, embedding=1)
    base = {"CLUSTER_TOKEN": CLUSTER_TOKEN, "CHECKPOINT_PATH": str(embedded_model_path()), "KV_CACHE_MB": "64",
            "EMBEDDING_MODEL_PATH": "embedded"}
    check(lay, base, "127.0.0.1")
    envs = {p.name: part_env(lay, p, base, "127.0.0.1") for p in lay.parts}
    emb = envs["embedding-1"]
    assert emb["CHECKPOINT_PATH"] == str(embedded_embedding_path()) and emb["MODEL_NAME"] == "all-MiniLM-L6-v2"
    assert emb["MASTER_ADDRESS"] == "127.0.0.1:9010" and emb["START_PORT"] == "9030"
    assert envs["frontend-1"]["BACKEND_ADDRESSES"] == "127.0.0.1:9021"
    assert envs["frontend-1"]["EMBEDDING_BACKEND_ADDRESS"] == "127.0.0.1:9031"
    assert envs["backend-1"]["CHECKPOINT_PATH"] == str(embedded_model_path())


def test_cluster_takes_start_port_like_every_command() -> None:
    """`START_PORT=9000 make cluster` serves its first frontend on 9000 (it was 8088 whatever START_PORT said);
    --port still wins, and a bad START_PORT is a usage error naming it."""
    assert parse_cluster_args(["--backends", "1"], {"START_PORT": "9000"}).port == 9000
    assert parse_cluster_args(["--port", "7000"], {"START_PORT": "9000"}).port == 7000
    assert parse_cluster_args([], {}).port == 8088
    with pytest.raises(UsageError, match="START_PORT"):
        parse_cluster_args([], {"START_PORT": "x"})
