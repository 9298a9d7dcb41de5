"""What klest costs against the one-liner it replaces, on the sampled-token path (JSON out).

    python benchmarks/bench_overhead.py [--quick] [--out DIR] [--device cpu|cuda] [--threads N]
                                        [--compile]

Never a timed test: this writes medians and ratios against baselines measured in the same run to
``benchmarks/results/overhead-DEVICE.json`` (and appends the run to ``overhead-DEVICE.runs.jsonl``)
and prints a table. Cases, with validation on (klest's default):

* ``kl_penalty``: ``klest.kl_penalty(estimator="k3", grad="cumulative", baseline="loo",
  group=...)`` forward + backward on B = 64 sequences x T = 4096 tokens, float32, a tenth of each
  row padded, groups of 8 samples; the baseline is the same math written in plain PyTorch in this
  file (:func:`plain_penalty`: k3's value, the reward-to-go score surrogate, a per-position
  leave-one-out baseline over each group).
* ``k1``: ``klest.k1(..., reduction="none")`` on 10M samples against ``logp - logp_ref``, and the
  default (mean) reduction against ``(logp - logp_ref).mean()``.

``--compile`` adds ``torch.compile``d forms of both sides of the ``kl_penalty`` case (klest's with
``validate=False``, which compiles as one graph; the compile time is not counted) and writes
``overhead-DEVICE-compiled.json`` instead.

Times are medians of repeated calls after warm-up, klest's and the baseline's calls interleaved
(CUDA: synchronized wall time, so the host time of the call counts), in wall time and in the
calling thread's CPU time; ``--quick`` shrinks the sizes (a smoke test).
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import klest
from _common import parser, write_report


def plain_penalty(logp, logp_ref, mask, group_size):
    """k3's value with the cumulative (reward-to-go) gradient and a per-position leave-one-out
    baseline over groups of ``group_size`` consecutive rows, in plain PyTorch (right padding)."""
    m = mask.to(logp.dtype)
    d = (logp - logp_ref) * m
    value = ((torch.expm1(-d) + d) * m).sum(-1).mean()
    to_go = d.detach().flip(-1).cumsum(-1).flip(-1) * m
    b, t = logp.shape
    tg, mg = to_go.view(-1, group_size, t), m.view(-1, group_size, t)
    others = (tg.sum(1, keepdim=True) - tg) / (mg.sum(1, keepdim=True) - mg).clamp(min=1)
    surrogate = (logp * (tg - others * mg).view(b, t)).sum(-1).mean()
    return value.detach() + surrogate - surrogate.detach()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(
    methods: dict[str, Callable[[], object]], device: str, reps: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and CPU seconds of each call, the methods interleaved (each repetition calls every
    method once, in turn), so that a change in the machine's load reaches all of them alike.

    CPU seconds are this thread's (``time.thread_time``: user and kernel time, page faults
    included): other processes move them less than the wall time, but they miss the work of
    torch's other threads (exact with ``--threads 1``). On CUDA the third list is the host time
    of each call (until it returns, before the synchronization: what the launches cost the
    CPU); on the CPU it is the wall time again."""
    for fn in methods.values():
        for _ in range(3):
            fn()
    seconds: dict[str, tuple[list[float], ...]] = {m: ([], [], []) for m in methods}
    for _ in range(reps):
        for m, fn in methods.items():
            wall, cpu, host = seconds[m]
            _sync(device)
            start, cpu_start = time.perf_counter(), time.thread_time()
            fn()
            returned, cpu_returned = time.perf_counter(), time.thread_time()
            _sync(device)
            wall.append(time.perf_counter() - start)
            cpu.append(cpu_returned - cpu_start)
            host.append(returned - start)
    return seconds


def _case(name: str, methods: dict[str, Callable[[], object]], tokens: int, device: str, reps):
    runs = _time(methods, device, reps)
    base, cpu_base, host_base = (statistics.median(s) for s in next(iter(runs.values())))
    return {
        "case": name,
        "tokens": tokens,
        "results": {
            m: {
                "seconds": statistics.median(s),
                "seconds_all": s,
                "ratio": statistics.median(s) / base,
                "tokens_per_second": tokens / statistics.median(s),
                "cpu_seconds": statistics.median(cpu),
                "cpu_ratio": statistics.median(cpu) / cpu_base,
                "host_seconds": statistics.median(host),
                "host_ratio": statistics.median(host) / host_base,
            }
            for m, (s, cpu, host) in runs.items()
        },
    }


