"""klest.integrations.hf: completions response-aligned, against per-row Python loops and a tiny
Llama run row by row; layouts, temperature, errors; then into klest's losses end to end.

Everything here is deterministic (fixed seeds, exact or float64 comparisons).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

import klest
from klest.integrations.hf import (
    CompletionBatch,
    completion_batch,
    completion_batch_from_model,
    generated_attention_mask,
    group_ids,
    group_ids_from_prompts,
)
from klest.testbeds import make_generator, tiny_causal_lm
from tests._reference import assert_verbose_close
from tests._tolerance import assert_close_to_rounding, logit_scale

transformers = pytest.importorskip("transformers")

V = 64
PAD = 0
MAX_LEN = 16  # the longest unpadded sequence of these tests


# -- the slow reference -------------------------------------------------------------------------


def reference_completions(logits, input_ids, attention_mask, prompt_lengths, temperature=1.0):
    """Row by row in Python: where the completion starts (column P, or the attended token after
    the row's n prompt tokens), its span to the last attended column, and for each of its
    columns c the token input_ids[b, c] and log_softmax(logits[c - 1] / tau) at it (float64).

    Returns ``(mask, tokens, log_probs, logits)`` lists per row, each of the row's span."""
    b_size, width = input_ids.shape
    offset = width - logits.shape[1]
    rows = []
    for b in range(b_size):
        attended = [c for c in range(width) if bool(attention_mask[b, c])]
        if isinstance(prompt_lengths, int):
            start = prompt_lengths
        else:
            n = int(prompt_lengths[b])
            start = attended[n] if n < len(attended) else width
        span = [c for c in attended if c >= start]
        cols = range(start, span[-1] + 1) if span else range(0)
        mask, tokens, logps, zs = [], [], [], []
        for c in cols:
            z = logits[b, c - 1 - offset].detach()
            tok = int(input_ids[b, c])
            mask.append(bool(attention_mask[b, c]))
            tokens.append(tok if mask[-1] else -100)
            logps.append(float(torch.log_softmax(z.double() / temperature, -1)[tok]))
            zs.append(z)
        rows.append((mask, tokens, logps, zs))
    return rows


def assert_matches_reference(batch: CompletionBatch, rows, *, atol: float) -> None:
    t = max((len(r[0]) for r in rows), default=0)
    assert batch.mask.shape == batch.tokens.shape == batch.log_probs.shape == (len(rows), t)
    assert batch.logits.shape[:2] == (len(rows), t)
    for b, (mask, tokens, logps, zs) in enumerate(rows):
        pad = t - len(mask)
        assert batch.mask[b].tolist() == mask + [False] * pad, b
        assert batch.tokens[b].tolist() == tokens + [-100] * pad, b
        want = [lp if m else 0.0 for lp, m in zip(logps, mask, strict=True)] + [0.0] * pad
        want = torch.tensor(want, dtype=torch.float64)
        assert_verbose_close(batch.log_probs[b], want, atol=atol, what=f"row {b}")
        for i, (z, m) in enumerate(zip(zs, mask, strict=True)):
            if m:
                assert torch.equal(batch.logits[b, i], z), (b, i)


# -- layouts of the same sequences --------------------------------------------------------------


def random_sequences(seed: int, b: int = 6):
    """Prompts of 1-4 tokens and completions of 0-5 (some rows empty), ids in [1, V)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, V) for _ in range(rng.randint(1, 4))] for _ in range(b)]
    completions = [[rng.randrange(1, V) for _ in range(rng.choice([0, 1, 3, 5]))] for _ in range(b)]
    return prompts, completions


def layout(prompts, completions, kind: str, *, extra: int = 0):
    """``(input_ids, attention_mask, prompt_lengths, index)`` of one layout. ``index[b, c]`` is
    the position of column c in row b's unpadded sequence (-1 at padding).

    - ``"left"``: generate's output, prompts left-padded to the longest (int P), completions
      right-padded;
    - ``"right"``: each row ``prompt | completion | pads`` (tensor prompt lengths);
    - ``"both"``: ``extra`` pads on the left of every row, then as ``"right"``.
    """
    rows, masks, index = [], [], []
    p_width = max(len(p) for p in prompts)
    c_width = max(len(c) for c in completions)
    total = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    for p, c in zip(prompts, completions, strict=True):
        seq = p + c
        if kind == "left":
            lead, tail = p_width - len(p), c_width - len(c)
        else:
            lead, tail = extra if kind == "both" else 0, total - len(seq)
        rows.append([PAD] * lead + seq + [PAD] * tail)
        masks.append([0] * lead + [1] * len(seq) + [0] * tail)
        index.append([-1] * lead + list(range(len(seq))) + [-1] * tail)
    n = p_width if kind == "left" else torch.tensor([len(p) for p in prompts])
    return torch.tensor(rows), torch.tensor(masks), n, torch.tensor(index)


def fake_logits(index: torch.Tensor, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Logits that depend only on (row, position in the unpadded sequence): the same numbers
    in every layout. NaN at padding, which must never be read."""
    table = torch.randn(index.shape[0], MAX_LEN, V, generator=make_generator(seed))
    rows = torch.arange(index.shape[0]).unsqueeze(1)
    z = table[rows, index.clamp(min=0)].to(dtype)
    return torch.where((index >= 0).unsqueeze(-1), z, float("nan"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["left", "right", "both"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_completions_match_the_per_row_loop(seed, kind, temperature):
    prompts, completions = random_sequences(seed)
    ids, mask, n, index = layout(prompts, completions, kind, extra=2)
    logits = fake_logits(index, seed)
    batch = completion_batch(
        logits, ids, attention_mask=mask, prompt_lengths=n, temperature=temperature
    )
    rows = reference_completions(logits, ids, mask, n, temperature)
    assert_matches_reference(batch, rows, atol=1e-12)
    # The tensor form of generate's layout: attended prompt tokens per row.
    if kind == "left":
        counts = torch.tensor([len(p) for p in prompts])
        again = completion_batch(
            logits, ids, attention_mask=mask, prompt_lengths=counts, temperature=temperature
        )
        for got, want in zip(again, batch, strict=True):
            assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("seed", [0, 3])
def test_left_and_right_padding_give_identical_outputs(seed):
    prompts, completions = random_sequences(seed)
    out = {}
    for kind in ("left", "right", "both"):
        ids, mask, n, index = layout(prompts, completions, kind, extra=3)
        logits = fake_logits(index, seed).requires_grad_(True)
        batch = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=n)
        (grad,) = torch.autograd.grad(batch.log_probs.sum(), logits)
        # The gradient, by (row, sequence position): layout-free.
        by_position = torch.zeros(len(prompts), MAX_LEN, V, dtype=torch.float64)
        keep = index >= 0
        by_position[torch.nonzero(keep)[:, 0], index[keep]] = grad[keep]
        out[kind] = (batch, by_position)
    for kind in ("right", "both"):
        for got, want in zip(out[kind][0], out["left"][0], strict=True):
            m = out["left"][0].mask
            if got.dim() == 3:
                got, want = got[m], want[m]
            assert torch.equal(got, want), kind
        assert torch.equal(out[kind][1], out["left"][1]), kind


def test_generate_layout_gives_a_view_of_the_logits():
    prompts, completions = random_sequences(4)
    ids, mask, n, index = layout(prompts, completions, "left")
    logits = fake_logits(index, 4)
    batch = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=n)
    assert batch.logits._base is logits  # a view: no [B, T, V] copy
    ids, mask, n, index = layout(prompts, completions, "right")
    batch = completion_batch(fake_logits(index, 4), ids, attention_mask=mask, prompt_lengths=n)
    assert batch.logits._base is None  # rows start at different columns: gathered


def test_holes_in_a_completion_are_masked_tokens():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 0], [0, 5, 6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0]])
    logits = torch.randn(2, 7, V, generator=make_generator(5), dtype=torch.float64)
    batch = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=torch.tensor([2, 1]))
    assert batch.tokens.tolist() == [[7, -100, 9, 10], [6, -100, 8, -100]]
    rows = reference_completions(logits, ids, mask, torch.tensor([2, 1]))
    assert_matches_reference(batch, rows, atol=1e-12)


