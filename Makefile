# `make run` serves a broker; `make test` runs the whole suite. Both bootstrap
# .venv (and Debian packages, as root) on first use and are quiet afterwards.
PY := .venv/bin/python

.PHONY: run test lint bench bootstrap clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	@$(PY) -m leveret serve

test: bootstrap
	@$(PY) -m ruff check --quiet .
	@$(PY) -m mypy
	@.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache
	@$(PY) -m pytest

lint: bootstrap
	@$(PY) -m ruff check .
	@$(PY) -m mypy
	@.venv/bin/lint-imports --no-cache

bench: bootstrap
	@$(PY) -m bench --url leveret=amqp://guest:guest@127.0.0.1:5672/

clean:
	rm -rf .venv leveret-data .pytest_cache .mypy_cache .ruff_cache
