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

# The suite on TEST_WORKERS processes (pytest-xdist; worksteal evens out the long tests); TEST_WORKERS=0
# runs it in this process, for a debugger or `-x`.
TEST_WORKERS ?= 2
test: $(DEVSTAMP) deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

bench: $(DEVSTAMP)
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
