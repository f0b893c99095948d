# The two set-up commands of a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit install clean dist

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,pydantic-ai,openai-agents,mcp,ui,metrics,otel,redis]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sagaloop demo

lint: $(STAMP)
	$(BIN)/ruff check sagaloop tests examples benchmarks
	$(BIN)/ruff format --check sagaloop tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# Two pytest-xdist workers (each test file on one worker: its processes and servers are its own),
# then the tests marked `alone` on an otherwise idle machine.
test: lint typecheck
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not soak and not long and not alone"
	$(BIN)/pytest -q -m "alone and not soak and not long"

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache dist

# The sdist and the wheel in dist/ (until a release is on an index, what to install elsewhere:
# docs/index.md, "Installing"), built offline with the dev extra's setuptools, their metadata
# checked by twine and their files against the sources by tests/check_dist.py.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python tests/check_dist.py dist

# Benchmarks against a hand-made floor and DBOS (about 4-6 minutes; BENCH_ARGS=--quick: about 1-2).
.PHONY: bench
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench,pydantic-ai,openai-agents]'
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

.PHONY: chaos
# The chaos soaks (tests/chaos/soak.py): the short one's test, then 300 runs, at most 5 minutes;
# private servers. With CLUSTER=1, then the cluster soak (tests/chaos/test_rabbit_cluster.py: a
# private three-node RabbitMQ cluster, nodes and processes killed for CLUSTER_SOAK_SECONDS,
# default 240; about 5 minutes in all).
chaos: $(STAMP)
	$(BIN)/pytest -q -m "soak or long"
	$(BIN)/python tests/chaos/soak.py
	if [ -n "$(CLUSTER)" ]; then \
		CLUSTER_SOAK=1 $(BIN)/pytest -q -s -m soak tests/chaos/test_rabbit_cluster.py; \
	fi
