"""The command line: `kvyard serve` (the role ROLE_TYPE names; flags over the environment), `kvyard cluster`
(a master, backends and frontends on this machine) and `kvyard gateway` (ROLE_TYPE=GATEWAY over the upstream
URLs given). `kvyard` and `python -m kvyard` alone are `kvyard serve`.

Every flag is the same setting as one environment variable (FLAGS below): the flag's value is written over
the environment, and the roles' configs read and validate it once, as they read the variable. Bad input is
one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvyard.ports import start_port
from launcher.usage import USAGE_ERROR, UsageError


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the environment variable it sets."""
    flag: str                 # "--port"
    env: str                  # "START_PORT"
    help: str
    group: str                # the --help section
    metavar: str = "VALUE"
    many: bool = False        # takes one or more values, joined with "," into the variable
    cluster: bool = True      # `kvyard cluster` passes it to every process (False: the cluster sets it)


GROUPS = {"model": "model", "net": "role and network", "engine": "backend engine", "frontend": "frontend",
          "master": "master", "misc": "logging", "gateway": "gateway"}

FLAGS: tuple[Flag, ...] = (
    Flag("--model", "CHECKPOINT_PATH", "a .gguf file or a Hugging Face directory (default: the embedded "
         "SmolLM2-135M-Instruct)", "model", "PATH"),
    Flag("--tokenizer", "TOKENIZER_PATH", "where the tokenizer and chat template come from (default: --model)",
         "model", "PATH"),
    Flag("--served-model-name", "MODEL_NAME", "the name(s) clients pass as 'model'; the first is the one the "
         "cluster registers and reports, the others are aliases the frontend accepts", "model", "NAME", many=True),
    Flag("--embedding-model", "EMBEDDING_MODEL_PATH", "a pooling model served beside the chat model (embeddings, "
         "rerank, classify): a Hugging Face encoder directory, or 'embedded' for all-MiniLM-L6-v2", "model", "PATH"),
    Flag("--embedding-model-name", "EMBEDDING_MODEL_NAME", "the name clients pass as 'model' for it (default: "
         "all-MiniLM-L6-v2 / the directory's name)", "model", "NAME"),
    Flag("--lora-modules", "LORA_MODULES", "LoRA adapters (PEFT directories) served beside the model from the "
         "start, as name=path; a request names one as its 'model' (docs/lora.md)", "model", "NAME=PATH", many=True),
    Flag("--lora-root", "LORA_ROOT", "the directory adapters may be loaded from at run time "
         "(/v1/load_lora_adapter, /update); unset: run-time loading is off", "model", "DIR"),
    Flag("--max-loras", "MAX_LORAS", "adapters a backend holds at once; loading one more evicts the least "
         "recently used (default 0: no bound)", "model", "N"),
    Flag("--model-type", "MODEL_TYPE", "the renderer (chat template family), see renderers/", "model", "NAME"),
    Flag("--role", "ROLE_TYPE", "PDFUSION (default), FRONTEND, MASTER, PREFILL, DECODE, VIT, GATEWAY, "
         "MOCK_BACKEND or MOCK_MASTER", "net", "ROLE", cluster=False),
    Flag("--host", "HOST", "bind address (default 127.0.0.1; the image sets 0.0.0.0, which for internal ports "
         "needs a cluster token)", "net", "ADDRESS", cluster=False),
    Flag("--port", "START_PORT", "the frontend's HTTP port (default 8088); backend gRPC is +1, backend HTTP +5",
         "net", "PORT", cluster=False),
    Flag("--api-key", "API_KEY", "require 'Authorization: Bearer <key>' on the public API", "net", "KEY"),
    Flag("--cluster-token-file", "CLUSTER_TOKEN_FILE", "a file holding the cluster token every internal call "
         "carries (no flag for the token itself: a command line is visible to every user of the machine)",
         "net", "PATH"),
    Flag("--master-address", "MASTER_ADDRESS", "the master (host:port): frontends route through it, backends "
         "register with it", "net", "HOST:PORT", cluster=False),
    Flag("--backend-address", "BACKEND_ADDRESS", "the backend a frontend calls (default 127.0.0.1:PORT+1)",
         "net", "HOST:PORT", cluster=False),
    Flag("--backend-addresses", "BACKEND_ADDRESSES", "the backends a frontend calls round-robin while the "
         "master is unreachable", "net", "HOST:PORT", many=True, cluster=False),
    Flag("--decode-address", "DECODE_ADDRESS", "a PREFILL backend's DECODE backend when a request names none",
         "net", "HOST:PORT", cluster=False),
    Flag("--vit-addresses", "VIT_ADDRESSES", "ROLE_TYPE=VIT processes that embed a vision model's images, "
         "comma-separated (the backend then loads no tower)", "net", "HOST:PORT,...", cluster=False),
    Flag("--advertise-host", "ADVERTISE_HOST", "the address others should dial (master, backend)", "net",
         "HOST", cluster=False),
    Flag("--frontend-server-count", "FRONTEND_SERVER_COUNT", "PDFUSION: 1 starts a frontend beside the backend, "
         "0 the backend alone", "net", "N", cluster=False),
    Flag("--device", "DEVICE", "cpu or cuda (default: cuda when a GPU is visible)", "engine", "DEVICE"),
    Flag("--dtype", "DTYPE", "float32, bfloat16 or float16", "engine", "DTYPE"),
    Flag("--weight-format", "WEIGHT_FORMAT", "auto, gguf (keep GGUF blocks, C++ kernels) or dense", "engine",
         "FORMAT"),
    Flag("--activations", "ACTIVATIONS", "auto, int16 or float32 (what GGUF-block linears multiply by)",
         "engine", "KIND"),
    Flag("--kv-cache-mb", "KV_CACHE_MB", "memory for the paged KV cache (default 1024)", "engine", "MB"),
    Flag("--kv-cache-dtype", "KV_CACHE_DTYPE", "auto, float32, float16 or bfloat16", "engine", "DTYPE"),
    Flag("--block-size", "BLOCK_SIZE", "tokens per KV block (default 16; frontends must agree)", "engine", "N"),
    Flag("--max-num-seqs", "MAX_NUM_SEQS", "sequences running at once (default 64)", "engine", "N"),
    Flag("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", "token budget of one engine step (default 2048)",
         "engine", "N"),
    Flag("--max-model-len", "MAX_SEQ_LEN", "prompt + completion limit (default: the model's context)", "engine",
         "N"),
    Flag("--torch-num-threads", "TORCH_NUM_THREADS", "intra-op threads of each backend (default: torch's; "
         "`kvyard cluster`: the cores shared out among its backends)", "engine", "N"),
    Flag("--tool-call-parser", "TOOL_CALL_PARSER", "hermes/qwen or json/llama3_json/mistral", "frontend", "NAME"),
    Flag("--allowed-origins", "CORS_ALLOW_ORIGINS", "web origins allowed to call the API from a browser ('*': "
         "any)", "frontend", "ORIGIN", many=True),
    Flag("--concurrency-limit", "CONCURRENCY_LIMIT", "sequences generated at once; more are a 429 (default 1024)",
         "frontend", "N"),
    Flag("--max-body-bytes", "MAX_BODY_BYTES", "larger request bodies are a 413", "frontend", "BYTES"),
    Flag("--request-timeout-s", "REQUEST_TIMEOUT_S", "a request running longer fails (default 600)", "frontend",
         "SECONDS"),
    Flag("--drain-grace-s", "DRAIN_GRACE_S", "after SIGTERM, how long requests in flight may finish (frontend "
         "and backend; default 30)", "frontend", "SECONDS"),
    Flag("--master-backends", "MASTER_BACKENDS", "static backends, [model@]host:grpc_port", "master", "ENTRY",
         many=True, cluster=False),
    Flag("--master-backend-dns", "MASTER_BACKEND_DNS", "DNS names whose every address is a backend, "
         "[model@]name:grpc_port", "master", "ENTRY", many=True, cluster=False),
    Flag("--log-level", "LOG_LEVEL", "CRITICAL, ERROR, WARNING, INFO (default), DEBUG", "misc", "LEVEL"),
)

