# Vigil: `make demo` runs the whole system end to end; `make test` runs the suite.
# Both set everything up first (a venv with the cpu extra, redis-server from Debian packages).
PYTHON ?= python3
VENV   ?= .venv
PIP_ARGS ?=
# Elsewhere than these machines, the CPU torch wheel comes from PyTorch's own index:
#   make test PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
STAMP  := $(VENV)/.vigil-setup
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=
# The suite runs in two processes, a module at a time each (tests/suite_schedule.py); TEST_PROCS=0
# runs it in one.
TEST_PROCS ?= 2

.PHONY: setup demo test test-fast bench clean redis-server

setup: $(STAMP) redis-server

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "Vigil needs Python >= 3.11 (set PYTHON=python3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# constraints.txt: the pinned versions the tests run against (the images use it too).
	$(PY) -m pip install -q $(PIP_ARGS) -c constraints.txt -e '.[cpu,dev]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside
	@# CPU torch; triton has no CPU backend and costs 1 GB (docs/field-notes.md).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server from Debian packages"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install -y redis-server' and retry"; exit 1; \
	  fi; }

demo: setup
	$(VENV)/bin/vigil demo

# The whole suite: unit, real Redis, real worker processes with the vLLM CPU engine.
# pytest's exit code 5 (no tests collected) fails this target like any other failure.
test: setup
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Unit and Redis tiers only (seconds, no engine).
test-fast: setup
	$(PY) -m pytest -m "not worker" $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