def test_empty_completions_and_an_empty_batch():
    ids = torch.tensor([[3, 4, 0, 0], [3, 4, 5, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    logits = torch.randn(2, 4, V, generator=make_generator(6), dtype=torch.float64)
    logits.requires_grad_(True)
    batch = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=torch.tensor([2, 2]))
    assert batch.mask.tolist() == [[False], [True]]
    none = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=torch.tensor([2, 3]))
    assert none.log_probs.shape == (2, 0) and none.logits.shape == (2, 0, V)
    assert none.tokens.shape == (2, 0) and none.mask.shape == (2, 0)
    generate_style = completion_batch(logits[:, :2], ids[:, :2], attention_mask=mask[:, :2],
                                      prompt_lengths=2)  # fmt: skip
    assert generate_style.log_probs.shape == (2, 0)
    loss = klest.kl_penalty(none.log_probs, none.log_probs.detach(), mask=none.mask)
    loss.backward()  # T = 0: a loss of 0 with a zero gradient
    assert float(loss.detach()) == 0.0 and float(logits.grad.abs().max()) == 0.0
    zero_rows = completion_batch(
        logits[:0], ids[:0], attention_mask=mask[:0], prompt_lengths=torch.tensor([], dtype=int)
    )
    assert zero_rows.log_probs.shape == (0, 0)


def test_kept_logits_of_the_last_columns_only():
    prompts, completions = random_sequences(7)
    ids, mask, n, index = layout(prompts, completions, "right")
    logits = fake_logits(index, 7)
    full = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=n)
    first = min(len(p) for p, c in zip(prompts, completions, strict=True) if c)
    keep = ids.shape[1] - first + 1
    part = completion_batch(logits[:, -keep:], ids, attention_mask=mask, prompt_lengths=n)
    for got, want in zip(part, full, strict=True):
        m = full.mask
        assert torch.equal(got[m] if got.dim() == 3 else got, want[m] if want.dim() == 3 else want)
    with pytest.raises(ValueError, match=f"keep at least {keep} positions"):
        completion_batch(logits[:, 1 - keep :], ids, attention_mask=mask, prompt_lengths=n)


