#!/usr/bin/env bash
# Everything a GPU machine is for, in one command: the CUDA tests with the real Triton kernels
# (no interpreter) and the host-synchronisation checks, then the GPU benchmarks, writing into DIR
# (default benchmarks/results). For a machine that has torch, triton and pytest but perhaps no
# package registry: it runs `python3` (or $PYTHON) from the repository root with PYTHONPATH=src,
# no install.
#
#   bash benchmarks/run_on_gpu.sh [DIR] [OVERHEAD_RUNS]
#
# Writes DIR/test-gpu.log, DIR/overhead-cuda.json, DIR/overhead-cuda-compiled.json (the overhead
# case with torch.compile'd forms beside) and DIR/vocab-gpu.json (the last runs), with
# every run appended to DIR/NAME.runs.jsonl. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
runs=${2:-3}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'needs a CUDA GPU')" || exit 1
status=0
"$py" -m pytest -q -p no:cacheprovider -rs tests/logits tests/test_host_syncs.py 2>&1 \
    | tee "$out/test-gpu.log" || status=1
for _ in $(seq "$runs"); do
    "$py" benchmarks/bench_overhead.py --device cuda --out "$out" || status=1
done
"$py" benchmarks/bench_overhead.py --device cuda --compile --out "$out" || status=1
"$py" benchmarks/bench_gpu.py --out "$out" || status=1
exit $status
