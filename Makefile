# Every target builds .venv first, so a fresh clone needs only Python 3.11+ and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test lint typecheck pytest chaos bench bench-api bench-fire clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[local,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jobplane dev --demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check platform tests bench
	$(BIN)/ruff format --check platform tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

# The chaos scenarios at full length (make test runs them shortened); prints their table.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

bench-api: $(STAMP)
	$(BIN)/python bench/api.py

bench-fire: $(STAMP)
	$(BIN)/python bench/fire_precision.py

clean:
	rm -rf $(VENV) .jobplane .pytest_cache .mypy_cache .ruff_cache
