"""The work of the exact-divergence paths, counted on the CPU (no timing).

A GPU's time for these paths is the bytes they move over ``[N, V]`` tensors and their matrix
products. :class:`klest.logits._traffic.Traffic` counts the first in passes (bytes over the
buffer's size: the Triton kernels through the interpreter, element by element; the PyTorch
engine by chunk), :func:`klest.logits._traffic.matmul_flops` the second
(``torch.utils.flop_counter.FlopCounterMode`` and the product calls). The floors:

* from logits, forward + backward: read each logits tensor once and write the gradient once,
  3 passes; the backward adds nothing when the loss reaches it with 1 (and 2 passes, a read and
  a write of the gradient, when it must rescale); recomputing in the backward reads both logits
  again;
* from logit shards over a process group (vocab-parallel): the KL's statistics merge once
  (2 passes) and its backward recomputes (3); the JSD, skew KL and TV read each chunk three
  times (normalizers, sums, gradient: the merges sit between; from cache on the PyTorch
  engine, from memory by each Triton kernel) and write the gradient in the forward;
* from hidden states: one product per model for the logits, then ``dh`` and ``dW`` for each
  trainable side: 4 per chunk for a student against a frozen teacher head, each ``2 N H V``
  FLOPs; recomputing adds the two logits products;
* from hidden states against several teachers: the student's logits, ``dh`` and ``dW`` once a
  chunk for all of its teachers, plus each teacher's logits: 4 routed, ``3 + K`` averaged.

Each test fails if a change adds a pass or a product. Chunks of 2 rows of 8 keep the PyTorch
engine's chunk buffers smaller than ``[N, V]``, so that only the logits and gradients count.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import klest
from klest.logits._traffic import Traffic, matmul_flops
from klest.logits.kernels import triton_available

N, V = 8, 2048
# The Triton kernels are counted through triton's interpreter only (on a GPU they run unseen).
BACKENDS = ["torch"] + (
    ["triton"] if triton_available() and os.environ.get("TRITON_INTERPRET") == "1" else []
)
each_backend = pytest.mark.parametrize("backend", BACKENDS)

DIVERGENCES = {
    "kl": klest.kl_from_logits,
    "kl-ref||pi": functools.partial(klest.kl_from_logits, direction="ref||pi"),
    "jsd": functools.partial(klest.jsd_from_logits, beta=0.3),
    "skew-kl": functools.partial(klest.skew_kl_from_logits, alpha=0.4),
    "tv": klest.tv_from_logits,
}


def _logits():
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(N, V, generator=g) * 2).requires_grad_()
    y = torch.randn(N, V, generator=g) * 2
    return z, y, torch.randint(0, V, (N,), generator=g)


def _count(fn, backend, *, upstream=1.0, **options):
    """``(forward, backward, summary)``: the passes of one call and of its backward."""
    z, y, _ = _logits()
    with Traffic(logits=z, logits_ref=y) as traffic:
        out = fn(z, y, backend=backend, chunk_size=2, **options)
        forward = traffic.total()
        loss = out * upstream
        (loss.sum() if loss.ndim else loss).backward()
    return forward, traffic.total() - forward, traffic.summary()


@each_backend
@pytest.mark.parametrize("name", DIVERGENCES)
def test_logits_forward_and_backward_take_three_passes(backend, name):
    """A scalar loss: both logits read once, the gradient written once, in the forward; the
    backward touches nothing."""
    forward, backward, summary = _count(DIVERGENCES[name], backend, reduction="sum")
    assert (forward, backward) == (3.0, 0.0), summary
    assert summary["logits"] == (1.0, 0.0) and summary["logits_ref"] == (1.0, 0.0), summary


@each_backend
def test_several_outputs_and_scale_come_from_the_same_three_passes(backend):
    """Details (label log-probs, entropy), a weighted label cross-entropy and a folded ``scale``
    add no pass; a per-position result with ``scale`` is summed: still 3. With labels the Triton
    kernel reads each row's label entry of both logits once more: 2 entries a row, ``2 / V`` of
    a pass."""
    _, _, labels = _logits()
    kl = klest.kl_from_logits

    def details(z, y, **kw):
        return kl(z, y, labels=labels, return_details=True, **kw).value

    for fn, options, extra in (
        (kl, {"reduction": "token-mean", "scale": 0.1}, 0.0),
        (kl, {"reduction": "none", "scale": 1.0}, 0.0),
        (kl, {"reduction": "sum", "labels": labels, "ce_weight": 0.5}, 2.0 / V),
        (details, {"reduction": "sum"}, 2.0 / V),
    ):
        forward, backward, summary = _count(fn, backend, **options)
        assert backward == 0.0, options
        assert forward in (3.0, 3.0 + extra), (options, summary)


@each_backend
def test_overwrite_logits_writes_the_gradient_into_them(backend):
    """``overwrite_logits``: the same 3 passes, and no new ``[N, V]`` buffer."""
    forward, backward, summary = _count(
        klest.kl_from_logits, backend, reduction="sum", overwrite_logits=True
    )
    assert (forward, backward) == (3.0, 0.0)
    assert set(summary) == {"logits", "logits_ref"} and summary["logits"] == (1.0, 1.0)


@each_backend
def test_backward_rescales_only_when_the_upstream_gradient_is_not_the_expected_one(backend):
    """A loss reaching the backward with 2 (not folded into ``scale``): one read and one write
    of the gradient there, nothing else."""
    forward, backward, _ = _count(klest.kl_from_logits, backend, upstream=2.0, reduction="sum")
    assert (forward, backward) == (3.0, 2.0)


def test_recompute_reads_the_logits_again():
    """``stash=False`` (the PyTorch engine): the statistics pass, then the backward's pass over
    both logits and its write of the gradient: 5."""
    forward, backward, summary = _count(klest.kl_from_logits, "torch", reduction="sum", stash=False)
    assert (forward, backward) == (2.0, 3.0), summary


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of this process alone (the vocab-parallel paths need one)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


VOCAB_PARALLEL = {
    "kl": klest.kl_from_logits_vocab_parallel,
    "jsd": functools.partial(klest.jsd_from_logits_vocab_parallel, beta=0.3),
    "skew-kl": functools.partial(klest.skew_kl_from_logits_vocab_parallel, alpha=0.4),
    "tv": klest.tv_from_logits_vocab_parallel,
}


@each_backend
@pytest.mark.parametrize("name", VOCAB_PARALLEL)
def test_vocab_parallel_passes(one_rank, backend, name):
    """Logit shards, a scalar loss. The KL merges the shards' statistics once for all rows and
    its backward reads both shards again and writes the gradient. The JSD, skew KL and TV need
    the whole rows' normalizers before a term can be summed and the summed ``<q, G_q>`` before
    a gradient: each chunk is read for its normalizers, again for its sums, again for its
    gradient (written in the forward), with a merge between. The PyTorch engine does the three
    on a chunk in cache (1 pass a tensor); each Triton kernel reads it from memory again, and
    the statistics kernel reads a row's first block (1024 of 2048 here) for its offset first:
    1.5 + 1 + 1 passes a tensor."""
    forward, backward, summary = _count(VOCAB_PARALLEL[name], backend, reduction="sum")
    want = {
        ("torch", True): (2.0, 3.0),
        ("triton", True): (3.0, 3.0),
        ("torch", False): (3.0, 0.0),
        ("triton", False): (8.0, 0.0),
    }
    assert (forward, backward) == want[backend, name == "kl"], summary


# -- fused with the heads: matrix products -------------------------------------------------------

ROWS, H, HR, VOCAB, CHUNK = 12, 8, 6, 64, 4


def _heads(*, train_ref_hidden=False, train_ref_head=False):
    g = torch.Generator().manual_seed(1)

    def r(*shape, grad):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    return (
        r(ROWS, H, grad=True),
        r(VOCAB, H, grad=True),
        r(ROWS, HR, grad=train_ref_hidden),
        r(VOCAB, HR, grad=train_ref_head),
    )


def _products(fn, **options):
    with matmul_flops() as counted:
        out = fn(chunk_size=CHUNK, **options)
        (out.sum() if out.ndim else out).backward()
    return counted["products"], counted["flops"]


@pytest.mark.parametrize(
    ("case", "per_chunk"),
    [
        ("frozen teacher head", 4),  # 2 logits + dh + dW
        ("teacher logits", 3),  # 1 logits + dh + dW
        ("teacher hidden states train", 5),  # + dh_ref, no dW_ref: its head is frozen
        ("both trained", 6),  # + dh_ref + dW_ref
        ("per position: recompute", 6),  # 2 logits, again in the backward, + dh + dW
        ("stash=False: recompute", 6),
    ],
)
def test_kl_from_hidden_products(case, per_chunk):
    """Products per chunk of rows, each ``2 * rows * H * V`` FLOPs (``H`` of its side)."""
    h, w, hr, wr = _heads(
        train_ref_hidden=case in ("teacher hidden states train", "both trained"),
        train_ref_head=case == "both trained",
    )
    options = {}
    if case == "teacher logits":
        options["logits_ref"] = (hr @ wr.T).detach()
    else:
        options.update(hidden_ref=hr, weight_ref=wr)
    if case.startswith("per position"):
        options["reduction"] = "none"
    if case.startswith("stash=False"):
        options["stash"] = False
    products, flops = _products(functools.partial(klest.kl_from_hidden, h, w), **options)
    chunks = ROWS // CHUNK
    assert products == per_chunk * chunks, case
    pi, ref = 2 * ROWS * H * VOCAB, 2 * ROWS * HR * VOCAB
    want = {
        "frozen teacher head": 3 * pi + ref,
        "teacher logits": 3 * pi,
        "teacher hidden states train": 3 * pi + 2 * ref,
        "both trained": 3 * pi + 3 * ref,
    }.get(case, 4 * pi + 2 * ref)
    assert flops == want, case


@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(klest.jsd_from_hidden, beta=0.3),
        functools.partial(klest.skew_kl_from_hidden, alpha=0.4),
        klest.tv_from_hidden,
    ],
    ids=["jsd", "skew-kl", "tv"],
)
def test_divergences_from_hidden_take_four_products_per_chunk(fn):
    h, w, hr, wr = _heads()
    products, flops = _products(functools.partial(fn, h, w, hr, wr))
    assert products == 4 * (ROWS // CHUNK)
    assert flops == 3 * 2 * ROWS * H * VOCAB + 2 * ROWS * HR * VOCAB


# -- several teachers from hidden states ----------------------------------------------------------

K = 3
SETS = {  # each case's teachers per sequence of 4 rows (a chunk), then what trains
    "routed": ([(0,), (2,), (0,)], {}),
    "averaged": ([(0, 1, 2)] * 3, {}),
    "two of three": ([(0, 2)] * 3, {}),
    "per position, mixed": ([(0,), (0, 1), (0, 1, 2)], {}),
    "routed, teacher 0's head trains": ([(0,), (2,), (0,)], {"head": True}),
    "routed, teacher hidden states train": ([(0,), (2,), (0,)], {"states": True}),
    "routed, per position: recompute": ([(0,), (2,), (0,)], {"reduction": "none"}),
    "routed, stash=False: recompute": ([(0,), (2,), (0,)], {"stash": False}),
    "averaged, per position: recompute": ([(0, 1, 2)] * 3, {"reduction": "none"}),
}


def _teachers_call(sets, *, head=False, states=False, **options):
    """The student (hidden states and head trained) against K teachers' heads ``[V, HR]`` on
    one ``teacher_hidden`` tensor, 3 sequences of 4 rows, each sequence's teachers ``sets``
    (equal weights): a route when each has one."""
    h, w, hr, _ = _heads(train_ref_hidden=states)
    g = torch.Generator().manual_seed(2)
    heads = [torch.randn(VOCAB, HR, generator=g).requires_grad_(head and k == 0) for k in range(K)]
    if all(len(s) == 1 for s in sets):
        options["route"] = torch.tensor([s[0] for s in sets])
    else:
        weights = torch.zeros(3, 4, K)
        for b, s in enumerate(sets):
            weights[b, :, list(s)] = 1.0 / len(s)
        options["weights"] = weights
    return functools.partial(
        klest.multi_teacher_kl_from_hidden, h.reshape(3, 4, H), w, hr.reshape(3, 4, HR), heads
    ), options


@pytest.mark.parametrize("case", SETS)
def test_multi_teacher_kl_from_hidden_products(case):
    """Each chunk of rows (here a sequence of 4) with a scalar loss: pi's logits once, each of
    its teachers' logits, ``dh`` and ``dW`` once for their summed gradient: 3 + (its teachers),
    4 routed; + ``dW_k`` / ``dh_k`` where a teacher's tensors train. A per-position result or
    ``stash=False`` recomputes: per teacher, each of its chunks' logits twice + ``dh`` + ``dW``,
    6. FLOPs: ``2 * rows * H * V`` a product (``HR`` on a teacher's side)."""
    sets, how = SETS[case]
    fn, options = _teachers_call(sets, **how)
    products, flops = _products(fn, **options)
    pi, ref = 2 * 4 * H * VOCAB, 2 * 4 * HR * VOCAB  # one chunk's product on each side
    if "recompute" in case:
        per_chunk = [6 * len(s) for s in sets]
        want = sum(len(s) * (4 * pi + 2 * ref) for s in sets)
    else:
        per_chunk = [3 + len(s) for s in sets]
        want = sum(3 * pi + len(s) * ref for s in sets)
        trains = sum(1 for s in sets if 0 in s) if how.get("head") else 0
        trains += len(sets) if how.get("states") else 0
        per_chunk.append(trains)
        want += trains * ref
    assert products == sum(per_chunk), case
    assert flops == want, case


def test_multi_teacher_kl_from_hidden_without_a_gradient_makes_only_the_logits():
    """Under ``torch.no_grad`` (any reduction): each chunk's logits, pi's once: 1 + (its
    teachers) products."""
    sets = [(0,), (0, 1), (0, 1, 2)]
    for reduction in ("none", "sum"):
        fn, options = _teachers_call(sets, reduction=reduction)
        with torch.no_grad(), matmul_flops() as counted:
            fn(chunk_size=CHUNK, **options)
        assert counted["products"] == sum(1 + len(s) for s in sets), reduction
