"""Validation costs at most one host synchronisation per call, and none when it is off.

A synchronisation is any read of a tensor's value on the host: ``item``, ``tolist``, ``bool``,
``int``, ``float``, ``nonzero``. On the CPU they cost nothing, but the same code on a GPU stalls
at each one, so they are counted here by wrapping those methods.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import klest
from klest.integrations import openrlhf, verl
from klest.logits.kernels import triton_available
from klest.testbeds import make_generator
from tests._reference import random_log_probs

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")


@contextlib.contextmanager
def counted_host_reads(monkeypatch):
    calls = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    try:
        yield calls
    finally:
        monkeypatch.undo()


def _inputs():
    g = make_generator(0)
    logp = random_log_probs((8, 16), g, dtype=torch.float32).requires_grad_()
    logp_ref = random_log_probs((8, 16), g, dtype=torch.float32)
    mask = torch.rand(8, 16, generator=g) > 0.2
    mask[2] = False
    return logp, logp_ref, mask


CALLS = {
    "k1": lambda lp, lr, m, v: klest.k1(lp, lr, mask=m, validate=v),
    "k3 none": lambda lp, lr, m, v: klest.k3(lp, lr, mask=m, reduction="none", validate=v),
    "cv 0.5": lambda lp, lr, m, v: klest.cv(lp, lr, alpha=0.5, mask=m, validate=v),
    "cv loo": lambda lp, lr, m, v: klest.cv(lp, lr, alpha="loo", mask=m, validate=v),
    "kl_penalty cumulative+loo": lambda lp, lr, m, v: klest.kl_penalty(
        lp, lr, mask=m, baseline="loo", group=torch.arange(8, device=lp.device) // 4, validate=v
    ),
    "kl_penalty score+ema": lambda lp, lr, m, v: klest.kl_penalty(
        lp, lr, mask=m, grad="score", baseline=klest.BaselineEMA(), validate=v
    ),
    "kl_penalty token": lambda lp, lr, m, v: klest.kl_penalty(
        lp, lr, mask=m, grad="token", validate=v
    ),
    "aggregate": lambda lp, lr, m, v: klest.aggregate(lp, mask=m, validate=v),
    # The drop-ins: a peer's value with klest's gradient checks its inputs once, like klest.
    "verl k3 cumulative": lambda lp, lr, m, v: verl.kl_penalty(
        lp, lr, "k3", grad="cumulative", mask=m, validate=v
    ),
    "openrlhf k2 score": lambda lp, lr, m, v: openrlhf.compute_approx_kl(
        lp, lr, kl_estimator="k2", action_mask=m, grad="score", validate=v
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("validate", [True, False])
def test_at_most_one_host_read_with_validation_and_none_without(name, validate, monkeypatch):
    logp, logp_ref, mask = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with counted_host_reads(monkeypatch) as calls:
            out = CALLS[name](logp, logp_ref, mask, validate)
            out.sum().backward()
    assert len(calls) <= (1 if validate else 0), calls


class _TensorsFromHostData(TorchDispatchMode):
    """Records each tensor made from Python data (``torch.tensor``, ``as_tensor`` of a number
    or list: ``aten.lift_fresh``); on a GPU each is a copy from the host, which waits."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "lift_fresh" in str(func):
            self.made.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(CALLS))
def test_no_tensor_from_host_data_without_validation(name):
    """The CPU's stand-in for the CUDA check below: after a first call (which fills caches of
    constants), a call with ``validate=False`` and its backward make no tensor from Python
    numbers (a fill such as ``torch.full`` runs on the device instead)."""
    logp, logp_ref, mask = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CALLS[name](logp, logp_ref, mask, False).sum().backward()
        with _TensorsFromHostData() as mode:
            CALLS[name](logp, logp_ref, mask, False).sum().backward()
    assert not mode.made, mode.made


