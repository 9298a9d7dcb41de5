"""CPU speed and memory benchmark of the exact-from-logits path (JSON out).

    python benchmarks/bench_cpu.py [--quick] [--out DIR]

Never a timed test: this writes numbers, ratios against a baseline measured in the same run, to
``benchmarks/results/vocab-cpu.json`` (or ``DIR/vocab-cpu.json``) and prints a table.
``--quick``: N=256, V=4096 only, glibc's default allocator only (a smoke test).

N tokens x V vocabulary, float32, forward + backward of the exact KL(pi||ref) summed over the
positions (``reduction="sum"``, the loss a trainer differentiates), on the CPU. Each method runs
in a fresh subprocess (this script with ``--child``) so its peak
resident memory (``ru_maxrss``) is its own; the memory reported is the peak minus the resident
size once the inputs exist, minus the returned gradient (``N V`` floats): what the method adds.
Times are the median of repeated steps after the first. Two allocator settings: glibc's default,
which returns large freed blocks to the kernel so every step faults fresh pages in (on this VM a
single step can then vary by up to 10x), and a cached heap (``MALLOC_MMAP_MAX_=0``, as jemalloc /
tcmalloc behave). Methods:

* ``naive``: ``F.kl_div(log_softmax(y), log_softmax(z), log_target=True)`` under autograd, the
  expression people write (the baseline);
* ``klest``: :func:`klest.kl_from_logits` (the gradient written in the forward pass);
* ``klest-details``: the same with labels and ``return_details=True`` (the label log-probs and
  the entropy too, as RL trainers log every step);
* ``klest-recompute``: ``stash=False`` (the backward reads the logits again);
* ``klest-overwrite``: ``overwrite_logits=True`` (the gradient written over the logits).

Each method's work is also *counted* (:mod:`klest.logits._traffic`, in the child, on the same
tensors, one step): passes over the ``[N, V]`` buffers (reads and writes of the logits and of
every ``[N, V]`` buffer the step creates, in units of one logits tensor). A method the library
at the measured commit lacks records its error.

The fused LM head, :func:`klest.kl_from_hidden` (``hidden`` cases: N x H hidden states, a
trainable V x H head, a frozen reference head, float32, ``reduction="token-mean"``): time, and
its matrix products counted by ``torch.utils.flop_counter`` (FLOPs and calls; one product of
the head is ``2 N H V`` FLOPs), against the same loss on materialized logits (``naive``).
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

CPU_METHODS = ("naive", "klest", "klest-details", "klest-recompute", "klest-overwrite")
HIDDEN_METHODS = ("naive", "klest")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _cpu_step(method: str, labels: torch.Tensor):
    def step(z, y):
        if method == "naive":
            kl = F.kl_div(
                F.log_softmax(y, -1), F.log_softmax(z, -1), log_target=True, reduction="sum"
            )
        elif method == "klest-details":
            kl, _ = klest.kl_from_logits(z, y, labels=labels, reduction="sum", return_details=True)
        else:
            options = {
                "klest": {},
                "klest-recompute": {"stash": False},
                "klest-overwrite": {"overwrite_logits": True},
            }[method]
            kl = klest.kl_from_logits(z, y, reduction="sum", **options)
        kl.backward()
        return kl.detach()

    return step


def _inputs(n: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(n, v, generator=g) * 2).requires_grad_()
    y = torch.randn(n, v, generator=g) * 2
    return z, y, torch.randint(0, v, (n,), generator=g)


def _passes(step, z: torch.Tensor, y: torch.Tensor) -> dict:
    """One step's passes over the [N, V] buffers (reads, writes), by name."""
    from klest.logits._traffic import Traffic

    z.grad = None
    with Traffic(logits=z, logits_ref=y) as traffic:
        step(z, y)
    passes = traffic.summary()
    return {
        "passes": {name: {"read": r, "written": w} for name, (r, w) in passes.items()},
        "passes_total": traffic.total(),
    }


