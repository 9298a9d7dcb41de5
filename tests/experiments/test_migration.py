"""The migration table: each framework's KL option against its klest call, and the measurements.

1. Every option in ``klest.integrations.migration.OPTIONS`` is written out here by hand, from the
   framework's documented math (TRL 1.16, verl 0.9.1, OpenRLHF 0.11.2, NeMo-RL, slime, the Tinker
   cookbook; the formulas are re-derived, not copied), and its klest call must give the same
   value and the same gradient, in float64, on a batch with right padding and groups.
2. The call text printed in the table runs and is the call measured.
3. ``klest run migration --quick`` (600 gradient batches, about 25 CPU-seconds) gives the
   theoretical verdicts for the key rows, at thresholds from ``tests/_stats.py`` (the
   statistics are N(0, 1), tail included, under the hypotheses they test).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import klest
from klest.cli import main
from klest.experiments.migration import batch_of
from klest.integrations.migration import IW_OPD_WEIGHTS, OPTIONS, Batch, KLCall, WeightRule
from tests._figures import figures_checked
from tests._stats import RATE, z_for

ROOT = Path(__file__).resolve().parents[2]
B, T, V = 6, 5, 7
GROUP = torch.tensor([0, 0, 0, 1, 1, 1])
LENGTHS = torch.tensor([5, 3, 4, 5, 2, 4])


def make_batch(seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """Logits ``[B, T, V]`` (the leaf), and the batch computed from them: sampled tokens,
    their log-probs under pi (with graph) and ref, right padding, two prompts of three."""
    g = torch.Generator().manual_seed(seed)
    logits = (0.7 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    logits_ref = 0.7 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits.detach(), -1).reshape(-1, V)
    tokens = torch.multinomial(probs, 1, generator=g).reshape(B, T, 1)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens)[..., 0]
    logp_ref = torch.log_softmax(logits_ref, -1).gather(-1, tokens)[..., 0]
    mask = torch.arange(T) < LENGTHS[:, None]
    return Batch(logp, logp_ref, mask, GROUP, logits, logits_ref), logits


# -- The frameworks' formulas, by hand ------------------------------------------------------
# Each returns (the KL value the framework computes, aggregated like its loss; the loss whose
# gradient is its KL term's), with the coefficient beta = 1 and on-policy samples: the old /
# sampling log-probs are the current ones, detached.


def aggregate(x, mask, how):
    """The frameworks' aggregations of per-token terms (masked; no empty rows here)."""
    m = mask.to(x.dtype)
    if how == "token-mean":  # TRL dapo/bnpo, verl/OpenRLHF token-mean, NeMo-RL token level
        return (x * m).sum() / m.sum()
    if how == "seq-mean-token-mean":  # TRL grpo, verl/OpenRLHF seq-mean-token-mean
        return ((x * m).sum(-1) / m.sum(-1)).mean()
    if how == "sample-mean-sum":  # slime: the sum over samples of their token means
        return ((x * m).sum(-1) / m.sum(-1)).sum()
    if how == "seq-mean-token-sum":
        return (x * m).sum(-1).mean()
    if how == "sum":  # Tinker's importance_sampling loss
        return (x * m).sum()
    raise ValueError(how)


def k1(lp, lr):
    return lp - lr


def k2(lp, lr):
    return 0.5 * (lp - lr) ** 2


def k3(lp, lr):  # exp(log r) - log r - 1, with log r = log ref - log pi
    log_r = lr - lp
    return torch.exp(log_r) - log_r - 1


def ratio(lp):
    """pi / pi_old on-policy: 1 in value, the score in gradient."""
    return torch.exp(lp - lp.detach())


def straight_through(value, surrogate):
    return value.detach() + surrogate - surrogate.detach()


def exact_kl(logits, logits_ref, direction):
    """The exact KL between the next-token distributions at each position."""
    a, b = torch.log_softmax(logits, -1), torch.log_softmax(logits_ref, -1)
    if direction == "ref||pi":
        a, b = b, a
    return (a.exp() * (a - b)).sum(-1)


def policy_loss(advantage, lp, mask, how):
    """-A * ratio per token (unclipped at ratio 1), aggregated."""
    return aggregate(-advantage * ratio(lp), mask, how)


def returns_to_go(rewards, mask, gamma=1.0):
    """sum_{u >= t} gamma^(u - t) r_u over the valid tokens (right-padded rows)."""
    r = rewards * mask
    if gamma == 1.0:
        return r.flip(-1).cumsum(-1).flip(-1) * mask
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def verl_k3(lp, lr):
    kl = (lr - lp).clamp(-20, 20)
    return (torch.exp(kl) - kl - 1).clamp(-10, 10)


