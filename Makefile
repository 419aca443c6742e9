# Every target builds .venv first, so a fresh clone needs only Python 3.11+ and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml | sha1sum | cut -c1-12)
# What `make demo` needs (the project and its servers), and what the checks need on top.
STAMP_LOCAL := $(VENV)/.installed-local-$(HASH)
STAMP := $(VENV)/.installed-dev-$(HASH)

.PHONY: demo test lint typecheck pytest chaos bench bench-api bench-fire bench-limits clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP_LOCAL): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[local,otel]'
	rm -f $(VENV)/.installed-local-*
	touch $(STAMP_LOCAL)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[local,otel,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP) $(STAMP_LOCAL)

demo: $(STAMP_LOCAL)
	$(BIN)/jobplane dev --demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check platform tests bench examples
	$(BIN)/ruff format --check platform tests bench examples

# The package, then the examples as an application would check its own code against it.
typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy --strict examples

# One pytest process per core, each with its own MongoDB and Redis, a test file to one.
pytest: $(STAMP) chromium docker-compose
	$(BIN)/pytest -n auto --dist loadfile

# The dashboard's browser tests (tests/ui) drive Debian's Chromium. Installed when missing and
# apt-get can (as root); otherwise say so: those tests then skip, saying why.
.PHONY: chromium
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Chromium for the dashboard's browser tests (apt-get install chromium)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
		|| { apt-get update -qq && apt-get install -y --no-install-recommends chromium >/dev/null; } \
		|| echo "make: could not install Chromium; the dashboard's browser tests (tests/ui) will be SKIPPED"; \
	else \
		echo "make: /usr/bin/chromium is missing and apt-get cannot install it here (needs root);" \
			"the dashboard's browser tests (tests/ui) will be SKIPPED"; \
	fi

# The compose files' tests (tests/deploy) check them with a real compose implementation's
# `config`: Debian's docker-compose, installed like Chromium (without the Docker engine it
# recommends, which `config` does not need); otherwise those tests skip, saying why.
.PHONY: docker-compose
docker-compose:
	@if command -v docker-compose >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing docker-compose for the compose files' tests (apt-get install docker-compose)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y --no-install-recommends docker-compose >/dev/null 2>&1 \
		|| { apt-get update -qq && apt-get install -y --no-install-recommends docker-compose >/dev/null; } \
		|| echo "make: could not install docker-compose; the compose files' tests (tests/deploy) will be SKIPPED"; \
	else \
		echo "make: docker-compose is missing and apt-get cannot install it here (needs root);" \
			"the compose files' tests (tests/deploy) will be SKIPPED"; \
	fi

# The chaos scenarios at full length (make test runs them shortened); prints their table.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos

# Every benchmark, one after another (about an hour); each prints its own figures, and
# docs/benchmarks.md says what they mean. The peers' comparison installs Celery, SAQ and
# procrastinate in virtual environments of their own (.bench-venvs/), and runs procrastinate on
# a private PostgreSQL cluster from Debian's server binaries.
bench: $(STAMP) postgresql
	$(BIN)/python bench/as_users.py --repeat 3
	$(BIN)/python bench/throughput.py --repeat 3
	$(BIN)/python bench/redis_topologies.py --repeat 3
	$(BIN)/python bench/producer.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/durable_write.py
	$(BIN)/python bench/cancel_latency.py
	$(BIN)/python bench/fire_precision.py
	$(BIN)/python bench/flows.py --repeat 2 --runs 2000 --rate 30
	$(BIN)/python bench/maps.py --repeat 3
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/peers/run.py

# Debian's PostgreSQL server, for procrastinate in the peers' comparison: installed like Chromium
# when missing (its package also starts Debian's own cluster, which the comparison does not use).
.PHONY: postgresql
postgresql:
	@if ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing PostgreSQL for the peers' comparison (apt-get install postgresql)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y --no-install-recommends postgresql >/dev/null 2>&1 \
		|| { apt-get update -qq && apt-get install -y --no-install-recommends postgresql >/dev/null; } \
		|| echo "make: could not install PostgreSQL; bench/peers/run.py will say so"; \
	else \
		echo "make: PostgreSQL's server is missing and apt-get cannot install it here (needs root);" \
			"bench/peers/run.py will say so"; \
	fi

bench-api: $(STAMP)
	$(BIN)/python bench/api.py

bench-fire: $(STAMP)
	$(BIN)/python bench/fire_precision.py

bench-limits: $(STAMP)
	$(BIN)/python bench/flow_control.py

clean:
	rm -rf $(VENV) .jobplane .pytest_cache .mypy_cache .ruff_cache
