"""GPU benchmark of the exact-from-logits paths (CUDA only; JSON out).

    python benchmarks/bench_gpu.py [--quick] [--out DIR]

Writes ``benchmarks/results/vocab-gpu.json`` (or ``DIR/vocab-gpu.json``) and prints a table.
``--quick``: N=2048, V=32000, H=1024.

N=16384 positions, V=128256 (Llama 3's vocabulary), bf16 logits. Every number is measured in the
same run, and each path against its own roofline:

* from logits, memory-bound: the copy bandwidth (``dst.copy_(src)`` of a 4 GiB tensor: bytes read
  + written per second) gives the time of 2 reads of the logits (the forward) and of 3 passes
  (forward + backward: read both logits once, write the gradient once; :mod:`klest.logits` does
  that for a scalar loss). Methods, for KL(ref||pi) with the gradient to pi's logits (the
  direction Liger-Kernel's KL loss differentiates) and both directions for klest:

  * ``klest``: :func:`klest.kl_from_logits` (Triton kernels), ``reduction="sum"``: the gradient
    written in the forward pass; ``recompute``: ``stash=False`` (5 passes); ``overwrite``:
    ``overwrite_logits=True`` (no new ``[N, V]`` buffer);
  * ``eager``: ``F.kl_div(log_softmax(z), log_softmax(y), log_target=True)`` in PyTorch;
  * ``compile``: the same expression under ``torch.compile``;
  * ``liger``: ``LigerKLDIVLoss(log_target=True)`` on ``log_softmax(z)``, when liger_kernel imports.

* fused with the heads (:func:`klest.kl_from_hidden`, H=4096, a student against a frozen teacher
  head), compute-bound: the rate of one bf16 ``[N, H] x [H, V]`` product measured here gives the
  time of 4 such products (the two models' logits, ``dh``, ``dW``). Methods: ``klest``
  (``reduction="token-mean"``: the gradients made in the forward pass), ``klest recompute``
  (``stash=False``: 6 products), ``fla`` (``fused_kl_div_loss`` of flash-linear-attention,
  KL(ref||pi), when ``fla`` imports), ``compile`` (``F.linear`` then the KL under
  ``torch.compile``); their peak memory beyond inputs and gradients, against one ``[N, V]`` bf16
  logits tensor.

Every baseline that fails (out of memory, not installed) is recorded as such, not a crash.
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

    def kl(**options) -> Callable:
        return lambda zz, yy: klest.kl_from_logits(zz, yy, reduction="sum", **options)

    methods: dict[str, Callable] = {
        "klest pi||ref": kl(),
        "klest ref||pi": kl(direction="ref||pi"),
        "klest pi||ref recompute": kl(stash=False),
        # Writes the gradient over the leaf it times with: finite values, as good as any.
        "klest pi||ref overwrite": kl(overwrite_logits=True),
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
    roofline_fb = ROOFLINE_PASSES * logits_bytes / bandwidth
    for row in results.values():
        if "forward_s" in row:
            row["forward_vs_roofline"] = roofline_fwd / row["forward_s"]
        if "forward_backward_s" in row:
            row["forward_backward_vs_roofline"] = row["forward_backward_s"] / roofline_fb

    fused = bench_fused_linear(n, v, h_dim, g, logits_bytes)
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
        "roofline_passes_forward_backward": ROOFLINE_PASSES,
        "methods": results,
        "fused_linear": fused,
    }


ROOFLINE_PASSES = 3
"""Passes over ``[N, V]`` of a forward + backward at the floor: read z, read y, write dz."""
PRODUCTS_FLOOR = 4
"""Matrix products of a fused forward + backward at the floor (frozen teacher head)."""


def _gemm_rate(n: int, v: int, h_dim: int, g: torch.Generator) -> float:
    """FLOP/s of one bf16 ``[N, H] x [H, V]`` product (the head's logits), timed here."""
    a = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(v, h_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    seconds = time_cuda(lambda: a @ b.T)
    return 2 * n * h_dim * v / seconds


def bench_fused_linear(n: int, v: int, h_dim: int, g: torch.Generator, logits_bytes: int) -> dict:
    """kl_from_hidden against 4 products at the measured product rate, and the baselines."""
    hid = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h_dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    hid_ref, w_ref = hid.clone(), (w + 0.01 * torch.randn_like(w)).contiguous()
    hid.requires_grad_()
    w.requires_grad_()
    product_flop = 2 * n * v * h_dim
    rate = _gemm_rate(n, v, h_dim, g)

    def plain(hh, ww, hr, wr):
        return F.kl_div(
            F.log_softmax(F.linear(hh, ww).float(), -1),
            F.log_softmax(F.linear(hr, wr).float(), -1),
            log_target=True,
            reduction="batchmean",
        )

    compiled = torch.compile(plain)

    def kl(**options) -> Callable:
        return lambda: klest.kl_from_hidden(
            hid, w, hid_ref, w_ref, reduction="token-mean", **options
        )

    methods: dict[str, tuple[Callable, int]] = {
        "klest pi||ref": (kl(), PRODUCTS_FLOOR),
        "klest ref||pi": (kl(direction="ref||pi"), PRODUCTS_FLOOR),
        "klest pi||ref recompute": (kl(stash=False), 6),
        "compile ref||pi": (lambda: compiled(hid, w, hid_ref, w_ref), 4),
    }
    try:
        from fla.modules.fused_kl_div import fused_kl_div_loss

        methods["fla ref||pi"] = (lambda: fused_kl_div_loss(hid, hid_ref, w, w_ref), 4)
    except ImportError:
        pass
    results = {}
    for name, (fn, products) in methods.items():

        def step(fn=fn):
            hid.grad = w.grad = None
            fn().backward()

        row: dict[str, float | str] = {"matmul_flop": products * product_flop}
        try:
            row["forward_backward_s"] = time_cuda(step, warmup=1, reps=3)
            row["peak_added_bytes"] = _peak_added(step)
            row["vs_roofline"] = row["forward_backward_s"] / (PRODUCTS_FLOOR * product_flop / rate)
            row["peak_added_vs_logits"] = row["peak_added_bytes"] / logits_bytes
        except Exception as e:  # an out-of-memory baseline is a result, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
        results[name] = row
    best = results["klest pi||ref"]
    return {
        # the default path, at the top level (the fields of earlier runs)
        "forward_backward_s": best.get("forward_backward_s", float("nan")),
        "peak_added_bytes": best.get("peak_added_bytes", 0),
        "peak_added_vs_logits": best.get("peak_added_vs_logits", float("nan")),
        "gradient_bytes": (hid.numel() + w.numel()) * 2,
        # dh and dW are held in float32 from the forward to the backward
        "weight_grad_fp32_accumulator_bytes": w.numel() * 4,
        "one_logits_tensor_bytes": logits_bytes,
        "matmul_flop": PRODUCTS_FLOOR * product_flop,
        "product_flop_per_s": rate,
        "roofline_s": PRODUCTS_FLOOR * product_flop / rate,
        "methods": results,
    }


def format_vocab_gpu(report: dict) -> str:
    passes = report.get("roofline_passes_forward_backward", 5)  # 5: runs before the 3-pass path
    lines = [
        f"{report['device']}, N={report['N']}, V={report['V']}, bf16; copy bandwidth "
        f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; roofline forward "
        f"{report['roofline_forward_s'] * 1e3:.2f} ms, forward+backward "
        f"{report['roofline_forward_backward_s'] * 1e3:.2f} ms",
        "",
        f"| method | forward (ms) | % roofline | fwd+bwd (ms) | x {passes}-pass roofline "
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
    if "methods" in f:
        lines += [
            f"\nroofline: {PRODUCTS_FLOOR} products at the measured "
            f"{f['product_flop_per_s'] / 1e12:.0f} TFLOP/s = {f['roofline_s'] * 1e3:.1f} ms",
            "",
            "| fused method | fwd+bwd (ms) | x roofline | TFLOP/s counted | peak added (GiB) |",
            "|---|---|---|---|---|",
        ]
        for name, r in f["methods"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['error'][:60]} | | | |")
                continue
            lines.append(
                f"| {name} | {r['forward_backward_s'] * 1e3:.1f} | {r['vs_roofline']:.2f} | "
                f"{r['matmul_flop'] / r['forward_backward_s'] / 1e12:.0f} | "
                f"{r['peak_added_bytes'] / 2**30:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    report = bench_vocab_gpu(quick=args.quick)
    write_report("vocab-gpu", report, format_vocab_gpu(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
