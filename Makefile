# Two set-up commands (see README.md):
#   make run    install what is missing, then run the whole stack on the default model pair
#   make test   install what is missing, then run the test suite
# Everything installs into .venv/ of this checkout; nothing is installed system-wide.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: install run test bench protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel of 2.13.0 (an unpinned torch pulls a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

run: install
	$(VENV)/bin/specdec run $(RUN_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

protos: install
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache
