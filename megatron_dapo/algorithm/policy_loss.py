"""The DAPO policy loss (paper eq. 8): decoupled clip, token-level aggregation.

Per valid token, with r = exp(logp - old_logp) and the response's advantage A:

    l = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    l = min(l, -c * A)            for A < 0, when dual clip c is set (verl's clip_ratio_c)
    l = w * l                     when truncated-IS weights w are given
    l = l + beta * k              with a KL term to a reference policy (kl.py's estimator k, no IS weight)

The functions here return *sums* and the count to divide them by, never a mean: the
token-mean must be taken over every valid token of the whole mini-batch, across
micro-batches, pipeline stages and data-parallel ranks, and only the caller knows that
count. All math is float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.algorithm.kl import kl_estimate
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


def token_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: Optional[float] = None,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss, no masking.

    logp, old_logp, advantages: [...] (same shape; advantages already broadcast to tokens).
    Returns (loss [...] float32, flags) with flags: ratio [...], clip_low/clip_high/clip_dual [...] bool.
    The log-ratio is clamped to +-log_ratio_clamp so exp() stays finite; beyond it the
    gradient is zero, where the clip would have stopped it anyway for A > 0.
    """
    adv = advantages.float()
    log_ratio = (logp.float() - old_logp.float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)  # -min(rA, clip(r)A)
    flags = {
        "ratio": ratio.detach(),
        # where the clip is the active branch of the min: it zeroes the token's gradient
        "clip_low": (adv < 0) & (ratio.detach() < 1.0 - eps_low),
        "clip_high": (adv > 0) & (ratio.detach() > 1.0 + eps_high),
    }
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c  # > 0 where A < 0
        flags["clip_dual"] = (adv < 0) & (loss.detach() > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    else:
        flags["clip_dual"] = torch.zeros_like(flags["clip_low"])
    return loss, flags


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = AlgorithmConfig.eps_low,
    eps_high: float = AlgorithmConfig.eps_high,
    dual_clip_c: Optional[float] = AlgorithmConfig.dual_clip_c,
    is_weight: Optional[torch.Tensor] = None,
    loss_agg_mode: str = AlgorithmConfig.loss_agg_mode,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
    max_response_length: Optional[int] = None,
    ref_logp: Optional[torch.Tensor] = None,
    kl_coef: float = AlgorithmConfig.kl_coef,
    kl_estimator: str = AlgorithmConfig.kl_estimator,
) -> PolicyLoss:
    """The DAPO loss of one micro-batch, as a sum plus its normaliser (one row per response).

    logp:       [B, T] current policy's response-token logprobs (fp32 or bf16), differentiable
    old_logp:   [B, T] logprobs of the policy that sampled (recomputed by the trainer)
    advantages: [B] per response or [B, T] per token
    mask:       [B, T] bool/0-1, True on valid response tokens
    is_weight:  [B, T] optional truncated-IS weights (see truncated_is_weight), not differentiated
    max_response_length: seq-mean-token-sum-norm's constant (rollout.max_response_length)
    ref_logp:   [B, T] optional reference-policy logprobs: adds kl_coef x kl_estimate(logp, ref_logp, kl_estimator)
                to every token's loss (aggregated as the policy loss is; not IS-weighted)
    The mini-batch loss is sum(loss_sum) / sum(normalizer) over its micro-batches and ranks.
    """
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
    # Zero padding before the math: NaN/inf there would otherwise leak into the gradient.
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp.float(), zero)
    old_logp = torch.where(mask, old_logp.float(), zero)
    advantages = torch.where(mask, advantages.float(), zero)

    loss, flags = token_policy_loss(logp, old_logp, advantages, eps_low, eps_high, dual_clip_c, log_ratio_clamp)
    if is_weight is not None:
        loss = loss * torch.where(mask, is_weight.detach().float(), zero)
    kl = torch.zeros_like(loss)
    if ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"policy_loss: ref_logp {tuple(ref_logp.shape)} must match logp {tuple(logp.shape)}")
        kl = torch.where(mask, kl_estimate(logp, torch.where(mask, ref_logp.float(), zero), kl_estimator), zero)
        loss = loss + kl_coef * kl
    loss = torch.where(mask, loss, zero)

    tokens_per_seq = mask.sum(dim=1)

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        if loss_agg_mode == "seq-mean-token-mean":  # each response weighs the same, whatever its length
            return (per_token.sum(dim=1) / tokens_per_seq.clamp(min=1)).sum()
        return per_token.sum()  # over tokens (token-mean), responses (seq-mean-token-sum) or a constant (-norm)

    loss_sum = aggregate(loss)
    normalizer = loss_normalizer(tokens_per_seq, loss_agg_mode, max_response_length)

    ratio = flags["ratio"]
    log_ratio = torch.log(ratio)
    stats = {
        "tokens": mask.sum().float(),
        "clip_low": (flags["clip_low"] & mask).sum().float(),
        "clip_high": (flags["clip_high"] & mask).sum().float(),
        "clip_dual": (flags["clip_dual"] & mask).sum().float(),
        "ratio_sum": torch.where(mask, ratio, zero).sum(),
        "ratio_max": torch.where(mask, ratio, zero).max() if mask.any() else zero.clone(),
        # k3 estimator of KL(pi_old || pi): (r - 1) - log r, >= 0 and low-variance
        "approx_kl_sum": torch.where(mask, (ratio - 1.0) - log_ratio, zero).sum(),
        "kl_sum": kl.detach().sum(),
        "kl_loss_sum": kl_coef * aggregate(kl.detach()),
    }
    return PolicyLoss(loss_sum=loss_sum, normalizer=normalizer, stats=stats)