@pytest.mark.parametrize("baseline", ["loo", "loo-fitted", "mean"])
def test_a_group_baseline_reads_once_whatever_the_guessed_layout(baseline, monkeypatch):
    """kl_penalty guesses from the previous call whether a row is left-padded (and skips the
    alignment if not): a wrong guess is rebuilt without another read."""
    logp, logp_ref, _ = _inputs()
    right = torch.ones(8, 16, dtype=torch.bool)
    right[:, 12:] = False
    left = right.flip(-1)
    for mask in (right, left, left, right, right, left):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with counted_host_reads(monkeypatch) as calls:
                out = klest.kl_penalty(
                    logp, logp_ref, mask=mask, baseline=baseline, group=torch.arange(8) // 4
                )
                out.backward()
        assert len(calls) <= 1, calls


HAS_TRITON = triton_available()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (CUDA, or TRITON_INTERPRET=1)")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "fn",
    [
        klest.kl_from_logits,
        functools.partial(klest.jsd_from_logits, beta=0.3),
        functools.partial(klest.skew_kl_from_logits, alpha=0.2),
        klest.tv_from_logits,
    ],
    ids=["kl", "jsd", "skew", "tv"],
)
def test_from_logits_on_the_kernels_reads_once_and_none_without_validation(fn, masked, monkeypatch):
    """The Triton path (the one CUDA runs; here through the interpreter). A mask or ignored
    labels reach the kernels as one flag per row, so the rows to skip need no host read. (The
    chunked PyTorch engine, the CPU's path, reads per chunk whether a row needs its slow path.)"""
    g = make_generator(1)
    z = torch.randn(4, 6, 33, generator=g, requires_grad=True)
    y = torch.randn(4, 6, 33, generator=g)
    mask = labels = None
    if masked:
        mask = torch.rand(4, 6, generator=g) > 0.3
        labels = torch.randint(0, 33, (4, 6), generator=g)
        labels[0, :2] = -100
    for validate, allowed in ((True, 1), (False, 0)):
        with counted_host_reads(monkeypatch) as calls:
            fn(z, y, mask=mask, labels=labels, validate=validate, backend="triton").backward()
        assert len(calls) <= allowed, calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [*CALLS, "kl_from_logits masked", "jsd_from_logits masked"])
def test_no_synchronisation_on_cuda_without_validation(name):
    """On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` raises at any operation that waits
    for the device (``item``, ``nonzero``, a device-to-host copy): with ``validate=False`` a call
    and its backward must make none. Each call runs once first (caches of constants and the
    kernels' compilation)."""
    logp, logp_ref, mask = (t.cuda() for t in _inputs())
    logp = logp.detach().requires_grad_()
    g = make_generator(1)
    z = torch.randn(4, 6, 33, generator=g).cuda().requires_grad_()
    y = torch.randn(4, 6, 33, generator=g).cuda()
    row_mask = (torch.rand(4, 6, generator=g) > 0.3).cuda()
    calls = {
        **CALLS,
        "kl_from_logits masked": lambda *_: klest.kl_from_logits(
            z, y, mask=row_mask, validate=False
        ),
        "jsd_from_logits masked": lambda *_: klest.jsd_from_logits(
            z, y, beta=0.3, mask=row_mask, validate=False
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls[name](logp, logp_ref, mask, False).sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls[name](logp, logp_ref, mask, False).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (CUDA, or TRITON_INTERPRET=1)")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize(
    "fn",
    [klest.kl_from_logits, functools.partial(klest.jsd_from_logits, beta=0.3)],
    ids=["kl", "jsd"],
)
def test_no_tensor_from_host_data_on_the_kernels_without_validation(fn):
    """As above, for the masked exact-from-logits calls on the Triton kernels."""
    g = make_generator(1)
    z = torch.randn(4, 6, 33, generator=g, requires_grad=True)
    y = torch.randn(4, 6, 33, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    fn(z, y, mask=mask, validate=False, backend="triton").backward()
    with _TensorsFromHostData() as mode:
        fn(z, y, mask=mask, validate=False, backend="triton").backward()
    assert not mode.made, mode.made
