"""An objective's implementations (algorithm.loss_impl), resolved once at start-up.

Each objective (registry.OBJECTIVES) has its reference implementation (policy_loss.py's PyTorch code) and, where
its record says the fused Triton kernel (megatron_dapo.kernels) computes it, the fused one. All take (logp,
old_logp, advantages, mask) and the keywords eps_low, eps_high, dual_clip_c, is_weight, loss_agg_mode,
log_ratio_clamp, max_response_length, normalizer, ref_logp, kl_coef, kl_estimator and seq_index, and return the
same PolicyLoss (shapes in policy_loss.py), for every aggregation.
- 'dapo' fused: the kernel sums token losses: every mode but seq-mean-token-mean is that sum over its own divisor,
  and seq-mean-token-mean weighs each token by 1 / its response's valid tokens (folded into the rollout-correction
  weight the kernel already reads; the KL term gets it as a weight of its own). With `normalizer` (the
  mini-batch's global divisor) it writes the gradient in its forward pass. The reference ignores `normalizer`: the
  result is the same.
- the others ('gspo', 'gspo_token', 'cispo'): the reference only (the kernel's clip is per token, and GSPO's ratio needs each
  response's sum first).
algorithm.loss_impl 'auto' is 'fused' where the kernel can run (CUDA, or Triton's interpreter on CPU) and the
objective has a fused implementation, else 'reference'.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Union

import torch

from megatron_dapo.algorithm.objectives import sequence_index, sequence_sum
from megatron_dapo.algorithm.policy_loss import PolicyLoss, loss_normalizer, policy_loss, response_tokens
from megatron_dapo.algorithm.registry import OBJECTIVES
from megatron_dapo.choices import LOSS_IMPLS, RESOLVED_LOSS_IMPLS

LossFn = Callable[..., PolicyLoss]


def _reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str,
    normalizer: Optional[Union[float, torch.Tensor]] = None,  # the fused gradient's alone: same result without it
    **kw,
) -> PolicyLoss:
    return policy_loss(logp, old_logp, advantages, mask, objective=objective, **kw)


def _fused_dapo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    max_response_length: Optional[int] = None,
    is_weight: Optional[torch.Tensor] = None,
    seq_index: Optional[torch.Tensor] = None,
    **kw,
) -> PolicyLoss:
    from megatron_dapo.kernels import fused_policy_loss

    mask = mask.bool()
    normalizer = loss_normalizer(response_tokens(mask, seq_index), loss_agg_mode, max_response_length)
    kl_weight = None
    if loss_agg_mode == "seq-mean-token-mean":  # sum over tokens of l / (its response's tokens)
        seq_tokens = sequence_sum(mask.float(), mask, sequence_index(mask, seq_index))
        kl_weight = per_seq = torch.where(mask, 1.0 / seq_tokens.clamp(min=1.0), 0.0)
        is_weight = per_seq if is_weight is None else is_weight.detach().float() * per_seq
    out = fused_policy_loss(logp, old_logp, advantages, mask, is_weight=is_weight, kl_weight=kl_weight, **kw)
    return PolicyLoss(loss_sum=out.loss_sum, normalizer=normalizer.to(out.normalizer), stats=out.stats)


def resolve_loss_impl(impl: str, fused_runs_here: bool, objective: str = "dapo") -> str:
    """algorithm.loss_impl -> 'reference' or 'fused' for this run and objective. fused_runs_here: the kernel can run
    on this device (megatron_dapo.kernels.fused_runs_on). Raises ValueError naming the field for an unknown name or
    a 'fused' the objective does not have, and RuntimeError for 'fused' where the kernel cannot run."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"algorithm.loss_impl={impl!r}: expected one of {LOSS_IMPLS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"algorithm.policy_loss={objective!r}: expected one of {sorted(OBJECTIVES)}")
    has_fused = OBJECTIVES[objective].fused
    if impl == "reference":
        return "reference"
    if impl == "fused" and not has_fused:
        raise ValueError(f"algorithm.loss_impl='fused': the kernel does not compute policy_loss={objective!r}")
    if impl == "fused" and not fused_runs_here:
        raise RuntimeError(
            "algorithm.loss_impl='fused' needs CUDA tensors and triton, or TRITON_INTERPRET=1 to run the Triton "
            "kernel in the CPU interpreter (slow); on this CPU use algorithm.loss_impl='auto' or 'reference'"
        )
    return "fused" if fused_runs_here and has_fused else "reference"


def policy_loss_fn(name: str, objective: str = "dapo") -> LossFn:
    """The objective's implementation under a resolved name ('reference' or 'fused')."""
    if name not in RESOLVED_LOSS_IMPLS:
        raise ValueError(f"policy loss implementation {name!r}: expected 'reference' or 'fused' (resolve 'auto' first)")
    if objective not in OBJECTIVES:
        raise ValueError(f"algorithm.policy_loss={objective!r}: expected one of {sorted(OBJECTIVES)}")
    if name == "reference":
        return partial(_reference, objective=objective)
    if not OBJECTIVES[objective].fused:
        raise ValueError(f"policy_loss={objective!r} has no {name} implementation")
    return _fused_dapo  # the kernel's clip is DAPO's: the only objective whose record says fused
