"""The policy loss of a micro-batch: an objective's token losses (objectives.py), masked, weighted and aggregated.

Per valid token, with the objective's loss l_t (its registered token loss, registry.OBJECTIVES: objectives.py
has the built-in ones' formulas):

    l_t = w_t * l_t               with rollout-correction weights w (rollout_correction.py), not differentiated
    l_t = l_t + beta * k_t        with a KL term to a reference policy (kl.py's estimator k, no IS weight)

then aggregated by loss_agg_mode. The functions here return *sums* and the count to divide them by, never a mean:
the token-mean must be taken over every valid token of the whole mini-batch, across micro-batches, pipeline stages
and data-parallel ranks, and only the caller knows that count. All math is float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.algorithm.kl import k3, kl_estimate
from megatron_dapo.algorithm.objectives import sequence_index, sequence_sum
from megatron_dapo.algorithm.registry import OBJECTIVES, TokenLossInput
from megatron_dapo.choices import LOSS_AGG_MODES
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.loss_result import (  # the result both implementations return (the fused one too)
    STAT_KEYS,
    PolicyLoss,
)


def loss_normalizer(
    tokens: torch.Tensor, loss_agg_mode: str, max_response_length: Optional[int] = None
) -> torch.Tensor:
    """What responses add to the mini-batch loss's divisor (summed over micro-batches and data-parallel ranks).

    tokens: [B] valid (in-loss) tokens per response. token-mean: the valid tokens; seq-mean-token-mean and
    seq-mean-token-sum: the responses with at least one; seq-mean-token-sum-norm (Dr. GRPO): every response,
    in the loss or not, times max_response_length (a constant: no response's length changes another's weight).
    Returns [] float32.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}, expected one of {LOSS_AGG_MODES}")
    if loss_agg_mode == "token-mean":
        return tokens.sum().float()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if max_response_length is None or max_response_length < 1:
            raise ValueError(
                f"loss_agg_mode='seq-mean-token-sum-norm' needs max_response_length >= 1, got {max_response_length}"
            )
        return torch.tensor(float(tokens.numel() * max_response_length), device=tokens.device)
    return (tokens > 0).sum().float()


