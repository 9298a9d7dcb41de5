"""The sampled-token path: KL estimates and gradients from the log-probs of sampled tokens.

Read it in the order data flows through it:

1. :mod:`~klest.sampled.log_ratios`: validated inputs as per-row log-ratios (masks, off-policy
   weights, the sequence level, exact per-position KLs from logits);
2. :mod:`~klest.sampled.groups`: group ids of the rows as keys;
3. :mod:`~klest.sampled.sequence`: sums from each token on, prefix weights, alignment at each
   completion's first token;
4. :mod:`~klest.sampled.terms`: the elementwise estimator terms (k1, k2, k3, abs, cv) of a
   direction;
5. :mod:`~klest.sampled.control_variates`: the control-variate coefficient, fixed or fitted;
6. :mod:`~klest.sampled.values`: each value estimator's per-row values, ready to reduce;
7. :mod:`~klest.sampled.baselines`: every baseline and fitted coefficient of the gradients;
8. :mod:`~klest.sampled.estimators`: the public estimators (``kl_estimate``, ``k1``, ...);
9. :mod:`~klest.sampled.penalty`: ``kl_penalty`` and its table of gradient estimators;
10. :mod:`~klest.sampled.rewards`: ``kl_reward``, the KL as a per-token reward;
11. :mod:`~klest.sampled.trust_region`: divergences between pi and the rollout policy that
    sampled the tokens, and the trust-region masks built from them.
12. :mod:`~klest.sampled.importance_weighted`: ``iwae_bound`` and ``renyi_bound``, K-sample
    variational bounds with pathwise, STL and DReG gradients.

The public names are exported from :mod:`klest` itself.
"""

__all__: list[str] = []  # the public names are exported from klest itself
