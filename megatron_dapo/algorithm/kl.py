"""KL to a reference policy (GRPO's baseline term; DAPO drops it): per-token estimators on samples from the policy.

With d = logp_ref - logp per sampled token (clamped to +-clamp so exp() stays finite):

    k1 = -d                   = log pi(x) - log pi_ref(x)
    k2 = d^2 / 2
    k3 = exp(d) - 1 - d       clamped to [-10, 10], as verl's low_var_kl

Each is an estimate of KL(pi || pi_ref) from x ~ pi (k1 and k3 unbiased, k3 >= 0 with low variance; k2 biased).
What each does to the gradient depends on where it is used (tests/test_algorithm.py checks each on a categorical
distribution enumerated in full; "A Comedy of Estimators", arXiv 2512.21852):

- as a loss term, differentiated through logp with the samples held fixed (kl_coef x mean k added to the loss):
  k1's expected gradient is zero (it does nothing on average), k2's is the gradient of KL(pi || pi_ref), and
  k3's is the gradient of the forward KL(pi_ref || pi);
- as a reward penalty (R - kl_coef x sum of k over the response, no gradient through k; the policy gradient
  carries it): k1 gives the gradient of KL(pi || pi_ref) exactly (the score-function identity), k2 and k3 biased.
"""

from __future__ import annotations

import torch

from megatron_dapo.choices import KL_ESTIMATORS

K3_CLAMP = 10.0
"""k3 is clamped to [-K3_CLAMP, K3_CLAMP] (verl's low_var_kl)."""


def k3(log_ratio: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """k3 of log_ratio = log(q / p) at x ~ p: (r - 1) - log r with r = exp(log_ratio), an estimate of KL(p || q)
    that is >= 0 per token with low variance. log_ratio: [...]; returns [...] in its dtype, clamped to
    [-clamp, clamp] when clamp is given (verl's low_var_kl clamps at K3_CLAMP)."""
    out = torch.expm1(log_ratio) - log_ratio
    return out if clamp is None else out.clamp(-clamp, clamp)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float = 20.0) -> torch.Tensor:
    """The per-token estimate of KL(pi || pi_ref) named by estimator (k1, k2 or k3; module docstring).

    logp:     [...] the policy's logprobs of the sampled tokens (differentiable)
    ref_logp: [...] the reference policy's logprobs of the same tokens (a constant: detached here)
    Returns [...] float32 (float64 for float64 logp), differentiable through logp.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimate: estimator={estimator!r}, expected one of {KL_ESTIMATORS}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_estimate: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must match")
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    d = (ref_logp.detach().to(dtype) - logp.to(dtype)).clamp(-clamp, clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return k3(d, K3_CLAMP)


def kl_penalized_rewards(rewards: torch.Tensor, kl_sums: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """KL in the reward (algorithm.kl_in_reward): R - kl_coef x (k summed over each response's tokens), before the
    group's advantages are taken. rewards, kl_sums: [N, G]. Returns [N, G] float64 (no gradient: k comes from the
    old and reference logprobs)."""
    if rewards.shape != kl_sums.shape:
        raise ValueError(f"kl_penalized_rewards: rewards {tuple(rewards.shape)} and kl_sums {tuple(kl_sums.shape)}")
    return rewards.double() - kl_coef * kl_sums.detach().double()
