"""Sweep the Triton KL kernels' launch configurations on a GPU (CUDA only; JSON out).

For N x V bf16 logits (default 16384 x 128256), times the forward kernel (2 reads of the logits;
with only KL(pi||ref) asked for, and with all three sums) and the backward kernel for the gradient
of KL(pi||ref) w.r.t. z (2 reads, 1 write) over vocabulary blocks and warp counts, against the copy
bandwidth measured in the same run. Each configuration's output is checked against the library's
default launch (a wrong launch must not win on speed). Also the forward on masked vocabularies
(``max_err`` there is the mean loop index: 0 fast, 1 a clamped re-read, 2 careful). Every launch
goes through the public :func:`klest.logits.kernels.kl_logits_forward` / ``kl_logits_backward``
(``block_v=``, ``num_warps=``), so each timing includes their argument checks and the output
allocation (microseconds, next to milliseconds of kernel).

    python benchmarks/gpu_tune.py --out tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from _common import copy_bandwidth, time_cuda
from klest.logits.kernels import kl_logits_backward, kl_logits_forward

BLOCKS = (512, 1024, 2048, 4096)
WARPS = (2, 4, 8)


def measure(row: dict, run: Callable[[], None], error: Callable[[], float], floor_s: float) -> dict:
    """Time ``run`` (after checking it with ``error``); a launch that fails is a result too."""
    try:
        run()
        err = error()
        t = time_cuda(run)
        row.update(s=t, roofline_fraction=floor_s / t, max_err=err)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n, v = args.n, args.v
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16()
    y = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16()
    bandwidth = copy_bandwidth()
    pass_s = z.nbytes / bandwidth
    rows = []

    last: dict = {}  # the latest launch's output, checked before it is timed
    wants = {"KL(pi||ref)": (True, False, False), "all three": (True, True, True)}
    for label, (ab, ba, ent) in wants.items():
        ref = kl_logits_forward(z, y, want_kl_pi_ref=ab, want_kl_ref_pi=ba, want_entropy=ent)
        for bv, warps in itertools.product(BLOCKS, WARPS):

            def fwd(bv=bv, warps=warps, ab=ab, ba=ba, ent=ent):
                last["stats"] = kl_logits_forward(
                    z,
                    y,
                    want_kl_pi_ref=ab,
                    want_kl_ref_pi=ba,
                    want_entropy=ent,
                    block_v=bv,
                    num_warps=warps,
                )

            def fwd_error(ref=ref):
                out = last["stats"]
                return max((out[i] - ref[i]).abs().max().item() for i in range(5))

            last.clear()
            row = {"kernel": f"forward {label}", "block_v": bv, "num_warps": warps}
            rows.append(measure(row, fwd, fwd_error, 2 * pass_s))

    # Masked vocabularies, through the public function (default launch), KL(pi||ref) only: a -inf
    # mask shared by both (the last 1000 tokens) or on pi alone (KL(pi||ref) finite) takes the
    # clamped re-read; a mask on ref alone makes KL(pi||ref) +inf (careful loop).
    for label, zm, ym in (
        ("shared mask", True, True),
        ("mask on pi only", True, False),
        ("mask on ref only", False, True),
    ):
        zz, yy = z.clone(), y.clone()
        if zm:
            zz[:, -1000:] = float("-inf")
        if ym:
            yy[:, -1000:] = float("-inf")
        careful = torch.zeros(n, dtype=torch.int32, device="cuda")

        def masked(zz=zz, yy=yy, careful=careful):
            kl_logits_forward(
                zz, yy, want_kl_ref_pi=False, want_entropy=False, careful_rows=careful
            )

        row = {"kernel": f"forward {label}", "block_v": 1024, "num_warps": 4}
        rows.append(measure(row, masked, lambda c=careful: float(c.float().mean()), 2 * pass_s))
        del zz, yy

    # The gradient of KL(pi||ref) w.r.t. z alone; checked against the first configuration's.
    g1 = torch.ones(n, device="cuda")
    stats = kl_logits_forward(z, y)
    dz_ref = torch.empty_like(z)
    for i, (bv, warps) in enumerate(itertools.product(BLOCKS, WARPS)):

        def bwd(bv=bv, warps=warps):
            last["dz"] = None  # free the previous gradient before the next is allocated
            last["dz"], _ = kl_logits_backward(
                z, y, stats, grad_kl_pi_ref=g1, block_v=bv, num_warps=warps
            )

        def bwd_error(first=i == 0):
            dz = last["dz"]
            if first:
                dz_ref.copy_(dz)
            return (dz.float() - dz_ref.float()).abs().max().item()

        last.clear()
        row = {"kernel": "backward KL(pi||ref)", "block_v": bv, "num_warps": warps}
        rows.append(measure(row, bwd, bwd_error, 3 * pass_s))

    report = {
        "device": torch.cuda.get_device_name(),
        "N": n,
        "V": v,
        "dtype": "bfloat16",
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for r in rows:
        if "s" in r:
            print(
                f"{r['kernel']:22s} bv={r['block_v']:5d} warps={r['num_warps']:2d} "
                f"{r['s'] * 1e3:7.3f} ms {100 * r['roofline_fraction']:5.1f}% "
                f"err={r['max_err']:.1e}"
            )


if __name__ == "__main__":
    main()
