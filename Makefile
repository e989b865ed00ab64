# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Both create .venv if missing and install from constraints.txt (torch pinned to the 2.13.0 CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

.PHONY: install test demo lint bench
install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/precsearch demo

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_formats.py