def test_bad_input():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    logits = torch.randn(2, 4, V)

    def call(**kw):
        args = {"logits": logits, "input_ids": ids, "attention_mask": mask, "prompt_lengths": 2}
        args.update(kw)
        return completion_batch(args.pop("logits"), args.pop("input_ids"), **args)

    call()
    for bad, err, match in [
        ({"prompt_lengths": 0}, ValueError, r"prompt_lengths=0 must be in \[1, L\]"),
        ({"prompt_lengths": 5}, ValueError, r"prompt_lengths=5 must be in \[1, L\]"),
        ({"prompt_lengths": 2.0}, TypeError, "prompt_lengths must be an int"),
        ({"prompt_lengths": torch.tensor([2.0, 2.0])}, TypeError, "prompt_lengths must hold int"),
        ({"prompt_lengths": torch.tensor([2, 2, 2])}, ValueError, r"prompt_lengths has shape"),
        ({"prompt_lengths": torch.tensor([2, 4])}, ValueError, "row 1 has prompt_lengths 4 and 3"),
        ({"prompt_lengths": torch.tensor([0, 1])}, ValueError, "row 0 has prompt_lengths 0"),
        ({"attention_mask": mask[:, :3]}, ValueError, r"attention_mask has shape \(2, 3\)"),
        ({"attention_mask": mask * 2}, ValueError, "attention_mask must hold only 0 and 1"),
        ({"logits": logits[:1]}, ValueError, r"logits has shape \(1, 4, 64\)"),
        ({"logits": logits.long()}, TypeError, "logits must have a floating-point dtype"),
        ({"input_ids": ids.float()}, TypeError, "input_ids must hold integer ids"),
        ({"input_ids": ids[0]}, ValueError, r"input_ids must be \[B, L\]"),
        ({"input_ids": ids + V}, ValueError, r"outside \[0, 64\)"),
        ({"temperature": -1.0}, ValueError, "temperature must be finite and > 0"),
        ({"logits": torch.randn(2, 4, V).index_fill(1, torch.tensor([2]), float("nan"))},
         ValueError, "logits has no distribution"),
    ]:  # fmt: skip
        with pytest.raises(err, match=match):
            call(**bad)
    # NaN logits where no completion token reads them (the last column, padding) are fine.
    call(logits=logits.index_fill(1, torch.tensor([3]), float("nan")))