# `kvyard gateway`'s flags: text-inference-batcher's settings and kvyard's GATEWAY_* ones (docs/gateway.md).
GATEWAY_FLAGS: tuple[Flag, ...] = (
    Flag("--host", "HOST", "bind address (default 127.0.0.1)", "gateway", "ADDRESS"),
    Flag("--port", "TIB_PORT", "listening port (default 8000)", "gateway", "PORT"),
    Flag("--max-connect-per-upstream", "MAX_CONNECT_PER_UPSTREAM", "requests in flight per upstream (default 1)",
         "gateway", "N"),
    Flag("--wait-for", "WAIT_FOR", "ms a request may wait for a free upstream before its 429 (default 5000)",
         "gateway", "MS"),
    Flag("--timeout", "TIMEOUT", "ms one upstream exchange may take; a 504 before its first byte (default "
         "600000)", "gateway", "MS"),
    Flag("--queue-max", "GATEWAY_QUEUE_MAX", "requests waiting at once; more are a 429 (default 1024)", "gateway",
         "N"),
    Flag("--routing", "GATEWAY_ROUTING", "prefix (default) or least_connection", "gateway", "POLICY"),
    Flag("--health-interval-ms", "GATEWAY_HEALTH_INTERVAL_MS", "how often every upstream's /v1/models is asked "
         "(default 10000)", "gateway", "MS"),
    Flag("--log-level", "LOG_LEVEL", "CRITICAL, ERROR, WARNING, INFO (default), DEBUG", "misc", "LEVEL"),
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_flags(parser: argparse.ArgumentParser, cluster: bool) -> None:
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for f in FLAGS:
        if cluster and not f.cluster:
            continue
        groups[f.group].add_argument(f.flag, dest=f.env, metavar=f.metavar, nargs="+" if f.many else None,
                                     help=f"{f.help} [env {f.env}]")


def serve_parser(prog: str = "kvyard") -> _Parser:
    parser = _Parser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvyard: an OpenAI-compatible LLM serving cluster.\n\n"
                    "  kvyard [serve] [MODEL] [flags]   start the role --role / ROLE_TYPE names (default PDFUSION:\n"
                    "                                   a backend and a frontend) on this machine\n"
                    "  kvyard cluster [flags]           a master, backends and frontends on this machine\n"
                    "                                   (`kvyard cluster --help`)\n"
                    "  kvyard gateway URL... [flags]    one endpoint over OpenAI-compatible servers, queueing\n"
                    "                                   (`kvyard gateway --help`)\n\n"
                    "Each flag sets the environment variable shown beside it; the environment works too, a\n"
                    "flag wins over it.",
        epilog="examples:\n"
               "  kvyard serve --host 127.0.0.1 --port 8088\n"
               "  kvyard serve ./Qwen2.5-0.5B-Instruct-Q8_0.gguf --served-model-name qwen qwen2.5 --api-key s3cret\n"
               "  kvyard --role master --port 8090\n"
               "  kvyard cluster --backends 2")
    parser.add_argument("model", nargs="?", metavar="MODEL", help="the same as --model")
    parser.add_argument("--version", action="version", version=f"kvyard {_version()}")
    _add_flags(parser, cluster=False)
    return parser


