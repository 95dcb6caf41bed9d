# `make run` serves a broker; `make test` runs the whole suite. Both bootstrap the venv on first use
# (`run`: what a node needs; `test`: the test and Spark extras and Debian's test packages, as root)
# and are quiet afterwards. VENV=path for a venv elsewhere. `make image` builds the container image
# (deploy/Containerfile) as leveret:dev, or IMAGE=name.
VENV ?= .venv
PY := $(VENV)/bin/python
IMAGE ?= leveret:dev
export VENV

.PHONY: run test lint bench bootstrap bootstrap-run image clean

bootstrap:
	@scripts/bootstrap.sh test

bootstrap-run:
	@scripts/bootstrap.sh run

run: bootstrap-run
	@$(PY) -m leveret serve

test: bootstrap
	@$(PY) -m ruff check --quiet .
	@$(PY) -m mypy
	@$(VENV)/bin/lint-imports --no-cache >/dev/null || $(VENV)/bin/lint-imports --no-cache
	@$(PY) -m pytest

lint: bootstrap
	@$(PY) -m ruff check .
	@$(PY) -m mypy
	@$(VENV)/bin/lint-imports --no-cache

bench: bootstrap
	@$(PY) -m bench --url leveret=amqp://guest:guest@127.0.0.1:5672/

image: bootstrap-run
	@IMAGE=$(IMAGE) PYTHON=$(PY) scripts/build-image.sh

clean:
	rm -rf .venv leveret-data .pytest_cache .mypy_cache .ruff_cache build wheelhouse