def truncated_is_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cap: float,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
) -> torch.Tensor:
    """Truncated importance sampling for the rollout-vs-training mismatch.

    w = min(pi_train_old / pi_rollout, cap) per token, from the training policy's recomputed
    old_logp and the rollout engine's sampling logprobs. old_logp, rollout_logp: [B, T].
    Returns [B, T] float32, detached.
    """
    if cap <= 0:
        raise ValueError(f"truncated_is_weight: cap={cap} must be > 0")
    log_w = (old_logp.detach().float() - rollout_logp.detach().float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(log_w).clamp(max=cap)


MISMATCH_KEYS = ("abs_sum", "kl_sum", "capped", "tokens")


def rollout_mismatch_sums(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cap: Optional[float] = None,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
) -> torch.Tensor:
    """How far the rollout engine's policy is from the training policy, over tokens the engine sampled.

    old_logp, rollout_logp: [N] the same response tokens' logprobs under the training policy (recomputed) and the
    engine (as sampled). With w = pi_train / pi_rollout = exp(old_logp - rollout_logp) per token, returns [4]
    float64 sums (MISMATCH_KEYS): sum |old_logp - rollout_logp|; sum (w - 1) - log w, the k3 estimate of
    KL(pi_rollout || pi_train) (>= 0 per token, unbiased under the rollout's samples); the tokens whose truncated-IS
    weight w exceeds cap (0 when cap is None); and N. Sums, so ranks and micro-batches add them.
    """
    if old_logp.shape != rollout_logp.shape or old_logp.dim() != 1:
        raise ValueError(
            f"rollout_mismatch_sums: old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} "
            "must be the same [N]"
        )
    log_w = (old_logp.detach().double() - rollout_logp.detach().double()).clamp(-log_ratio_clamp, log_ratio_clamp)
    w = torch.exp(log_w)
    capped = (w > cap).sum() if cap is not None else torch.zeros((), dtype=torch.int64)
    return torch.stack(
        [log_w.abs().sum(), ((w - 1.0) - log_w).sum(), capped.double(), torch.tensor(float(log_w.numel()))]
    )


def mismatch_metrics(sums: torch.Tensor, cap: Optional[float]) -> dict[str, float]:
    """Per-token means for the logs from rollout_mismatch_sums' [4] totals (zero when no token had both logprobs):
    rollout/logp_mismatch_mean, rollout/kl, and rollout/tis_capped_frac when truncated IS is on (cap set)."""
    abs_sum, kl_sum, capped, tokens = (float(x) for x in sums)
    denom = max(tokens, 1.0)
    out = {"rollout/logp_mismatch_mean": abs_sum / denom, "rollout/kl": kl_sum / denom}
    if cap is not None:
        out["rollout/tis_capped_frac"] = capped / denom
    return out


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