def cluster_parser() -> _Parser:
    parser = _Parser(
        prog="kvyard cluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a whole cluster on this machine: a master, backends that register with it and "
                    "frontends that\nroute through it, all on loopback (the frontends on --host) with one "
                    "generated cluster token.\nIt prints where each part listens; Ctrl-C or SIGTERM stops "
                    "everything (frontends drain first).",
        epilog="ports: frontends PORT, PORT+1, ...; master PORT+10; backend k (from 0): PORT+20+10k, its gRPC\n"
               "+1 and HTTP +5.\n\nexample:\n  kvyard cluster --backends 2 --kv-cache-mb 256\n"
               "  kvyard cluster --prefill 1 --decode 1 --frontends 2\n"
               "  kvyard cluster --model /models/llava-1.5-7b-hf --vit 1 --prefill 1 --decode 1")
    counts = parser.add_argument_group("shape")
    counts.add_argument("--backends", type=_count, default=None, metavar="N",
                        help="PDFUSION backends (prefill + decode; default 2 unless --prefill/--decode are given)")
    counts.add_argument("--prefill", type=_count, default=0, metavar="P", help="PREFILL backends")
    counts.add_argument("--decode", type=_count, default=0, metavar="D", help="DECODE backends")
    counts.add_argument("--vit", type=_count, default=0, metavar="V",
                        help="ROLE_TYPE=VIT processes (a vision model's image tower alone): the PDFUSION and PREFILL "
                             "backends send their images there and load no tower (docs/vision.md)")
    counts.add_argument("--frontends", type=_count, default=1, metavar="F", help="frontends (default 1)")
    counts.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                        help="the frontends' bind address (default 127.0.0.1); the master and backends stay "
                             "on loopback")
    counts.add_argument("--port", type=_port, default=None, metavar="PORT",
                        help="the first frontend's port (default START_PORT, else 8088); the rest follow from "
                             "it (below)")
    counts.add_argument("--ready-timeout-s", type=_count, default=600, metavar="SECONDS",
                        help="give up when the cluster is not serving after this long (default 600)")
    counts.add_argument("--max-restarts", type=_count, default=5, metavar="N",
                        help="restart a part that exits on its own (backoff 1 s .. 30 s) at most N times in 10 "
                             "minutes, the rest serving meanwhile; then leave it down (default 5; 0: never)")
    _add_flags(parser, cluster=True)
    return parser


