# Waygate's developer entry points. `make run` and `make test` are all a new
# machine needs: both create .venv when it is missing and (re)install the
# project whenever pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-fast lint typecheck protos protos-check bench soak deploy-check image clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "waygate needs Python 3.11 or newer; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# An editable install: `waygate` maps onto services/, new modules included.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

run: $(STAMP)
	$(BIN)/waygate up

# Two pytest workers (pytest-xdist): the system tests mostly wait on real processes,
# so two at a time halve the wall time on two cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# Everything but the slow system tests (they start real processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not system' $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

# mypy cannot follow the editable install's services/ -> waygate mapping by
# itself; a symlink named waygate on MYPYPATH gives it the real package name.
typecheck: $(STAMP)
	@mkdir -p build/typecheck && ln -sfn ../../services build/typecheck/waygate
	MYPYPATH=build/typecheck $(BIN)/mypy -p waygate

# Regenerate the checked-in protobuf and gRPC code under services/<svc>/v1.
protos: $(STAMP)
	$(BIN)/python protos/generate.py generate

# Fails when the checked-in generated code differs from what protos/ produces.
protos-check: $(STAMP)
	$(BIN)/python protos/generate.py check

# BENCH=name runs one benchmark (all by default); BENCH_ARGS go to it, e.g.
# `make bench BENCH=tunnel BENCH_ARGS="--mib 256"`.
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH) $(if $(BENCH_ARGS),-- $(BENCH_ARGS))

# Every service as its own process under steady load and a schedule of faults
# (bench/soak); the table and plot go to bench/soak/out/. `make test` runs a
# short version (tests/system/test_soak.py).
SOAK_MINUTES ?= 30
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

deploy-check: $(STAMP)
	$(BIN)/python -m pytest tests/deploy $(PYTEST_ARGS)

# The container image (deploy/Containerfile), tagged with the version in
# pyproject.toml: the tag the kustomize base names. The first of podman, buildah
# and docker found on PATH builds it (ENGINE=... chooses); IMAGE=REGISTRY/NAME
# names it for your registry. Then push it, or `kind load docker-image` it (README,
# "Deploying").
IMAGE   ?= waygate/waygate
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1)
ENGINE  ?= $(firstword $(foreach engine,podman buildah docker,$(shell command -v $(engine) 2>/dev/null)))

image:
	@if [ -z "$(ENGINE)" ]; then \
		echo "make image: no container engine found: install podman, buildah or docker (or set ENGINE=/path/to/one)" >&2; \
		exit 1; \
	fi
	$(ENGINE) build -f deploy/Containerfile -t $(IMAGE):$(VERSION) .
	@echo "built $(IMAGE):$(VERSION)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
