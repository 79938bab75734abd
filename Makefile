# Two set-up commands (see README.md):
#   make run    install what is missing, then run the whole stack on the default model pair
#   make test   install what is missing, then run the test suite
# Python packages install into .venv/ of this checkout. The one system-wide install: `make test`
# run as root on a Debian-like machine adds Debian's docker-compose package when it is missing
# (tests/deploy checks the compose files with `docker-compose config`, offline); elsewhere that
# test is skipped. `make test` also installs the buf CLI (proto lint and breaking-change checks)
# into tools/buf/node_modules with npm, at the version tools/buf/package-lock.json pins; without
# npm it says so and those tests are skipped. `make run` installs nothing outside .venv/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml clients/python/pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
# two workers, a file to each at a time, files in the order tests/conftest.py leaves them (the real pair first)
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
RUN_ARGS ?=

.PHONY: install run test test-fast compose-tool buf-tool bench protos proto-checks proto-baseline clean

install: $(STAMP)

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel of 2.13.0 (an unpinned torch pulls a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

run: install
	$(VENV)/bin/specdec run $(RUN_ARGS)

test: install compose-tool buf-tool
	$(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# the fast tier, for every change: no service processes, no fuzzing, no real model pair
test-fast: install
	$(PY) -m pytest $(XDIST) -m "not integration and not slow" $(PYTEST_ARGS)

# Debian's docker-compose (1.29) validates and merges compose files offline (no Docker engine).
# Installed only when missing, and only as root with apt-get; an install that fails stops here.
compose-tool:
	@command -v docker-compose >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing docker-compose (Debian package) for tests/deploy" && \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; \
	  else \
	    echo "docker-compose not found and not installable here (needs root and apt-get): its test will be skipped"; \
	  fi; }

# buf (npm's @bufbuild/buf) for tests/specdec/test_proto_checks.py: `npm ci` into
# tools/buf/node_modules when missing; nothing global. No npm: a message, and the tests skip.
buf-tool:
	@$(PYTHON) scripts/buf.py install --if-npm

# after editing proto/: the generated code and the API reference (docs/api.md)
protos: install
	$(PY) scripts/gen_protos.py
	$(PY) scripts/gen_api_docs.py

# buf lint, buf breaking against proto/baseline.txtpb, and a baseline that records every field
proto-checks:
	$(PYTHON) scripts/buf.py check

# records proto/ as the new baseline; refuses a breaking change (see README.md, "The gRPC API")
proto-baseline:
	$(PYTHON) scripts/buf.py baseline

clean:
	rm -rf $(VENV) .pytest_cache tools/buf/node_modules
