"""The policy-loss registry: algorithm.loss_impl -> the function that computes the loss, resolved once at start-up.

Both take (logp, old_logp, advantages, mask) and the keywords eps_low, eps_high, dual_clip_c, is_weight,
loss_agg_mode, log_ratio_clamp, max_response_length, normalizer, ref_logp, kl_coef and kl_estimator, and return
the same PolicyLoss (shapes in policy_loss.py), for every aggregation:
- 'reference': policy_loss.py's PyTorch code;
- 'fused': the Triton kernel (megatron_dapo.kernels), which sums token losses: every mode but seq-mean-token-mean
  is that sum over its own divisor, and seq-mean-token-mean weighs each token by 1 / its response's valid tokens
  (folded into the truncated-IS weight the kernel already reads; the KL term gets it as a weight of its own).
  With `normalizer` (the mini-batch's global divisor) it writes the gradient in its forward pass. The reference
  ignores `normalizer`: the result is the same.
'auto' is 'fused' where the kernel can run (CUDA, or Triton's interpreter on CPU), else 'reference'.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from megatron_dapo.algorithm.policy_loss import PolicyLoss, loss_normalizer, policy_loss
from megatron_dapo.choices import LOSS_IMPLS

LossFn = Callable[..., PolicyLoss]


def _reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: Optional[Union[float, torch.Tensor]] = None,  # the fused gradient's alone: same result without it
    **kw,
) -> PolicyLoss:
    return policy_loss(logp, old_logp, advantages, mask, **kw)


def _fused(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    max_response_length: Optional[int] = None,
    is_weight: Optional[torch.Tensor] = None,
    **kw,
) -> PolicyLoss:
    from megatron_dapo.kernels import fused_policy_loss

    tokens = mask.bool().sum(dim=1)
    normalizer = loss_normalizer(tokens, loss_agg_mode, max_response_length)
    kl_weight = None
    if loss_agg_mode == "seq-mean-token-mean":  # sum over tokens of l / (its response's tokens)
        kl_weight = per_seq = (1.0 / tokens.clamp(min=1).float())[:, None].expand(mask.shape)
        is_weight = per_seq if is_weight is None else is_weight.detach().float() * per_seq
    out = fused_policy_loss(logp, old_logp, advantages, mask, is_weight=is_weight, kl_weight=kl_weight, **kw)
    return PolicyLoss(loss_sum=out.loss_sum, normalizer=normalizer.to(out.normalizer), stats=out.stats)


POLICY_LOSSES: dict[str, LossFn] = {"reference": _reference, "fused": _fused}


def resolve_loss_impl(impl: str, fused_runs_here: bool) -> str:
    """algorithm.loss_impl -> 'reference' or 'fused' for this run. fused_runs_here: the kernel can run on this device
    (megatron_dapo.kernels.fused_runs_on). Raises ValueError naming the field for an unknown name, and RuntimeError
    for 'fused' where the kernel cannot run."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"algorithm.loss_impl={impl!r}: expected one of {LOSS_IMPLS}")
    if impl == "reference":
        return "reference"
    if impl == "fused" and not fused_runs_here:
        raise RuntimeError(
            "algorithm.loss_impl='fused' needs CUDA tensors and triton, or TRITON_INTERPRET=1 to run the Triton "
            "kernel in the CPU interpreter (slow); on this CPU use algorithm.loss_impl='auto' or 'reference'"
        )
    return "fused" if fused_runs_here else "reference"


def policy_loss_fn(name: str) -> LossFn:
    """The loss function registered under a resolved name ('reference' or 'fused')."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r}: expected one of {sorted(POLICY_LOSSES)} (resolve 'auto' first)")
    return POLICY_LOSSES[name]