def penalty_case(b: int, t: int, device: str, reps: int, *, compiled: bool = False) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logp0 = -torch.rand(b, t, generator=g, device=device) * 3
    logp_ref = -torch.rand(b, t, generator=g, device=device) * 3
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask[:, t - t // 10 :] = False
    group = torch.arange(b, device=device) // 8

    def klest_penalty(logp, validate=None):
        return klest.kl_penalty(
            logp,
            logp_ref,
            mask=mask,
            estimator="k3",
            grad="cumulative",
            baseline="loo",
            group=group,
            validate=validate,
        )

    def step(penalty):
        def run():
            penalty(logp0.clone().requires_grad_()).backward()

        return run

    def plain(logp):
        return plain_penalty(logp, logp_ref, mask, 8)

    methods = {"plain": step(plain), "klest": step(klest_penalty)}
    if compiled:  # the warm-up calls compile
        methods["plain, compiled"] = step(torch.compile(plain))
        methods["klest, compiled, validate=False"] = step(
            torch.compile(functools.partial(klest_penalty, validate=False), fullgraph=True)
        )
    return _case("kl_penalty k3/cumulative+loo fwd+bwd", methods, b * t, device, reps)


def k1_cases(n: int, device: str, reps: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(1)
    logp = -torch.rand(n, generator=g, device=device) * 3
    logp_ref = -torch.rand(n, generator=g, device=device) * 3
    per_sample = _case(
        "k1 per sample (reduction='none')",
        {
            "plain": lambda: logp - logp_ref,
            "klest": lambda: klest.k1(logp, logp_ref, reduction="none"),
        },
        n,
        device,
        reps,
    )
    mean = _case(
        "k1 mean (default reduction)",
        {
            "plain": lambda: (logp - logp_ref).mean(),
            "klest": lambda: klest.k1(logp, logp_ref),
        },
        n,
        device,
        reps,
    )
    return [per_sample, mean]


def _table(report: dict) -> str:
    cuda = report["device_kind"] == "cuda"
    lines = [
        f"device: {report['device']}; {report['threads']} thread(s); medians of "
        f"{report['reps']} calls; validation on\n",
        "| case | tokens | method | time (ms) | x plain | tokens/s | CPU time (ms) | x plain |"
        + (" host time (ms) | x plain |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if cuda else ""),
    ]
    for case in report["cases"]:
        for method, r in case["results"].items():
            host = f" {1e3 * r['host_seconds']:.3f} | {r['host_ratio']:.2f} |" if cuda else ""
            lines.append(
                f"| {case['case']} | {case['tokens']} | {method} | {1e3 * r['seconds']:.2f} | "
                f"{r['ratio']:.2f} | {r['tokens_per_second']:.3g} | "
                f"{1e3 * r['cpu_seconds']:.2f} | {r['cpu_ratio']:.2f} |{host}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile'd kl_penalty forms (writes overhead-DEVICE-compiled.json)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: torch's); 1 keeps a shared machine's other processes from "
        "stalling the multithreaded operations",
    )
    args = ap.parse_args()
    device = args.device
    b, t, n, reps = (8, 256, 100_000, 5) if args.quick else (64, 4096, 10_000_000, 20)
    if device == "cpu":
        torch.set_num_threads(max(1, args.threads or torch.get_num_threads()))
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "device_kind": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "reps": reps,
        "quick": args.quick,
        # Other processes and the C allocator move CPU timings: record both.
        "load_average_before": os.getloadavg(),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "compiled": args.compile,
        "cases": [
            penalty_case(b, t, device, reps, compiled=args.compile),
            *k1_cases(n, device, reps),
        ],
    }
    report["load_average_after"] = os.getloadavg()
    name = f"overhead-{device}" + ("-compiled" if args.compile else "")
    write_report(name, report, _table(report), args.out)


if __name__ == "__main__":
    main()
