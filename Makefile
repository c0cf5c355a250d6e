# The two commands of the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: run test bench deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[speed]'
	touch $@

$(DEVSTAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,speed]'
	touch $@ $(STAMP)

run: $(STAMP)
	$(BIN)/tollgate serve $(ARGS)

# System tools the suite needs (redis-server, promtool); installed from Debian when missing.
deps:
	@sh scripts/system-deps.sh

test: $(DEVSTAMP) deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(DEVSTAMP)
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