# -- group ids ----------------------------------------------------------------------------------


def test_group_ids_of_consecutive_samples():
    assert group_ids(6, num_generations=2).tolist() == [0, 0, 1, 1, 2, 2]
    assert group_ids(5, num_generations=4, offset=3).tolist() == [0, 1, 1, 1, 1]
    assert group_ids(0, num_generations=3).tolist() == []
    for kw, match in [
        ({"num_generations": 0}, "num_generations must be a positive int"),
        ({"num_generations": 2, "offset": -1}, "offset must be an int >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            group_ids(4, **kw)
    with pytest.raises(ValueError, match="batch_size must be an int >= 0"):
        group_ids(-1, num_generations=2)


def reference_group_ids(prompts: list[list[int]]) -> list[int]:
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(tuple(p), len(seen)) for p in prompts]


@pytest.mark.parametrize("kind", ["left", "right", "both"])
def test_group_ids_from_prompts_match_a_dictionary(kind):
    rng = random.Random(8)
    distinct = [[rng.randrange(1, 5) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    prompts = [distinct[rng.randrange(4)] for _ in range(12)]
    ids, mask, _, _ = layout(prompts, [[] for _ in prompts], kind, extra=1)
    got = group_ids_from_prompts(ids, prompt_mask=mask)
    assert got.tolist() == reference_group_ids(prompts)
    # Padding is ignored: [5] and [5, 0] with its 0 masked are one prompt; unmasked, not.
    two = torch.tensor([[5, 0], [5, 0]])
    assert group_ids_from_prompts(two, prompt_mask=torch.tensor([[1, 0], [1, 1]])).tolist() == [
        0,
        1,
    ]
    assert group_ids_from_prompts(two).tolist() == [0, 0]


def test_group_ids_from_prompts_edge_cases_and_errors():
    assert group_ids_from_prompts(torch.zeros(0, 3, dtype=torch.long)).tolist() == []
    assert group_ids_from_prompts(torch.zeros(3, 0, dtype=torch.long)).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"prompt_ids must be \[B, P\]"):
        group_ids_from_prompts(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="prompt_ids must hold integer ids"):
        group_ids_from_prompts(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"prompt_mask has shape \(2, 1\)"):
        group_ids_from_prompts(torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 1))


# -- a tiny Llama -------------------------------------------------------------------------------


def tiny_llama(seed: int):
    model = tiny_causal_lm(
        vocab_size=V, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, seed=seed
    )
    return model.double().eval()


@pytest.fixture(scope="module")
def models():
    return tiny_llama(0), tiny_llama(1)


@pytest.fixture(scope="module")
def generated(models):
    """Left-padded prompts (generate's layout), sampled at temperature 0.7 with generate's own
    logits and processed scores; G = 2 samples per prompt."""
    policy, _ = models
    prompts = [[1, 5, 6], [1, 9], [1, 7, 7, 8]]
    p_width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (p_width - len(p)) + p for p in prompts for _ in range(2)])
    mask = (ids != PAD).long()
    torch.manual_seed(3)
    out = policy.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
        pad_token_id=PAD,
        eos_token_id=2,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )
    # Completions of different lengths (as if they had ended: a random tiny model rarely
    # samples eos), padded after their end; one empty. Earlier tokens' log-probs do not depend
    # on later ones, so generate's logits still apply.
    lengths = torch.tensor([6, 3, 0, 5, 1, 6])
    kept = torch.arange(6) < lengths.unsqueeze(1)
    completion = torch.where(kept, out.sequences[:, p_width:], PAD)
    seqs = torch.cat([ids, completion], 1)
    attention = torch.cat([mask, kept.long()], 1)
    return seqs, attention, p_width, out