def openrlhf_value(lp, lr, estimator):
    log_ratio = lp - lr
    if estimator == "k3":
        clamped = log_ratio.clamp(min=-10)
        value = torch.exp(-clamped) - 1 + clamped
    else:
        value = log_ratio if estimator == "k1" else log_ratio**2 / 2
    return value.clamp(-10, 10)


def nemo_rl_k3(lp, lr):
    log_r = lr - lp
    clamped = log_r.clamp(-20, 20)
    w = torch.where(log_r == clamped, ratio(lp), ratio(lp).detach())
    return (w * (torch.exp(clamped) - 1 - clamped)).clamp(-10, 10)


def slime_kl(lp, lr, kind, importance_ratio=None):
    log_ratio = lp - lr
    kl = log_ratio if kind == "k1" else torch.exp(-log_ratio) - 1 + log_ratio
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


def group_scores(scores, baseline):
    """Outcome advantages of per-sequence scores within each prompt's group."""
    out = torch.empty_like(scores)
    for g in GROUP.unique():
        rows = g == GROUP
        s, n = scores[rows], int(rows.sum())
        if baseline == "rloo-verl":  # verl: (s * n - sum) / (n - 1)
            out[rows] = s * n / (n - 1) - s.mean() * n / (n - 1)
        elif baseline == "loo":
            out[rows] = s - (s.sum() - s) / (n - 1)
        else:  # the group mean, the sample included (Dr. GRPO)
            out[rows] = s - s.mean()
    return out


def peer(key: str, batch: Batch):
    lp, lr, m = batch.logp, batch.logp_ref, batch.mask
    old = lp.detach()
    if key in ("trl-grpo", "trl-grpo-no-correction"):
        per_token = k3(lp, lr) * (ratio(lp) if key == "trl-grpo" else 1.0)
        loss = aggregate(per_token, m, "token-mean")
        return loss, loss
    if key == "trl-rloo":
        kl = ((old - lr) * m).sum(-1)
        adv = group_scores(-kl, "loo")
        seq_lp = (lp * m).sum(-1)
        loss = (-torch.exp(seq_lp - seq_lp.detach()) * adv).mean()
        return kl.mean(), loss
    if key == "trl-iw-opd":
        # TRL's IWOPDTrainer: a = log teacher - log student (detached), weights from the running
        # share of |a|, loss -log pi * w * a over the valid tokens' mean; the value is the
        # weighted log-ratio, minus TRL's logged iw_opd/mean_advantage.
        a = torch.where(m, lr - old, 0.0)
        before = a.abs().cumsum(-1) - a.abs()
        w = 1.0 + 0.5 * (1.0 - before / a.abs().sum(-1, keepdim=True).clamp_min(1e-8))
        return aggregate(-w * a, m, "token-mean"), aggregate(-lp * w * a, m, "token-mean")
    if key == "power-opd":  # the per-token advantage ((ref/pi)^alpha - 1)/alpha, alpha = 1/2
        reward = (torch.exp(lr - old) ** 0.5 - 1.0) / 0.5
        value = aggregate(k1(old, lr), m, "token-mean")
        return value, policy_loss(reward, lp, m, "token-mean")
    if key.startswith("trl-distill"):
        direction = "ref||pi" if key.endswith("beta0") else "pi||ref"
        loss = aggregate(exact_kl(batch.logits, batch.logits_ref, direction), m, "token-mean")
        return loss, loss
    verl_loss = {
        "verl-low-var-kl": verl_k3(lp, lr),
        "verl-k1": k1(lp, lr),
        "verl-k2": k2(lp, lr),
        "verl-abs": (lp - lr).abs(),
        "verl-k3-plus": straight_through(verl_k3(lp, lr), k2(lp, lr)),
        "verl-k1-plus": straight_through(k1(lp, lr), k2(lp, lr)),
        "openrlhf-k3": openrlhf_value(lp, lr, "k3"),
        "openrlhf-k1": openrlhf_value(lp, lr, "k1"),
        "openrlhf-k2": openrlhf_value(lp, lr, "k2"),
        "openrlhf-unbiased": straight_through(openrlhf_value(lp, lr, "k3"), 1.0 * k2(lp, lr)),
        "nemo-rl": nemo_rl_k3(lp, lr),
    }
    if key in verl_loss:
        loss = aggregate(verl_loss[key], m, "token-mean")
        return loss, loss
    if key.startswith("verl-reward"):
        kld = k1(old, lr) * m
        scores = (-kld).sum(-1)
        adv = group_scores(scores, "rloo-verl" if key.endswith("rloo") else "mean")
        value = aggregate(k1(old, lr), m, "token-mean")
        return value, policy_loss(adv[:, None] * m, lp, m, "token-mean")
    if key == "openrlhf-reward":
        adv = returns_to_go(-k1(old, lr), m)
        value = aggregate(k1(old, lr), m, "token-mean")
        return value, policy_loss(adv, lp, m, "token-mean")
    slime_loss = {
        "slime-k1": slime_kl(lp, lr, "k1"),
        "slime-k3": slime_kl(lp, lr, "low_var_kl"),
        "slime-unbiased": slime_kl(lp, lr, "low_var_kl", torch.exp(lp - old)),
    }
    if key in slime_loss:
        loss = aggregate(slime_loss[key], m, "sample-mean-sum")
        return loss, loss
    if key.startswith("slime-reward"):
        kl = slime_kl(old, lr, "k1")
        adv = returns_to_go(-kl, m) if key == "slime-reward-rpp" else -kl
        value = aggregate(kl, m, "sample-mean-sum")
        return value, aggregate(-torch.exp(lp - old) * adv, m, "sample-mean-sum")
    if key.startswith("tinker"):
        adv = -(old - lr) * m
        if key.endswith("discount1"):
            adv = returns_to_go(adv, m)
        elif key.endswith("discount"):  # kl_discount_factor=0.9
            adv = returns_to_go(adv, m, gamma=0.9)
        value = aggregate(k1(old, lr), m, "sum")
        return value, aggregate(-torch.exp(lp - old) * adv, m, "sum")
    raise KeyError(key)


