# Waygate's developer entry points. `make run` and `make test` are all a new
# machine needs: both create .venv when it is missing and (re)install the
# project whenever pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(shell find protos -name '*.proto' | sort)
PYTEST_ARGS ?=

.PHONY: run test test-fast lint typecheck protos protos-check bench deploy-check clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "waygate needs Python 3.11 or newer; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The strict editable install links each file; a new or removed module changes
# its directory's mtime, which triggers a reinstall.
$(STAMP): pyproject.toml $(shell find services -type d -not -name __pycache__) | $(BIN)/python
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=strict -e '.[dev]'
	@touch $@

run: $(STAMP)
	$(BIN)/waygate up

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything but the slow system tests (they start real processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not system' $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

typecheck: $(STAMP)
	$(BIN)/mypy -p waygate

# Regenerate the checked-in protobuf and gRPC code under services/<svc>/v1.
protos: $(STAMP)
	$(BIN)/python protos/generate.py generate

# Fails when the checked-in generated code differs from what protos/ produces.
protos-check: $(STAMP)
	$(BIN)/python protos/generate.py check

bench: $(STAMP)
	$(BIN)/python -m bench

deploy-check: $(STAMP)
	$(BIN)/python -m pytest tests/deploy $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
