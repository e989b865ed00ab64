# Two commands do all set-up on a fresh machine: `make test` and `make demo`; `make test-slow` runs the slow tests.
# Both create .venv if missing and install from constraints.txt (torch pinned to the 2.13.0 CPU build).
# tests/test_search_postgres.py starts its own PostgreSQL server: `make postgres` installs the server binaries
# (Debian's postgresql package, as root) when they are missing; `make test` runs it first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,postgres]'
	touch $(STAMP)

.PHONY: install test test-slow test-oldest-torch demo lint bench postgres device-wheels
install: $(STAMP)

postgres:
	@if command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "PostgreSQL server binaries missing: install the postgresql package (its tests are skipped)"; fi

# The quick suite (under 10 minutes on 2 cores, install included); tests marked slow run with `make test-slow`.
test: $(STAMP) postgres
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP) postgres
	$(PY) -m pytest -q -m slow

# The quick suite under the oldest torch that pyproject.toml admits ("torch>=X.Y": the newest X.Y.* from PyPI,
# a CUDA build that runs here on the CPU), in its own venv: torch's compiler traces the compiled step differently
# from release to release (torch 2.11's Dynamo could not unpack a saved-tensor tuple that 2.13's can).
OLDEST_TORCH := $(shell sed -n 's/^ *"torch>=\([0-9.]*\)",.*/\1/p' pyproject.toml)
OLDEST_VENV := .venv-torch$(OLDEST_TORCH)
OLDEST_STAMP := $(OLDEST_VENV)/.installed

$(OLDEST_STAMP): pyproject.toml constraints.txt
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	grep -v '^torch==' constraints.txt > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/constraints.txt 'torch==$(OLDEST_TORCH).*' \
		-e '.[dev,postgres]'
	touch $(OLDEST_STAMP)

test-oldest-torch: $(OLDEST_STAMP) postgres
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/precsearch demo

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_formats.py

# Wheels of the packages a GPU machine's Python 3.12 may lack (optuna and its needs, at constraints.txt's
# versions), for benchmarks/device_checks.sh
device-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$(grep -i -E '^(optuna|alembic|colorlog|mako|sqlalchemy)==' constraints.txt)