# slime's loss sums the per-sample means: B times klest's "seq-mean-token-mean".
SCALE = {"slime": B}


@pytest.mark.parametrize("option", OPTIONS, ids=[o.key for o in OPTIONS])
def test_option_equals_the_framework_formula(option):
    batch, logits = make_batch()
    lp, lr = batch.logp.detach(), batch.logp_ref
    assert float((lr - lp).abs().max()) < 10 and float(k3(lp, lr).max()) < 10  # clamps inactive
    value, loss = peer(option.key, batch)
    got = option.call(batch, reduction=option.reduction) * SCALE.get(option.framework, 1)
    torch.testing.assert_close(got.detach(), value.detach(), rtol=1e-12, atol=1e-14)
    inputs = (batch.logp, logits)
    want = torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)
    have = torch.autograd.grad(got, inputs, allow_unused=True)
    for h, w, name in zip(have, want, ("logp", "logits"), strict=True):
        if w is None:  # the exact-KL options read the logits only
            assert h is None, name
            continue
        torch.testing.assert_close(h, w, rtol=1e-11, atol=1e-14, msg=f"gradient wrt {name}")


def test_every_option_has_a_formula_and_a_unique_key():
    keys = [o.key for o in OPTIONS]
    assert len(set(keys)) == len(keys)
    batch, _ = make_batch()
    for key in keys:
        peer(key, batch)  # raises KeyError for an option without a hand-written formula


