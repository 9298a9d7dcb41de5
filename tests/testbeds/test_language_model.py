"""LanguageModelTestbed against slow references: a recursion over prefixes that runs the models
on each prefix, finite differences, Monte Carlo means and sampling frequencies."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from klest.testbeds import (
    LanguageModelTestbed,
    TabularAutoregressive,
    make_generator,
    tiny_causal_lm,
)
from tests._stats import RATE, assert_mean_close, z_for

pytest.importorskip("transformers")

DIRECTIONS = ("pi||ref", "ref||pi")
V, H, EOS = 3, 3, 1


@pytest.fixture(scope="module")
def tb() -> LanguageModelTestbed:
    return LanguageModelTestbed.tiny(vocab_size=V, horizon=H, eos=EOS, scale=8.0, seed=3)


def next_log_probs(model, prompt: list[int], prefix: tuple[int, ...]) -> torch.Tensor:
    """The model's next-token log-probs after ``prompt + prefix``: one forward, one row."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
    return torch.log_softmax(out.double(), -1)


def slow_kl(tb, direction: str, *, token_local: bool = False, prefix=()) -> float:
    """The sequence KL (or, ``token_local``, the sum over prefixes drawn from pi of the next-token
    KLs) by recursion over prefixes, in Python floats."""
    if len(prefix) == tb.horizon:
        return 0.0
    prompt = tb.prompt.tolist()
    lp = next_log_probs(tb.policy, prompt, prefix)
    lr = next_log_probs(tb.reference, prompt, prefix)
    la, lb = (lp, lr) if direction == "pi||ref" else (lr, lp)
    walk = lp if token_local else la  # whose probabilities weigh the longer prefixes
    total = sum(math.exp(float(la[v])) * float(la[v] - lb[v]) for v in range(tb.vocab_size))
    for v in range(tb.vocab_size):
        if v != tb.eos:
            rest = slow_kl(tb, direction, token_local=token_local, prefix=(*prefix, v))
            total += math.exp(float(walk[v])) * rest
    return total


def test_is_a_tabular_policy(tb):
    assert isinstance(tb, TabularAutoregressive)
    assert tb.logits.shape == (sum(V**t for t in range(H)), V)
    assert not tb.policy.training and not tb.reference.training


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_exact_kl_matches_slow_recursion(tb, direction):
    expected = slow_kl(tb, direction)
    assert expected > 0.05  # the two models differ
    assert float(tb.exact_kl(direction).detach()) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_token_local_kl_matches_slow_recursion(tb, direction):
    expected = slow_kl(tb, direction, token_local=True)
    assert float(tb.token_local_kl(direction).detach()) == pytest.approx(expected, rel=1e-10)


