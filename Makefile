# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.klest-installed
PEERS  := $(VENV)/.klest-peers-installed
LOCK   := requirements/constraints.txt
LATEST ?= .venv-latest
PYTEST_ARGS ?= -n 2

.PHONY: demo test calibration test-gpu test-latest latest-venv lock lint docs docs-figures clean

# torch is pinned to the CPU wheel present on these machines; a looser pin pulls CUDA packages.
# Every other package at the version in the lock ($(LOCK), pip constraints), which the check
# after the install confirms: nothing installed that the lock does not pin, nothing at another
# version.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 -c $(LOCK)
	$(PY) -m pip install --quiet -e ".[dev]" -c $(LOCK)
	$(PY) requirements/diff_lock.py --check
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

# Not run by CI. The newest releases that pyproject.toml's ranges allow, no lock (torch still
# 2.13.0, the CPU wheel), in a venv of their own built anew each time ($(LATEST)): prints which
# packages differ from the lock (name, locked, latest), then the peers and the tests.
# PYTEST_ARGS picks the tests (default: all, -n 2).
test-latest: latest-venv
	$(LATEST)/bin/python requirements/diff_lock.py --label latest
	$(LATEST)/bin/python -m pip install --quiet --no-deps --no-build-isolation -r requirements/peers.txt
	KLEST_REQUIRE_PEERS=1 TRITON_INTERPRET=1 $(LATEST)/bin/python -m pytest -q $(PYTEST_ARGS)

# Refreshes the lock: the same fresh resolution as test-latest, whose `pip freeze` replaces the
# pins in $(LOCK) (its comment block stays); prints what moved. Then `make clean test`.
lock: latest-venv
	$(LATEST)/bin/python requirements/diff_lock.py --write

latest-venv:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet torch==2.13.0 -e ".[dev]"

# The tests once per narrower SIMD width, as on another x86 CPU: ATEN_CPU_CAPABILITY=avx2, then
# default (no vector instructions), numpy (the Triton interpreter's arithmetic) held to the same
# width, the env of `make test`. Sums then round in other orders, and every float comparison must
# still hold. Each run gets its own inductor cache: torch's compile cache does not key on the
# capability, and a kernel compiled for one width gives wrong results under another. Not part of
# `make test` (twice its time); ISA_TESTS selects a part of the suite.
ISA_TESTS ?=
.PHONY: test-isa
test-isa: $(STAMP) $(PEERS)
	status=0; for isa in avx2 default; do \
		case $$isa in \
			avx2) npy="X86_V4 AVX512_ICL AVX512_SPR";; \
			*) npy="X86_V3 X86_V4 AVX512_ICL AVX512_SPR";; \
		esac; \
		cache=$$(mktemp -d); \
		echo "== ATEN_CPU_CAPABILITY=$$isa"; \
		ATEN_CPU_CAPABILITY=$$isa NPY_DISABLE_CPU_FEATURES="$$npy" TORCHINDUCTOR_CACHE_DIR=$$cache \
			KLEST_REQUIRE_PEERS=1 TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q $(ISA_TESTS) || status=1; \
		rm -rf $$cache; \
	done; exit $$status

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
# Then the check that it renders offline: nothing loaded from another host (MathJax ships in
# _static).
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	$(PY) docs/check_offline.py docs/_build/html

# The experiments' figures in docs/_static/experiments/: the full-size runs (minutes each), under
# runs/NAME, then scaled down for the repository. Not part of `make test`.
EXPERIMENTS := schulman chimera-variance chimera-training pitfalls control-variates mode-seeking migration lm-gradients rb-vs-mc distill kl-regularized-po
docs-figures: $(STAMP)
	for name in $(EXPERIMENTS); do \
		$(VENV)/bin/klest run $$name --no-progress --out runs/$$name || exit 1; \
	done
	$(PY) docs/figures.py runs

LINTED := src tests benchmarks examples docs/conf.py docs/figures.py docs/check_offline.py conftest.py requirements/diff_lock.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) $(LATEST) runs .pytest_cache docs/_build