def test_model_log_probs_equal_each_row_run_alone(models, generated):
    policy, _ = models
    seqs, attention, p_width, _ = generated
    with torch.no_grad():
        batch = completion_batch_from_model(
            policy, seqs, attention_mask=attention, prompt_lengths=p_width, temperature=0.7
        )
    assert 0 < int(batch.mask.sum()) < batch.mask.numel()  # some completions ended early
    n_prompt = attention[:, :p_width].sum(1)
    for b in range(seqs.shape[0]):
        row = seqs[b][attention[b].bool()]
        with torch.no_grad():
            z = policy(row.unsqueeze(0)).logits[0]
        n, c = int(n_prompt[b]), len(row) - int(n_prompt[b])
        want = torch.log_softmax(z[n - 1 : n - 1 + c] / 0.7, -1).gather(-1, row[n:, None])[:, 0]
        assert_verbose_close(batch.log_probs[b, :c], want, atol=1e-12, what=f"row {b}")
        assert not bool(batch.mask[b, c:].any())


def test_model_logits_are_what_generate_sampled_from(models, generated):
    """generate's raw logits at each step and its processed scores (logits / 0.7, no top-k or
    top-p) give the same distributions as the helper's logits and log-probs (to float32
    rounding: generate returns its logits in float32)."""
    policy, _ = models
    seqs, attention, p_width, out = generated
    with torch.no_grad():
        batch = completion_batch_from_model(
            policy, seqs, attention_mask=attention, prompt_lengths=p_width, temperature=0.7
        )
    for t in range(batch.mask.shape[1]):
        m = batch.mask[:, t]
        # generate's logits: the float64 ones rounded to nearest float32, at most half an ulp
        # (2^-24 relative) of each entry
        what = f"step {t}"
        logits = out.logits[t][m]
        assert_close_to_rounding(
            batch.logits[m, t], logits, ulps=0.5, scale=logits.abs(), what=what
        )
        want = torch.log_softmax(out.scores[t][m], -1).gather(-1, batch.tokens[m, t, None])[:, 0]
        # generate's log-softmax in float32: a few roundings at the row's logit scale
        scale = logit_scale(out.scores[t][m])
        assert_close_to_rounding(batch.log_probs[m, t], want, ulps=4, scale=scale, what=what)


def test_model_right_padding_equals_left_padding(models, generated):
    policy, _ = models
    seqs, attention, p_width, _ = generated
    with torch.no_grad():
        left = completion_batch_from_model(
            policy, seqs, attention_mask=attention, prompt_lengths=p_width
        )
    # The same rows, right-padded: attended tokens first.
    order = torch.argsort((attention == 0).to(torch.uint8), dim=1, stable=True)
    right_ids = torch.where(attention.gather(1, order).bool(), seqs.gather(1, order), PAD)
    right_mask = attention.gather(1, order)
    n_prompt = attention[:, :p_width].sum(1)
    with torch.no_grad():
        right = completion_batch_from_model(
            policy, right_ids, attention_mask=right_mask, prompt_lengths=n_prompt
        )
    assert torch.equal(right.mask, left.mask) and torch.equal(right.tokens, left.tokens)
    assert_verbose_close(right.log_probs, left.log_probs, atol=1e-12)
    assert_verbose_close(right.logits[right.mask], left.logits[left.mask], atol=1e-10)


def test_model_computes_only_the_logits_it_needs(models, generated):
    policy, _ = models
    seqs, attention, p_width, _ = generated
    seen = []
    handle = policy.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    try:
        with torch.no_grad():
            completion_batch_from_model(
                policy, seqs, attention_mask=attention, prompt_lengths=p_width
            )
    finally:
        handle.remove()
    assert seen == [seqs.shape[1] - p_width + 1]


