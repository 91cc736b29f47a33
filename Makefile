# The two commands of the README. Both work on a fresh machine with only python3 (3.11+) and make.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint bench histories schemas lock clean

# Every install is constrained by the lock file: the versions tested are the versions run (the image uses it too).
$(STAMP): pyproject.toml requirements/lock.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -c requirements/lock.txt -e '.[test,local]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/exports dev

# The suite's files on TEST_PROCESSES processes (pytest-xdist), each with its own PostgreSQL and Temporal: its tests
# mostly wait (leases, outages), so two halve its time on two cores. A file's tests stay together, on one process.
# TEST_PROCESSES=0 runs it in this process alone. The slowest tests are listed at the end: CI must stay under 30
# minutes on two cores, and that list says where its time goes.
TEST_PROCESSES ?= 2

test: $(STAMP)
	$(VENV)/bin/pytest -n $(TEST_PROCESSES) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The rules are pyproject.toml's [tool.ruff] and [tool.mypy]; .ci/run runs this before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/python -m bench.run $(BENCH_ARGS)

# Records the workflow histories that the replay tests replay (tests/replay/histories/), against the real
# components, then replays them all; docs/changing-workflows.md says when, and which files to keep first.
histories: $(STAMP)
	$(VENV)/bin/pytest tests/replay/record_histories.py
	$(VENV)/bin/pytest -q tests/replay

# After a change to a contract in starter/client_package/exports_client/contracts.py: its JSON Schemas again
# (committed; tests/client fails while they drift).
schemas: $(STAMP)
	$(VENV)/bin/python -m exports_client.schemas

# After a change to the dependencies in pyproject.toml: resolve them all again, runtime and extras, to exact versions.
lock: $(STAMP)
	$(VENV)/bin/pip install --quiet pip-tools
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url \
		--no-emit-find-links --extra local --extra test --extra otlp --output-file requirements/lock.txt pyproject.toml

clean:
	rm -rf $(VENV) .exports
