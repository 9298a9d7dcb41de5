"""CPU speed and memory benchmark of the exact-from-logits path (JSON out).

    python benchmarks/bench_cpu.py [--quick] [--out DIR]

Never a timed test: this writes numbers, ratios against a baseline measured in the same run, to
``benchmarks/results/vocab-cpu.json`` (or ``DIR/vocab-cpu.json``) and prints a table.
``--quick``: N=256, V=4096 only (a smoke test).

N tokens x V vocabulary, float32, forward + backward of the per-position exact KL(pi||ref) summed,
on the CPU. Each method runs in a fresh subprocess (this script with ``--child``) so its peak
resident memory (``ru_maxrss``) is its own; the memory reported is the peak minus the resident
size once the inputs exist, minus the returned gradient (``N V`` floats): what the method adds.
Times are the median of repeated steps after the first. Two allocator settings: glibc's default,
which returns large freed blocks to the kernel so every step faults fresh pages in (on this VM a
single step can then vary by up to 10x), and a cached heap (``MALLOC_MMAP_MAX_=0``, as jemalloc /
tcmalloc behave). Methods:

* ``naive``: ``F.kl_div(log_softmax(y), log_softmax(z), log_target=True)`` under autograd, the
  expression people write (the baseline);
* ``klest``: :func:`klest.kl_from_logits` (gradient stashed in the forward pass);
* ``klest-recompute``: the same with ``stash=False`` (backward recomputes the softmaxes).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

import klest
from _common import parser, write_report

CPU_METHODS = ("naive", "klest", "klest-recompute")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _cpu_step(method: str):
    def step(z, y):
        if method == "naive":
            kl = F.kl_div(
                F.log_softmax(y, -1), F.log_softmax(z, -1), log_target=True, reduction="none"
            ).sum(-1)
        else:
            kl = klest.kl_from_logits(z, y, stash=method == "klest", reduction="none")
        kl.sum().backward()
        return kl.detach()

    return step


def _cpu_child(method: str, n: int, v: int, reps: int, threads: int) -> dict:
    """Runs in its own process: peak memory of one step, then the median time of ``reps``."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(n, v, generator=g) * 2).requires_grad_()
    y = torch.randn(n, v, generator=g) * 2
    step = _cpu_step(method)
    base = _rss_bytes()
    kl = step(z, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_bytes = z.grad.numel() * z.grad.element_size()
    checksum = float(kl.double().sum())
    times = []
    for _ in range(reps):
        z.grad = None
        t0 = time.perf_counter()
        step(z, y)
        times.append(time.perf_counter() - t0)
    return {
        "method": method,
        "seconds": statistics.median(times),
        "seconds_min": min(times),
        "seconds_all": times,
        "peak_added_bytes": peak - base,
        "added_beyond_gradient_bytes": peak - base - grad_bytes,
        "kl_sum": checksum,
    }


ALLOCATORS = {
    "default": {},
    # glibc keeps freed memory instead of returning it to the kernel (what jemalloc / tcmalloc,
    # often preloaded for PyTorch on CPUs, do): no fresh pages to fault in at every step.
    "cached": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)},
}


def _spawn(args: list[str], env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, **env}
    )
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-2000:], "returncode": done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _add_ratios(results: dict, *, memory: bool) -> None:
    """Time (and memory) ratios to naive. A cached heap keeps what earlier allocations freed in
    the resident size, so peak-minus-baseline means nothing there: no memory ratio."""
    base = results["naive"]
    for r in results.values():
        if "error" in r:
            continue
        if not memory:
            r.pop("peak_added_bytes", None)
            r.pop("added_beyond_gradient_bytes", None)
        if "error" in base:
            continue
        r["time_vs_naive"] = r["seconds"] / base["seconds"]
        if memory:
            r["memory_vs_naive"] = r["added_beyond_gradient_bytes"] / max(
                base["added_beyond_gradient_bytes"], 1
            )


def bench_vocab_cpu(
    *, sizes: list[tuple[int, int]], reps: int, threads: int, progress: bool = True
) -> dict:
    """Time and added peak memory of every CPU method at each ``(N, V)`` under each allocator
    setting, with ratios to naive under the same setting."""
    rows = []
    for n, v in sizes:
        for allocator, env in ALLOCATORS.items():
            results = {}
            for method in CPU_METHODS:
                if progress:
                    print(f"vocab-cpu N={n} V={v} {allocator} {method} ...", file=sys.stderr)
                args = [method, str(n), str(v), str(reps), str(threads)]
                results[method] = _spawn(args, env)
            _add_ratios(results, memory=allocator == "default")
            rows.append(
                {"N": n, "V": v, "dtype": "float32", "allocator": allocator, "results": results}
            )
    return {
        "benchmark": "vocab-cpu",
        "what": "forward + backward of the per-position exact KL(pi||ref), summed",
        "machine": _machine(threads),
        "allocators": ALLOCATORS,
        "cases": rows,
    }


def _machine(threads: int) -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": threads,
    }


def format_vocab_cpu(report: dict) -> str:
    lines = [
        "| N | V | allocator | method | time (s) | x naive | added memory (MiB) | x naive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        head = f"| {case['N']} | {case['V']} | {case['allocator']} |"
        for method, r in case["results"].items():
            if "error" in r:
                killed = r.get("returncode") == -9
                why = "killed: out of memory" if killed else "failed: see the JSON"
                lines.append(f"{head} {method} | {why} | | | |")
                continue
            added = r.get("added_beyond_gradient_bytes")
            lines.append(
                f"{head} {method} | {r['seconds']:.3f} | "
                + (f"{r['time_vs_naive']:.2f} | " if "time_vs_naive" in r else "| ")
                + (f"{added / 2**20:.0f} | {r['memory_vs_naive']:.3f} |" if added else "| |")
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument(
        "--child",
        nargs=5,
        metavar=("METHOD", "N", "V", "REPS", "THREADS"),
        help="internal: run one method in this process and print its JSON",
    )
    args = ap.parse_args(argv)
    if args.child:
        method, n, v, reps, threads = args.child
        print(json.dumps(_cpu_child(method, int(n), int(v), int(reps), int(threads))))
        return 0
    sizes = [(256, 4096)] if args.quick else [(4096, 32768), (4096, 131072)]
    report = bench_vocab_cpu(sizes=sizes, reps=2 if args.quick else 5, threads=2)
    write_report("vocab-cpu", report, format_vocab_cpu(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