def test_sequence_probabilities_sum_to_one_and_are_products_of_model_outputs(tb):
    tokens, log_pi, log_ref = tb.sequence_log_probs()
    log_pi = log_pi.detach()
    assert float(log_pi.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(log_ref.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    prompt = tb.prompt.tolist()
    for seq, lp, lr in zip(tokens.tolist(), log_pi, log_ref, strict=True):
        end = seq.index(EOS) + 1 if EOS in seq else H
        want_p = sum(float(next_log_probs(tb.policy, prompt, seq[:t])[seq[t]]) for t in range(end))
        want_r = sum(
            float(next_log_probs(tb.reference, prompt, seq[:t])[seq[t]]) for t in range(end)
        )
        assert float(lp) == pytest.approx(want_p, abs=1e-12)
        assert float(lr) == pytest.approx(want_r, abs=1e-12)


def test_evaluate_runs_the_models_on_the_samples(tb):
    s = tb.sample(64, generator=make_generator(1))
    assert s.x.shape == (64, H) and s.mask.shape == (64, H)
    assert s.logits.shape == (64, H, V) and s.logp.requires_grad
    first_eos = torch.where(s.x == EOS, torch.arange(H), H).min(-1).values
    assert torch.equal(s.mask, torch.arange(H) <= first_eos.unsqueeze(-1))
    prompt = tb.prompt.tolist()
    for row in range(0, 64, 7):
        for t in range(H):
            prefix = tuple(s.x[row, :t].tolist())
            want = next_log_probs(tb.policy, prompt, prefix)
            want_ref = next_log_probs(tb.reference, prompt, prefix)
            assert torch.allclose(s.logits[row, t].detach(), want, atol=1e-12)
            assert torch.allclose(s.logits_ref[row, t], want_ref, atol=1e-12)
            assert float(s.logp[row, t].detach()) == pytest.approx(
                float(want[s.x[row, t]]), abs=1e-12
            )


def test_sampling_frequencies_match_exact_probabilities(tb):
    """Pearson's chi-square over every completion (15 cells, the smallest expected count above
    100): the p-value must be above RATE, the false-fail rate of one test."""
    tokens, log_pi, _ = tb.sequence_log_probs()
    probs = log_pi.detach().exp()
    n = 40_000
    assert float(probs.min()) * n > 100
    x = tb.draw(n, generator=make_generator(2))
    counts = torch.stack([(x == seq).all(-1).sum() for seq in tokens]).double()
    assert int(counts.sum()) == n  # every draw is one of the enumerated completions
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    dof = len(tokens) - 1
    p_value = float(mpmath.gammainc(dof / 2, chi2 / 2, mpmath.inf, regularized=True))
    assert p_value > RATE, f"chi2 = {chi2:.1f} on {dof} dof, p = {p_value:.2g}"


def test_exact_kls_are_monte_carlo_means(tb):
    """KL(pi||ref) = E_pi[log pi(y) - log ref(y)], KL(ref||pi) = E_pi[R log R] with
    R = ref(y)/pi(y): two comparisons at family rate RATE."""
    z = z_for(RATE, 2)
    with torch.no_grad():
        s = tb.sample(20_000, generator=make_generator(3))
        delta = ((s.logp - s.logp_ref) * s.mask).sum(-1)
    assert_mean_close(delta, float(tb.exact_kl("pi||ref").detach()), z=z, what="KL(pi||ref)")
    ratio = torch.exp(-delta)
    assert_mean_close(
        ratio * -delta, float(tb.exact_kl("ref||pi").detach()), z=z, what="KL(ref||pi)"
    )


def gpt2_pair(vocab_size: int, *, seed: int, dropout: float = 0.1):
    """Two small GPT-2 models in float64 (GPT-2 computes in its own dtype throughout, where
    Llama's norms and rotary embeddings round through float32: finite differences need that)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        initializer_range=0.5,
    )
    torch.manual_seed(seed)
    policy, reference = transformers.GPT2LMHeadModel(config), transformers.GPT2LMHeadModel(config)
    return policy.double(), reference.double()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_exact_gradient_matches_finite_differences(direction):
    policy, reference = gpt2_pair(V, seed=4)
    tb = LanguageModelTestbed(policy, reference, prompt=[0], horizon=H, eos=EOS)
    assert float(tb.exact_kl(direction).detach()) > 0.05
    grads = tb.exact_kl_grad(direction)
    gen = make_generator(5)
    eps = 1e-6
    for i, p in list(enumerate(tb.parameters()))[::3]:
        for _ in range(2):
            j = int(torch.randint(p.numel(), (1,), generator=gen))
            flat = p.data.view(-1)
            old = float(flat[j])
            with torch.no_grad():
                flat[j] = old + eps
                up = float(tb.exact_kl(direction))
                flat[j] = old - eps
                down = float(tb.exact_kl(direction))
                flat[j] = old
            fd = (up - down) / (2 * eps)
            assert float(grads[i].view(-1)[j]) == pytest.approx(fd, rel=1e-5, abs=1e-8), (i, j)
    # Restored parameters: the cached answers are the first ones again.
    again = tb.exact_kl_grad(direction)
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


def test_cached_tables_follow_parameter_updates():
    tb = LanguageModelTestbed.tiny(vocab_size=V, horizon=H, eos=EOS, scale=8.0, seed=6)
    with torch.no_grad():
        before = float(tb.exact_kl())
    grad_before = tb.exact_kl_grad()
    opt = torch.optim.SGD(tb.parameters(), lr=0.5)
    opt.zero_grad()
    tb.exact_kl().backward()
    opt.step()  # in place: the next no-grad value must see it
    with torch.no_grad():
        after = float(tb.exact_kl())
    assert after < before
    assert after == pytest.approx(float(tb.exact_kl().detach()), rel=1e-12)
    assert not torch.equal(grad_before[0], tb.exact_kl_grad()[0])


def test_any_causal_lm_with_dropout_is_made_deterministic():
    policy, reference = gpt2_pair(4, seed=0)
    tb = LanguageModelTestbed(policy, reference, prompt=[0, 2], horizon=2, eos=3)
    assert not policy.training
    s = tb.sample(4, generator=make_generator(0))
    assert torch.equal(s.logp, tb.evaluate(s.x).logp)
    assert float(tb.exact_kl().detach()) == pytest.approx(slow_kl(tb, "pi||ref"), rel=1e-10)


def test_horizon_one_is_the_categorical_kl_after_the_prompt():
    policy, reference = gpt2_pair(4, seed=7)
    tb = LanguageModelTestbed(policy, reference, prompt=[2, 3], horizon=1, eos=0)
    lp = next_log_probs(policy, [2, 3], ())
    lr = next_log_probs(reference, [2, 3], ())
    want = float((lp.exp() * (lp - lr)).sum())
    assert float(tb.exact_kl().detach()) == pytest.approx(want, rel=1e-12)
    assert tb.sample(5, generator=make_generator(0)).logp.shape == (5, 1)


def test_bad_input_is_named():
    a = tiny_causal_lm(vocab_size=4, hidden_size=8, num_layers=1, num_heads=2)
    b = tiny_causal_lm(vocab_size=5, hidden_size=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="vocabulary of 4 tokens but reference has 5"):
        LanguageModelTestbed(a, b, prompt=[0], horizon=2, eos=1)
    with pytest.raises(ValueError, match="eos must be a token id in"):
        LanguageModelTestbed(a, a, prompt=[0], horizon=2, eos=4)
    with pytest.raises(ValueError, match="eos must be a token id in"):
        LanguageModelTestbed(a, a, prompt=[0], horizon=2, eos=None)
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        LanguageModelTestbed(a, a, prompt=[], horizon=2, eos=1)
    with pytest.raises(ValueError, match="prompt must hold token ids"):
        LanguageModelTestbed(a, a, prompt=[7], horizon=2, eos=1)
    with pytest.raises(ValueError, match="too many to enumerate"):
        LanguageModelTestbed(a, a, prompt=[0], horizon=20, eos=1)
    with pytest.raises(ValueError, match="horizon"):
        LanguageModelTestbed(a, a, prompt=[0], horizon=0, eos=1)
    with pytest.raises(TypeError, match="causal LM"):
        LanguageModelTestbed(object(), a, prompt=[0], horizon=2, eos=1)
    frozen = tiny_causal_lm(vocab_size=4, hidden_size=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        LanguageModelTestbed(frozen.requires_grad_(False), a, prompt=[0], horizon=2, eos=1)
    tb = LanguageModelTestbed(a, a, prompt=[0], horizon=2, eos=1)
    with pytest.raises(ValueError, match=r"tokens must be \[n, horizon=2\]"):
        tb.evaluate(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"use LanguageModelTestbed\.tiny"):
        LanguageModelTestbed.random(4, 2)
