"""GPU benchmark of the exact-from-logits paths (CUDA only; JSON out).

    python benchmarks/bench_gpu.py [--quick] [--out DIR]

Writes ``benchmarks/results/vocab-gpu.json`` (or ``DIR/vocab-gpu.json``) and prints a table.
``--quick``: N=2048, V=32000, H=1024.

N=16384 positions, V=128256 (Llama 3's vocabulary), bf16 logits. Every number is measured in the
same run: the copy bandwidth (``dst.copy_(src)`` of a 4 GiB tensor: bytes read + written per
second) gives the roofline, 2 reads of the logits for the forward and 5 passes (2 reads forward,
2 reads and 1 write backward) for forward + backward. Methods, for KL(ref||pi) with the gradient
to pi's logits (the direction Liger-Kernel's KL loss differentiates) and KL(pi||ref) for klest:

* ``klest``: :func:`klest.kl_from_logits` (Triton kernels);
* ``eager``: ``F.kl_div(log_softmax(z), log_softmax(y), log_target=True)`` in PyTorch;
* ``compile``: the same expression under ``torch.compile``;
* ``liger``: ``LigerKLDIVLoss(log_target=True)`` on ``log_softmax(z)``, when liger_kernel imports.

Also the fused-linear path (:func:`klest.kl_from_hidden`, H=4096): its peak memory beyond inputs
and gradients, against one ``[N, V]`` bf16 logits tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

import klest
from _common import copy_bandwidth, parser, time_cuda, write_report


def _peak_added(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_vocab_gpu(*, quick: bool) -> dict:
    """Forward and forward + backward times against the roofline; fused-linear peak memory."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/bench_gpu.py needs a CUDA device")
    n, v, h_dim = (2048, 32000, 1024) if quick else (16384, 128256, 4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    y = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    logits_bytes = n * v * z.element_size()
    bandwidth = copy_bandwidth()

    def naive(zz, yy):
        return F.kl_div(
            F.log_softmax(zz.float(), -1),
            F.log_softmax(yy.float(), -1),
            log_target=True,
            reduction="none",
        ).sum(-1)

    compiled = torch.compile(naive)
    methods: dict[str, Callable] = {
        "klest pi||ref": lambda zz, yy: klest.kl_from_logits(zz, yy, reduction="none"),
        "klest ref||pi": lambda zz, yy: klest.kl_from_logits(
            zz, yy, direction="ref||pi", reduction="none"
        ),
        "eager ref||pi": naive,
        "compile ref||pi": compiled,
    }
    try:
        from liger_kernel.transformers import LigerKLDIVLoss

        liger = LigerKLDIVLoss(reduction="sum", log_target=True)
        methods["liger ref||pi"] = lambda zz, yy: liger(
            F.log_softmax(zz.float(), -1), F.log_softmax(yy.float(), -1)
        )
    except ImportError:
        pass

    results = {}
    zg = z.detach().requires_grad_()
    for name, fn in methods.items():
        row: dict[str, float | str] = {}
        try:
            with torch.no_grad():
                row["forward_s"] = time_cuda(lambda fn=fn: fn(z, y))

            def step(fn=fn):
                zg.grad = None
                fn(zg, y).sum().backward()

            row["forward_backward_s"] = time_cuda(step)
            row["peak_added_bytes"] = _peak_added(step)
        except Exception as e:  # an out-of-memory baseline is a result, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
        results[name] = row

    roofline_fwd = 2 * logits_bytes / bandwidth
    roofline_fb = 5 * logits_bytes / bandwidth
    for row in results.values():
        if "forward_s" in row:
            row["forward_vs_roofline"] = roofline_fwd / row["forward_s"]
        if "forward_backward_s" in row:
            row["forward_backward_vs_roofline"] = row["forward_backward_s"] / roofline_fb

    hid = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h_dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    hid_ref, w_ref = hid.clone(), (w + 0.01 * torch.randn_like(w)).contiguous()
    hid.requires_grad_()
    w.requires_grad_()

    def fused_step():
        hid.grad = w.grad = None
        klest.kl_from_hidden(hid, w, hid_ref, w_ref, reduction="token-mean").backward()

    grads_bytes = (hid.numel() + w.numel()) * 2
    # The weight gradient is summed over chunks in float32, then cast to the weight's dtype.
    accumulator_bytes = w.numel() * 4
    fused = {
        "forward_backward_s": time_cuda(fused_step, warmup=1, reps=3),
        "peak_added_bytes": _peak_added(fused_step),
        "gradient_bytes": grads_bytes,
        "weight_grad_fp32_accumulator_bytes": accumulator_bytes,
        "one_logits_tensor_bytes": logits_bytes,
        "matmul_flop": 6 * 2 * n * v * h_dim,  # 2 forward, 2 recomputed, dh and dW
    }
    fused["peak_added_vs_logits"] = fused["peak_added_bytes"] / logits_bytes

    return {
        "benchmark": "vocab-gpu",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "N": n,
        "V": v,
        "H": h_dim,
        "dtype": "bfloat16",
        "copy_bandwidth_bytes_per_s": bandwidth,
        "roofline_forward_s": roofline_fwd,
        "roofline_forward_backward_s": roofline_fb,
        "methods": results,
        "fused_linear": fused,
    }


def format_vocab_gpu(report: dict) -> str:
    lines = [
        f"{report['device']}, N={report['N']}, V={report['V']}, bf16; copy bandwidth "
        f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; roofline forward "
        f"{report['roofline_forward_s'] * 1e3:.2f} ms, forward+backward "
        f"{report['roofline_forward_backward_s'] * 1e3:.2f} ms",
        "",
        "| method | forward (ms) | % roofline | fwd+bwd (ms) | x 5-pass roofline "
        "| peak added (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["methods"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error'][:60]} | | | | |")
            continue
        lines.append(
            f"| {name} | {r['forward_s'] * 1e3:.2f} | {100 * r['forward_vs_roofline']:.0f}% | "
            f"{r['forward_backward_s'] * 1e3:.2f} | {r['forward_backward_vs_roofline']:.2f} | "
            f"{r['peak_added_bytes'] / 2**30:.2f} |"
        )
    f = report["fused_linear"]
    tflops = f["matmul_flop"] / f["forward_backward_s"] / 1e12
    accumulator = f["weight_grad_fp32_accumulator_bytes"]
    lines.append(
        f"\nfused linear (H={report['H']}): forward+backward "
        f"{f['forward_backward_s'] * 1e3:.1f} ms ({tflops:.0f} TFLOP/s of matmul); "
        f"peak added {f['peak_added_bytes'] / 2**30:.2f} GiB "
        f"({f['peak_added_vs_logits']:.2f} x one [N, V] bf16 logits tensor), of which the "
        f"float32 weight-gradient accumulator is {accumulator / 2**30:.2f} GiB and the "
        f"gradients {f['gradient_bytes'] / 2**30:.2f} GiB"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    report = bench_vocab_gpu(quick=args.quick)
    write_report("vocab-gpu", report, format_vocab_gpu(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