def test_end_to_end_into_kl_penalty_and_kl_from_logits(models, generated):
    """The helper's tensors in klest's losses give the losses and gradients of the same losses
    on per-row log-probs computed by running each row alone."""
    policy, ref = models
    seqs, attention, p_width, _ = generated
    policy.zero_grad()
    batch = completion_batch_from_model(
        policy, seqs, attention_mask=attention, prompt_lengths=p_width
    )
    with torch.no_grad():
        ref_batch = completion_batch_from_model(
            ref, seqs, attention_mask=attention, prompt_lengths=p_width
        )
    group = group_ids(seqs.shape[0], num_generations=2)
    assert torch.equal(
        group, group_ids_from_prompts(seqs[:, :p_width], prompt_mask=attention[:, :p_width])
    )

    def losses(logp, logp_ref, logits, logits_ref, mask):
        penalty = klest.kl_penalty(
            logp, logp_ref, mask=mask, estimator="k3", grad="cumulative", baseline="loo",
            group=group,
        )  # fmt: skip
        exact = klest.kl_from_logits(logits, logits_ref, mask=mask)
        return penalty, exact

    penalty, exact = losses(
        batch.log_probs, ref_batch.log_probs, batch.logits, ref_batch.logits, batch.mask
    )
    (penalty + exact).backward()
    got = [p.grad.clone() for p in policy.parameters()]

    # The reference: each row alone, its completion's logits and log-probs padded by hand.
    policy.zero_grad()
    n_prompt = attention[:, :p_width].sum(1)
    t = batch.mask.shape[1]
    cols = []
    for model in (policy, ref):
        zs, lps = [], []
        for b in range(seqs.shape[0]):
            row = seqs[b][attention[b].bool()]
            n = int(n_prompt[b])
            with torch.set_grad_enabled(model is policy):
                z = model(row.unsqueeze(0)).logits[0, n - 1 : len(row) - 1]
            lp = torch.log_softmax(z, -1).gather(-1, row[n:, None])[:, 0]
            pad = t - z.shape[0]
            zs.append(torch.cat([z, torch.zeros(pad, V, dtype=z.dtype)]))
            lps.append(torch.cat([lp, torch.zeros(pad, dtype=lp.dtype)]))
        cols.append((torch.stack(lps), torch.stack(zs)))
    (lp, z), (lp_ref, z_ref) = cols
    mask = torch.arange(t) < (attention.sum(1) - n_prompt).unsqueeze(1)
    assert torch.equal(mask, batch.mask)
    want_penalty, want_exact = losses(lp, lp_ref.detach(), z, z_ref.detach(), mask)
    assert_verbose_close(penalty, want_penalty, atol=1e-12)
    assert_verbose_close(exact, want_exact, atol=1e-12)
    (want_penalty + want_exact).backward()
    for g, p in zip(got, policy.parameters(), strict=True):
        assert_verbose_close(g, p.grad, atol=1e-10)
    assert max(float(g.abs().max()) for g in got) > 0

    # kl_from_logits with labels=batch.tokens gives the helper's log-probs back.
    _, details = klest.kl_from_logits(
        batch.logits.detach(), ref_batch.logits, labels=batch.tokens, reduction="none",
        return_details=True,
    )  # fmt: skip
    assert_verbose_close(details.logp, batch.log_probs.detach(), atol=1e-12)
    assert_verbose_close(details.logp_ref, ref_batch.log_probs, atol=1e-12)


def test_model_convenience_needs_transformers(monkeypatch, models):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"klest\[hf\]"):
        completion_batch_from_model(
            models[0], torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3),
            prompt_lengths=1,
        )  # fmt: skip