def _cpu_child(method: str, n: int, v: int, reps: int, threads: int) -> dict:
    """Runs in its own process: peak memory of one step, then the median time of ``reps``,
    then the passes of one step (counted, no timing)."""
    torch.set_num_threads(threads)
    z, y, labels = _inputs(n, v)
    step = _cpu_step(method, labels)
    base = _rss_bytes()
    try:
        kl = step(z, y)
    except TypeError as e:  # an option the measured commit lacks
        return {"method": method, "error": f"{type(e).__name__}: {e}"[:300]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_bytes = z.grad.numel() * z.grad.element_size()
    checksum = float(kl.double().sum())
    times = []
    for _ in range(reps):
        z.grad = None
        if method == "klest-overwrite":  # its step overwrites the logits: restore them first
            z.data.copy_(_inputs(n, v)[0])
        t0 = time.perf_counter()
        step(z, y)
        times.append(time.perf_counter() - t0)
    if method == "klest-overwrite":
        z.data.copy_(_inputs(n, v)[0])
    counted = {} if method == "naive" else _passes(step, z, y)
    return {
        "method": method,
        "seconds": statistics.median(times),
        "seconds_min": min(times),
        "seconds_all": times,
        "peak_added_bytes": peak - base,
        "added_beyond_gradient_bytes": peak - base - grad_bytes,
        "kl_sum": checksum,
        **counted,
    }


def _hidden_child(method: str, n: int, h: int, v: int, reps: int, threads: int) -> dict:
    """``kl_from_hidden`` (or the naive loss on materialized logits): time and matmul work."""
    from klest.logits._traffic import matmul_flops

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    hid_ref = torch.randn(n, h, generator=g)
    w_ref = torch.randn(v, h, generator=g) / h**0.5

    def step():
        hid.grad = w.grad = None
        if method == "naive":
            lq = F.log_softmax(hid @ w.T, -1)
            lp = F.log_softmax(hid_ref @ w_ref.T, -1)
            kl = F.kl_div(lp, lq, log_target=True, reduction="sum") / n
        else:
            kl = klest.kl_from_hidden(hid, w, hid_ref, w_ref, reduction="token-mean")
        kl.backward()
        return kl.detach()

    with matmul_flops() as work:
        kl = step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "method": method,
        "seconds": statistics.median(times),
        "seconds_all": times,
        "matmul_flops": work["flops"],
        "matmul_calls": work["products"],
        "products_of_the_head": work["flops"] / (2 * n * h * v),
        "kl": float(kl),
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
    *,
    sizes: list[tuple[int, int]],
    hidden: list[tuple[int, int, int]],
    reps: int,
    threads: int,
    allocators: tuple[str, ...] = tuple(ALLOCATORS),
    progress: bool = True,
) -> dict:
    """Time and added peak memory of every CPU method at each ``(N, V)`` under each allocator
    setting, with ratios to naive under the same setting; the fused head at each
    ``(N, H, V)``."""
    rows = []
    for n, v in sizes:
        for allocator in allocators:
            env = ALLOCATORS[allocator]
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
    hidden_rows = []
    for n, h, v in hidden:
        results = {}
        for method in HIDDEN_METHODS:
            if progress:
                print(f"vocab-cpu hidden N={n} H={h} V={v} {method} ...", file=sys.stderr)
            args = ["hidden", method, str(n), str(h), str(v), str(reps), str(threads)]
            results[method] = _spawn(args, {})
        hidden_rows.append({"N": n, "H": h, "V": v, "dtype": "float32", "results": results})
    return {
        "benchmark": "vocab-cpu",
        "what": "forward + backward of the exact KL(pi||ref), summed over the positions",
        "machine": _machine(threads),
        "load_average": os.getloadavg(),
        "allocators": {name: ALLOCATORS[name] for name in allocators},
        "cases": rows,
        "hidden": hidden_rows,
    }


def _machine(threads: int) -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": threads,
    }


def _passes_cell(r: dict) -> str:
    """``z r/w, ...``: the counted passes of a method (reads / writes of each buffer)."""
    if "passes_total" not in r:
        return ""
    parts = [f"{name} {p['read']:g}/{p['written']:g}" for name, p in r["passes"].items()]
    return f"{r['passes_total']:g} ({', '.join(parts)})"


def format_vocab_cpu(report: dict) -> str:
    lines = [
        "| N | V | allocator | method | time (s) | x naive | added memory (MiB) | x naive "
        "| passes (buffer read/written) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        head = f"| {case['N']} | {case['V']} | {case['allocator']} |"
        for method, r in case["results"].items():
            if "error" in r:
                killed = r.get("returncode") == -9
                why = "killed: out of memory" if killed else "failed: see the JSON"
                lines.append(f"{head} {method} | {why} | | | | |")
                continue
            added = r.get("added_beyond_gradient_bytes")
            lines.append(
                f"{head} {method} | {r['seconds']:.3f} | "
                + (f"{r['time_vs_naive']:.2f} | " if "time_vs_naive" in r else "| ")
                + (f"{added / 2**20:.0f} | {r['memory_vs_naive']:.3f} |" if added else "| |")
                + f" {_passes_cell(r)} |"
            )
    if report.get("hidden"):
        lines += [
            "",
            "| N | H | V | method | time (s) | matmul calls | products of the head |",
            "|---|---|---|---|---|---|---|",
        ]
        for case in report["hidden"]:
            head = f"| {case['N']} | {case['H']} | {case['V']} |"
            for method, r in case["results"].items():
                if "error" in r:
                    lines.append(f"{head} {method} | failed: see the JSON | | |")
                    continue
                lines.append(
                    f"{head} {method} | {r['seconds']:.3f} | {r['matmul_calls']} | "
                    f"{r['products_of_the_head']:g} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument(
        "--child",
        nargs="+",
        metavar="ARG",
        help="internal: run one method in this process and print its JSON",
    )
    args = ap.parse_args(argv)
    if args.child:
        if args.child[0] == "hidden":
            method, *numbers = args.child[1:]
            print(json.dumps(_hidden_child(method, *map(int, numbers))))
        else:
            method, *numbers = args.child
            print(json.dumps(_cpu_child(method, *map(int, numbers))))
        return 0
    sizes = [(256, 4096)] if args.quick else [(4096, 32768), (4096, 131072)]
    hidden = [(128, 32, 2048)] if args.quick else [(2048, 256, 32768)]
    allocators = ("default",) if args.quick else tuple(ALLOCATORS)
    report = bench_vocab_cpu(
        sizes=sizes,
        hidden=hidden,
        reps=2 if args.quick else 5,
        threads=2,
        allocators=allocators,
    )
    write_report("vocab-cpu", report, format_vocab_cpu(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