def test_trl_bias_correction_off_policy():
    """use_bias_correction_kl with pi_old != pi: k3 times the differentiable ratio pi/pi_old is
    klest's token gradient with logp_behavior = log pi_old (value: the weighted k3)."""
    batch, logits = make_batch(1)
    g = torch.Generator().manual_seed(2)
    old = batch.logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    want = aggregate(
        k3(batch.logp, batch.logp_ref) * torch.exp(batch.logp - old), batch.mask, "token-mean"
    )
    got = OPTIONS[0].call(batch._replace(logp_old=old), reduction="token-mean")
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-14)
    (gw,) = torch.autograd.grad(want, logits, retain_graph=True)
    (gh,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(gh, gw, rtol=1e-11, atol=1e-14)


CALLS = list(dict.fromkeys([o.call for o in OPTIONS] + [o.intended for o in OPTIONS]))


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.text())
def test_printed_call_runs_and_is_the_measured_call(call: KLCall):
    batch, logits = make_batch(3)
    names = {
        "kl_penalty": klest.kl_penalty,
        "kl_from_logits": klest.kl_from_logits,
        "logp": batch.logp,
        "logp_ref": batch.logp_ref,
        "mask": batch.mask,
        "prompt_ids": batch.group,
        "logits": batch.logits,
        "logits_ref": batch.logits_ref,
        "iw_opd_weights": klest.iw_opd_weights,
    }
    for reduction in ("seq-mean-token-sum", "token-mean"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            printed = eval(call.text(reduction), names)
        warned = any(issubclass(w.category, klest.KLGradientWarning) for w in caught)
        # Called directly, the biased gradient estimators say so.
        assert warned == (call.function == "kl_penalty" and call.kwargs["grad"] in BIASED)
        measured = call(batch, reduction=reduction)
        torch.testing.assert_close(printed.detach(), measured.detach(), rtol=0, atol=0)
        (a,) = torch.autograd.grad(printed, logits, retain_graph=True)
        (b,) = torch.autograd.grad(measured, logits, retain_graph=True)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


BIASED = ("autodiff", "token")


def test_docs_page_shows_every_option_call():
    page = (ROOT / "docs" / "migration.md").read_text()
    for o in OPTIONS:
        for text in (o.call.text(o.reduction), o.intended.text()):
            assert f"`{text}`" in page, f"{o.key}: {text} not in docs/migration.md"


def test_weight_rule_names_a_klest_function_and_only_for_kl_penalty():
    with pytest.raises(ValueError, match="function must be one of"):
        WeightRule("my_weights")
    with pytest.raises(ValueError, match="weights= is a kl_penalty option"):
        KLCall("kl_from_logits", (("direction", "pi||ref"),), IW_OPD_WEIGHTS)


def test_batch_of_gives_equal_groups():
    from klest.testbeds import TabularAutoregressive, make_generator

    s = TabularAutoregressive.random(3, 4, eos=2, seed=0).sample(8, generator=make_generator(0))
    assert batch_of(s).group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


# -- The quick experiment ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("migration")
    with figures_checked():
        assert main(["run", "migration", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert (out / "table.md").stat().st_size > 1000 and list(out.glob("*.png"))
    return json.loads((out / "result.json").read_text())


# The hypotheses asserted to hold (each statistic below Z_HOLD), Bonferroni at RATE over all of
# them. The detections (statistics asserted above Z_HOLD, and, through the verdicts, above the
# table's own stricter threshold, 4.78: the other hypotheses are rejected) have power at the
# quick size (600 batches): the weakest are score+mean against grad KL(pi||ref), 8.3 in the
# quick run, and k3/autodiff against the sequence-level KL(ref||pi), 10.3; the others are above
# 15. The nulls are at 4.41.
HOLDS = {
    # gradient key: (part, direction or "zero") whose statistic must stay below the threshold
    "k1/autodiff": ("sequence", "zero"),
    "k3/autodiff": ("token_local", "ref||pi"),
    "token": ("token_local", "pi||ref"),
    "k2/autodiff": ("token_local", "pi||ref"),
    "exact per-position KL(pi||ref), autodiff": ("token_local", "pi||ref"),
    "exact per-position KL(ref||pi), autodiff": ("token_local", "ref||pi"),
    "score+loo": ("sequence", "pi||ref"),
    "cumulative": ("sequence", "pi||ref"),
    "cumulative+loo": ("sequence", "pi||ref"),
    "rb": ("sequence", "pi||ref"),
    "rb, KL(ref||pi)": ("sequence", "ref||pi"),
}
THEORY = {
    "k1/autodiff": "zero in expectation",
    "k3/autodiff": "descends KL(ref‖pi), token-local",
    "token": "descends KL(pi‖ref), token-local",
    "k2/autodiff": "descends KL(pi‖ref), token-local",
    "exact per-position KL(pi||ref), autodiff": "descends KL(pi‖ref), token-local",
    "exact per-position KL(ref||pi), autodiff": "descends KL(ref‖pi), token-local",
    "score+loo": "descends KL(pi‖ref)",
    "cumulative": "descends KL(pi‖ref)",
    "cumulative+loo": "descends KL(pi‖ref)",
    "rb": "descends KL(pi‖ref)",
    "rb, KL(ref||pi)": "descends KL(ref‖pi)",
}
Z_HOLD = z_for(RATE, len(HOLDS) + 1, two_sided=False)  # + the score+mean scale
DETECT = Z_HOLD


def _z(part: dict, hypothesis: str) -> float:
    if hypothesis == "zero":
        return part["z_zero"]
    return part["z_target"] if part["direction"] == hypothesis else part["z_other"]


@pytest.mark.parametrize("key", list(HOLDS))
def test_quick_gradient_verdicts_are_the_theoretical_ones(quick, key):
    g = quick["gradients"][key]
    part, hypothesis = HOLDS[key]
    assert _z(g[part], hypothesis) <= Z_HOLD, (key, g)
    others = [("sequence", "pi||ref"), ("sequence", "ref||pi"), ("sequence", "zero")]
    others += [("token_local", "pi||ref"), ("token_local", "ref||pi")]
    for p, h in others:
        if (p, h) != (part, hypothesis) and not (p == "sequence" and h == "zero"):
            assert _z(g[p], h) > DETECT, (key, p, h, g)
    assert g["verdict"] == THEORY[key]


def test_quick_k3_autodiff_does_not_descend_kl_pi_ref(quick):
    seq = quick["gradients"]["k3/autodiff"]["sequence"]
    assert _z(seq, "pi||ref") > DETECT and abs(seq["cos_pi_ref"]) < 0.3


def test_quick_mean_baseline_scales_the_gradient_by_one_minus_one_over_n(quick):
    """verl's GRPO advantage without the std: the group mean includes the sample, so the
    gradient is (1 - 1/n) grad KL(pi||ref) with n = 4 samples per prompt."""
    seq = quick["gradients"]["score+mean"]["sequence"]
    assert abs(seq["coef_pi_ref"] - 0.75) <= Z_HOLD * seq["coef_pi_ref_se"]
    assert _z(seq, "pi||ref") > DETECT


OPD_VARIANTS = {"trl-iw-opd": "IW-OPD's weights", "power-opd": "PowerOPD's power=0.5"}


@pytest.mark.parametrize("key", list(OPD_VARIANTS))
def test_quick_opd_variants_descend_no_kl(quick, key):
    """IW-OPD's token weights (which read the later tokens) and PowerOPD's transformed reward
    (per token the gradient of an alpha-divergence) give a mean gradient that is none of the
    four KLs' (sequence-level or token-local, either direction): every statistic above DETECT
    (the weakest in the quick run: IW-OPD against the token-local KL(pi||ref), 8.8; power=0.5
    against the token-local KL(ref||pi), 10.4), and the row reads "biased"."""
    row = next(r for r in quick["rows"] if r["key"] == key)
    g = quick["gradients"][row["gradient_key"]]
    for part in ("sequence", "token_local"):
        for hypothesis in ("pi||ref", "ref||pi"):
            assert _z(g[part], hypothesis) > DETECT, (key, part, hypothesis, g[part])
    assert row["gradient"] == g["verdict"] == "biased", (OPD_VARIANTS[key], g["verdict"])


def test_quick_rows_name_the_measured_verdicts(quick):
    rows = {r["key"]: r for r in quick["rows"]}
    assert len(rows) == len(OPTIONS)
    assert rows["trl-rloo"]["gradient"] == "descends KL(pi‖ref)"
    assert rows["trl-grpo"]["gradient"] == "descends KL(pi‖ref), token-local"
    assert rows["verl-low-var-kl"]["gradient"] == "descends KL(ref‖pi), token-local"
    assert rows["openrlhf-k1"]["gradient"] == "zero in expectation"
    for r in rows.values():
        assert r["gradient"] == quick["gradients"][r["gradient_key"]]["verdict"]
        intended = quick["gradients"][r["intended_gradient_key"]]["verdict"]
        assert intended in ("descends KL(pi‖ref)", "descends KL(ref‖pi)")


def test_quick_values(quick):
    """k1, k3 and the exact per-position KLs estimate KL(pi||ref) without bias; k2 and abs are
    biased upward (power: their z is above 20 at this size)."""
    values = quick["values"]
    z_value = z_for(RATE, 4)
    for key in ("k1", "k3", "exact per-position KL(pi||ref)", "rb"):
        assert abs(values[key]["sequence"]["z"]) <= z_value, values[key]
    for key in ("k2", "abs"):
        assert values[key]["sequence"]["z"] > DETECT and values[key]["verdict"].startswith("biased")


def test_quick_sequence_sum_aggregation_keeps_the_scale(quick):
    agg = quick["aggregations"]["seq-mean-token-sum"]
    assert abs(agg["coef_pi_ref"] - 1) <= z_for(RATE, 2) * agg["coef_pi_ref_se"]
    assert abs(agg["coef_ref_pi"]) <= z_for(RATE, 2) * agg["coef_ref_pi_se"]