def test_absolute_position_embeddings_get_generate_positions():
    """GPT-2's learned position embeddings: a left-padded row scores its tokens at the positions
    generate gave them (counted from the first attended token), as when the row runs alone."""
    torch.manual_seed(4)
    config = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [4, 5, 6, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        batch = completion_batch_from_model(model, ids, attention_mask=mask, prompt_lengths=3)
        alone = model(ids[:1, 2:]).logits[0, :-1]  # the row without its padding
    want = torch.log_softmax(alone, -1).gather(-1, ids[0, 3:, None])[:, 0]
    assert_verbose_close(batch.log_probs[0], want, atol=1e-12)


@pytest.mark.parametrize("kind", ["left", "right", "both"])
def test_one_token_completions_match_the_per_row_loop(kind):
    """Every completion one token long (T = 1), after prompts of 1-3 tokens: the columns are
    each row's own, in every layout."""
    prompts, completions = [[3, 4, 5], [6, 7], [8]], [[9], [10], [11]]
    ids, mask, n, index = layout(prompts, completions, kind, extra=2)
    logits = fake_logits(index, 7)
    batch = completion_batch(logits, ids, attention_mask=mask, prompt_lengths=n)
    assert_matches_reference(batch, reference_completions(logits, ids, mask, n), atol=1e-12)


@pytest.mark.parametrize(("pad", "eos"), [(0, 0), (0, 2)], ids=["pad-is-eos", "pad-sampled"])
def test_generated_attention_mask_scores_every_token_generate_sampled(pad, eos):
    """Real generate output, finished rows padded: with the helper's mask the completions are
    exactly the tokens generate sampled, up to and including each row's first eos (a per-row
    Python loop), and their log-probs are generate's own (its processed scores, float32). The
    two settings where ``sequences != pad`` is wrong: pad = eos (GPT-2's tokenizers; the eos
    would be dropped) and pad sampled inside a completion (a hole that changes the context of
    the later tokens). Five tokens make both happen in these fixed-seed samples."""
    model = tiny_causal_lm(
        vocab_size=5, pad_token_id=pad, bos_token_id=1, eos_token_id=eos, seed=2
    ).eval()
    prompts = [[1, 3], [1, 4, 3, 4]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=prompt_mask, do_sample=True, top_k=0, top_p=1.0,
            num_return_sequences=4, max_new_tokens=6, pad_token_id=pad, eos_token_id=eos,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    seqs = out.sequences
    attention = generated_attention_mask(seqs, prompt_mask=prompt_mask, eos_token_id=eos)
    with torch.no_grad():
        batch = completion_batch_from_model(
            model, seqs, attention_mask=attention, prompt_lengths=width
        )
    lengths = []
    for row in seqs[:, width:].tolist():
        ended = [t for t, tok in enumerate(row) if tok == eos]
        lengths.append(ended[0] + 1 if ended else len(row))
    assert min(lengths) < seqs.shape[1] - width  # some row ended with its eos
    if pad != eos:  # some completion sampled the pad token before its end
        rows = zip(seqs[:, width:].tolist(), lengths, strict=True)
        assert any(pad in row[: n - 1] for row, n in rows)
    want_mask = torch.arange(batch.mask.shape[1]) < torch.tensor(lengths)[:, None]
    assert torch.equal(batch.mask, want_mask)
    assert torch.equal(attention[:, :width], prompt_mask.repeat_interleave(4, 0))
    for t in range(batch.mask.shape[1]):
        m = batch.mask[:, t]
        want = torch.log_softmax(out.scores[t][m], -1).gather(-1, batch.tokens[m, t, None])[:, 0]
        # two float32 forward passes (generate's cached one, the helper's whole-sequence one):
        # the logits round at their scale in sums over the model's width, then the log-softmax
        scale = logit_scale(out.scores[t][m])
        what = f"step {t}"
        assert_close_to_rounding(batch.log_probs[m, t], want, ulps=16, scale=scale, what=what)


def test_generated_attention_mask_bad_input():
    seqs = torch.tensor([[0, 5, 6, 1], [7, 8, 0, 6]])
    mask = torch.ones(2, 2)
    f = generated_attention_mask
    with pytest.raises(ValueError, match="prompt_mask must be"):
        f(seqs, prompt_mask=torch.ones(3, 2), eos_token_id=0)
    with pytest.raises(ValueError, match="prompt_mask must be"):
        f(seqs, prompt_mask=torch.ones(2, 5), eos_token_id=0)
    with pytest.raises(ValueError, match="prompt_mask must hold only 0 and 1"):
        f(seqs, prompt_mask=mask * 2, eos_token_id=0)
    with pytest.raises(TypeError, match="eos_token_id"):
        f(seqs, prompt_mask=mask, eos_token_id=0.5)
    with pytest.raises(ValueError, match="eos_token_id"):
        f(seqs, prompt_mask=mask, eos_token_id=[])
    with pytest.raises(TypeError, match="sequences"):
        f(seqs.float(), prompt_mask=mask, eos_token_id=0)
