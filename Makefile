# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.klest-installed

.PHONY: demo test lint clean

# torch is pinned to the CPU wheel present on these machines; a looser pin pulls CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/klest demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