def parse_cluster_args(args: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """`kvyard cluster`'s arguments; without --port the first frontend takes START_PORT, as every other
    command reads it (`START_PORT=9000 make cluster` serves on 9000)."""
    ns = cluster_parser().parse_args(args)
    if ns.port is None:
        try:
            ns.port = start_port(env)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return ns


def gateway_parser() -> _Parser:
    parser = _Parser(
        prog="kvyard gateway", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One OpenAI endpoint over OpenAI-compatible servers (kvyard, llama.cpp's server, vLLM, ...): "
                    "requests\nroute by model, wait in a queue while every server is busy, and pass through "
                    "byte for byte.",
        epilog="example:\n  kvyard gateway http://127.0.0.1:8088 http://127.0.0.1:8089 --max-connect-per-upstream 4")
    parser.add_argument("upstreams", nargs="*", metavar="URL", help="upstream base URLs [env UPSTREAMS]")
    parser.add_argument("--debug", action="store_true", help="verbose logging [env DEBUG]")
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items() if key in ("gateway", "misc")}
    for f in GATEWAY_FLAGS:
        groups[f.group].add_argument(f.flag, dest=f.env, metavar=f.metavar, help=f"{f.help} [env {f.env}]")
    return parser


def gateway_env(ns: argparse.Namespace) -> dict[str, str]:
    """The variables `kvyard gateway`'s arguments set, ROLE_TYPE=GATEWAY among them."""
    out = {"ROLE_TYPE": "GATEWAY", **flag_env(ns, flags=GATEWAY_FLAGS)}
    if any("," in u for u in ns.upstreams):
        raise UsageError("give the upstream URLs separated by spaces, not commas")
    if ns.upstreams:
        out["UPSTREAMS"] = ",".join(ns.upstreams)
    if ns.debug:
        out["DEBUG"] = "true"
    return out


def _count(raw: str) -> int:
    if not raw.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {raw!r}")
    return int(raw)


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {raw!r}")
    return int(raw)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvyard")
    except PackageNotFoundError:
        return "unknown"


def flag_env(ns: argparse.Namespace, cluster: bool = False, flags: Sequence[Flag] = FLAGS) -> dict[str, str]:
    """The environment variables the given flags set (only those given)."""
    out: dict[str, str] = {}
    for f in flags:
        if cluster and not f.cluster:
            continue
        value = getattr(ns, f.env, None)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if any(not v.strip() for v in values):
            raise UsageError(f"{f.flag} must not be empty")
        if f.many and any("," in v for v in values):
            raise UsageError(f"{f.flag} takes values separated by spaces, got {' '.join(values)!r}")
        out[f.env] = ",".join(v.strip() for v in values)
    model = getattr(ns, "model", None)
    if model is not None:
        if "CHECKPOINT_PATH" in out:
            raise UsageError("give the model as MODEL or --model, not both")
        out["CHECKPOINT_PATH"] = model
    return out


def explain(message: str, overrides: Mapping[str, str], flags: Sequence[Flag] = FLAGS) -> str:
    """A config error names the environment variable; say which flag set it."""
    for f in flags:
        if f.env in overrides:
            message = re.sub(rf"\b{f.env}\b", f"{f.flag} ({f.env})", message, count=1)
    return message


LOCAL_HOST = "127.0.0.1"  # where `kvyard` listens unless HOST / --host says otherwise (the image sets 0.0.0.0)


def serve_env(argv: Sequence[str], environ: Mapping[str, str], prog: str = "kvyard") -> dict[str, str]:
    """The environment `kvyard serve argv` runs with: `environ` with the flags written over it, and HOST
    on loopback when neither sets it."""
    ns = serve_parser(prog).parse_args(list(argv))
    return with_local_host({**environ, **flag_env(ns)})


def with_local_host(env: dict[str, str]) -> dict[str, str]:
    return env if env.get("HOST") else {**env, "HOST": LOCAL_HOST}


def main(argv: Sequence[str] | None = None) -> int:
    from kvyard.logs import setup_logging
    from launcher.safe_path import harden

    harden()  # every role process: no imports from the start directory (launcher/safe_path.py)

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "cluster":
            from launcher.local_cluster import run_cluster
            ns = parse_cluster_args(args[1:], os.environ)
            overrides = flag_env(ns, cluster=True)
            setup_logging("cluster", {**os.environ, **overrides})
            logging.getLogger("httpx").setLevel(logging.WARNING)  # its health polls are not news
            return run_cluster(ns, overrides, lambda message: explain(message, overrides))
        flags: Sequence[Flag] = FLAGS
        if args and args[0] == "gateway":
            flags, overrides = GATEWAY_FLAGS, gateway_env(gateway_parser().parse_args(args[1:]))
            return _start(overrides, flags)
        prog = "kvyard"
        if args and args[0] == "serve":
            prog, args = "kvyard serve", args[1:]
        elif args and not args[0].startswith("-"):
            raise UsageError(f"unknown command {args[0]!r}: use `kvyard serve [MODEL]` or `kvyard cluster` "
                             "(see `kvyard --help`)")
        ns = serve_parser(prog).parse_args(args)
        overrides = flag_env(ns)
    except UsageError as exc:
        print(f"kvyard: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return _start(overrides, flags)


def _start(overrides: dict[str, str], flags: Sequence[Flag]) -> int:
    from launcher.launch import start
    from kvyard.logs import setup_logging

    env = with_local_host({**os.environ, **overrides})  # handed to every role process it starts
    setup_logging("launch", env)
    return start(env, explain=lambda message: explain(message, overrides, flags))