def response_tokens(mask: torch.Tensor, seq_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[S] long: the valid tokens of each response, in the loss or not (0 then). mask: [B, T] bool; seq_index as
    policy_loss takes it (None: one response a row)."""
    if seq_index is None:
        return mask.sum(dim=1)
    on = seq_index >= 0
    ids, which = torch.unique(seq_index[on], return_inverse=True)
    return torch.zeros(len(ids), dtype=torch.long, device=mask.device).index_add_(0, which, mask[on].long())


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: Optional[float] = AlgorithmConfig.eps_low,
    eps_high: float = AlgorithmConfig.eps_high,
    dual_clip_c: Optional[float] = AlgorithmConfig.dual_clip_c,
    is_weight: Optional[torch.Tensor] = None,
    loss_agg_mode: str = AlgorithmConfig.loss_agg_mode,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
    max_response_length: Optional[int] = None,
    ref_logp: Optional[torch.Tensor] = None,
    kl_coef: float = AlgorithmConfig.kl_coef,
    kl_estimator: str = AlgorithmConfig.kl_estimator,
    seq_index: Optional[torch.Tensor] = None,
    objective: str = AlgorithmConfig.policy_loss,
) -> PolicyLoss:
    """The loss of one micro-batch, as a sum plus its normaliser.

    logp:       [B, T] current policy's response-token logprobs (fp32 or bf16), differentiable
    old_logp:   [B, T] logprobs of the policy that sampled (recomputed by the trainer)
    advantages: [B] per row or [B, T] per token
    mask:       [B, T] bool/0-1, True on valid response tokens
    objective:  algorithm.policy_loss, a name in registry.OBJECTIVES; eps_low / eps_high are its bounds
                (AlgorithmConfig.clip_bounds: the config keys its record names, e.g. GSPO's gspo_eps_low /
                gspo_eps_high; eps_low None only where the record allows it, CISPO's); dual_clip_c is read by the
                objectives it applies to (the record's dual_clip: DAPO's)
    is_weight:  [B, T] optional rollout-correction weights (rollout_correction.py), not differentiated
    max_response_length: seq-mean-token-sum-norm's constant (rollout.max_response_length)
    ref_logp:   [B, T] optional reference-policy logprobs: adds kl_coef x kl_estimate(logp, ref_logp, kl_estimator)
                to every token's loss (aggregated as the policy loss is; not IS-weighted)
    seq_index:  [B, T] long, the number of the response each position belongs to, in the loss or not (packed rows
                hold several), -1 off responses; None: one response a row. seq-mean-token-mean and GSPO average
                over responses, and Dr. GRPO's divisor counts them.
    The mini-batch loss is sum(loss_sum) / sum(normalizer) over its micro-batches and ranks.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"policy_loss: objective={objective!r}, expected one of {tuple(OBJECTIVES)}")
    spec = OBJECTIVES[objective]
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"policy_loss: loss_agg_mode={loss_agg_mode!r}, expected one of {LOSS_AGG_MODES}")
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be the same [B, T]"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand(logp.shape)
    mask = mask.bool()
    seq = sequence_index(mask, seq_index)
    # Zero padding before the math: NaN/inf there would otherwise leak into the gradient.
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp.float(), zero)
    old_logp = torch.where(mask, old_logp.float(), zero)
    advantages = torch.where(mask, advantages.float(), zero)
    log_ratio = (logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp)  # exp() stays finite; no gradient beyond

    if eps_low is None and not spec.low_optional:
        optional = " and ".join(f"{name}'s" for name, o in OBJECTIVES.items() if o.low_optional)
        raise ValueError(f"policy_loss: objective={objective!r} needs eps_low (only {optional} may be None)")
    loss, flags = spec.token_loss(
        TokenLossInput(logp, log_ratio, advantages, mask, seq, eps_low, eps_high, dual_clip_c)
    )
    clip_dual = flags.get("clip_dual", torch.zeros_like(mask))
    if is_weight is not None:
        loss = loss * torch.where(mask, is_weight.detach().float(), zero)
    kl = torch.zeros_like(loss)
    if ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"policy_loss: ref_logp {tuple(ref_logp.shape)} must match logp {tuple(logp.shape)}")
        kl = torch.where(mask, kl_estimate(logp, torch.where(mask, ref_logp.float(), zero), kl_estimator), zero)
        loss = loss + kl_coef * kl
    loss = torch.where(mask, loss, zero)

    seq_tokens = sequence_sum(mask.float(), mask, seq)  # [B, T]: each position's response length

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        if loss_agg_mode == "seq-mean-token-mean":  # each response weighs the same, whatever its length
            return torch.where(mask, per_token / seq_tokens.clamp(min=1.0), zero).sum()
        return per_token.sum()  # over tokens (token-mean), responses (seq-mean-token-sum) or a constant (-norm)

    loss_sum = aggregate(loss)
    normalizer = loss_normalizer(response_tokens(mask, seq_index), loss_agg_mode, max_response_length)

    ratio = flags["ratio"]
    stats = {
        "tokens": mask.sum().float(),
        "clip_low": (flags["clip_low"] & mask).sum().float(),
        "clip_high": (flags["clip_high"] & mask).sum().float(),
        "clip_dual": (clip_dual & mask).sum().float(),
        "ratio_sum": torch.where(mask, ratio, zero).sum(),
        "ratio_max": torch.where(mask, ratio, zero).max() if mask.any() else zero.clone(),
        # k3 of KL(pi_old || pi): (r - 1) - log r with r = pi / pi_old at tokens sampled from pi_old
        "approx_kl_sum": torch.where(mask, k3(torch.log(ratio)), zero).sum(),
        "kl_sum": kl.detach().sum(),
        "kl_loss_sum": kl_coef * aggregate(kl.detach()),
    }
    return PolicyLoss(loss_sum=loss_sum, normalizer=normalizer, stats=stats)


def reduce_stats(stats_list: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine STAT_KEYS dicts of several micro-batches (sum; max for ratio_max)."""
    if not stats_list:
        return {k: torch.zeros(()) for k in STAT_KEYS}
    out = {}
    for k in STAT_KEYS:
        vals = torch.stack([s[k] for s in stats_list])
        out[k] = vals.max() if k == "ratio_max" else vals.sum()
    return out


def loss_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fractions and means for the logs, from summed statistics (zero when nothing was valid)."""
    tokens = float(stats["tokens"])
    denom = max(tokens, 1.0)
    return {
        "actor/clip_frac_low": float(stats["clip_low"]) / denom,
        "actor/clip_frac_high": float(stats["clip_high"]) / denom,
        "actor/clip_frac_dual": float(stats["clip_dual"]) / denom,
        "actor/ratio_mean": float(stats["ratio_sum"]) / denom if tokens else 0.0,
        "actor/ratio_max": float(stats["ratio_max"]),
        "actor/approx_kl": float(stats["approx_kl_sum"]) / denom,
        "actor/tokens": tokens,
    }
