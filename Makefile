# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.klest-installed
PEERS  := $(VENV)/.klest-peers-installed

.PHONY: demo test calibration test-gpu lint docs docs-figures clean

# torch is pinned to the CPU wheel present on these machines; a looser pin pulls CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The real verl and OpenRLHF, pinned, for the tests that compare klest's drop-ins with them: only
# the listed packages (--no-deps: the peers' own requirements name CUDA packages); deepspeed is
# an sdist, built against the installed CPU torch (--no-build-isolation).
$(PEERS): $(STAMP) requirements/peers.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -r requirements/peers.txt
	touch $(PEERS)

demo: $(STAMP)
	$(VENV)/bin/klest demo

# Lint, the tests (doctests included; Triton kernels through the CPU interpreter), the docs.
# KLEST_REQUIRE_PEERS=1: the comparisons with the real verl and OpenRLHF fail, not skip, when
# those do not import.
test: $(STAMP) $(PEERS)
	$(MAKE) lint
	KLEST_REQUIRE_PEERS=1 TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q
	$(MAKE) docs

# The calibration tier, which `make test` leaves out (pyproject's addopts): each reruns a
# statistical test's computation over many seeds and checks that no seed fails, the evidence
# that the test's threshold keeps its stated false-fail rate. Minutes; run when a threshold or
# a test's sizes change.
calibration: $(STAMP) $(PEERS)
	KLEST_REQUIRE_PEERS=1 TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q -m calibration

# On a CUDA machine: the kernel, logits and fused-linear tests with the real Triton kernels, and
# the host-synchronisation checks. (benchmarks/run_on_gpu.sh runs these and the GPU benchmarks
# with the machine's own python3, for a GPU machine without a package registry.)
test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/logits tests/test_host_syncs.py

# The documentation site, warnings as errors; docs/_build/html/index.html. Runs no experiment.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

# The experiments' figures in docs/_static/experiments/: the full-size runs (minutes each), under
# runs/NAME, then scaled down for the repository. Not part of `make test`.
EXPERIMENTS := schulman chimera-variance chimera-training pitfalls control-variates mode-seeking migration lm-gradients rb-vs-mc distill kl-regularized-po
docs-figures: $(STAMP)
	for name in $(EXPERIMENTS); do \
		$(VENV)/bin/klest run $$name --no-progress --out runs/$$name || exit 1; \
	done
	$(PY) docs/figures.py runs

LINTED := src tests benchmarks examples docs/conf.py docs/figures.py conftest.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build
