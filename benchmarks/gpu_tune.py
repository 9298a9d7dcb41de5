"""Sweep the Triton KL kernels' launch configurations on a GPU (CUDA only; JSON out).

For N x V bf16 logits (default 16384 x 128256), times the forward kernel (2 reads of the logits;
with only KL(pi||ref) asked for, and with all three sums) and the backward kernel for the gradient
of KL(pi||ref) w.r.t. z (2 reads, 1 write) over vocabulary blocks and warp counts, against the copy
bandwidth measured in the same run. Each configuration's output is checked against the library's
default launch (a wrong launch must not win on speed). Also the forward on masked vocabularies
(``max_err`` there is the mean loop index: 0 fast, 1 a clamped re-read, 2 careful).

    python benchmarks/gpu_tune.py --out tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from klest.bench_gpu import copy_bandwidth, time_cuda
from klest.logits.kernels import kl_logits_forward
from klest.logits.kernels.kl_logits import _kernels

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
    kern = _kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16()
    y = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16()
    bandwidth = copy_bandwidth()
    pass_s = z.nbytes / bandwidth
    scale = math.log2(math.e)
    rows = []

    out = torch.empty(7, n, device="cuda")
    wants = {"KL(pi||ref)": (True, False, False), "all three": (True, True, True)}
    for label, (ab, ba, ent) in wants.items():
        ref = kl_logits_forward(z, y, want_kl_pi_ref=ab, want_kl_ref_pi=ba, want_entropy=ent)
        for bv, warps in itertools.product(BLOCKS, WARPS):

            def fwd(bv=bv, warps=warps, ab=ab, ba=ba, ent=ent):
                kern.kl_logits_fwd_kernel[(n,)](
                    z, y, out, out, out, z.stride(0), y.stride(0), n, v, scale,
                    HAS_LABELS=False, RECORD_PATH=False, WANT_AB=ab, WANT_BA=ba, WANT_ENT=ent,
                    BLOCK_V=bv, num_warps=warps,
                )  # fmt: skip

            def fwd_error(ref=ref):
                return max((out[i] - ref[i]).abs().max().item() for i in range(5))

            out.fill_(float("nan"))
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

    g1 = torch.ones(n, device="cuda")
    dz = torch.empty_like(z)
    lse_a, lse_b, kl_ab, kl_ba, ent = (s.contiguous() for s in kl_logits_forward(z, y)[:5])
    dz_ref = torch.empty_like(z)
    flags = dict(HAS_G1=True, HAS_G2=False, HAS_G3=False, HAS_G4=False, HAS_G5=False,
                 NEED_DZ=True, NEED_DY=False, USE_Z=True, USE_Y=True)  # fmt: skip
    for i, (bv, warps) in enumerate(itertools.product(BLOCKS, WARPS)):

        def bwd(bv=bv, warps=warps):
            kern.kl_logits_bwd_kernel[(n, -(-v // bv))](
                z, y, g1, lse_a, lse_b, kl_ab, kl_ba, ent, g1, g1, g1, g1, g1, dz, dz,
                z.stride(0), y.stride(0), dz.stride(0), dz.stride(0), v, scale, 1.0,
                **flags, BLOCK_V=bv, num_warps=warps,
            )  # fmt: skip

        def bwd_error(first=i == 0):
            if first:
                dz_ref.copy_(dz)
            return (dz.float() - dz_ref.float()).abs().max().item()

        dz.fill_(float("nan"))
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
