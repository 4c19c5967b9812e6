"""Rollout correction (algorithm.rollout_correction): the rollout engine's policy is not exactly the trainer's.

Per response token, w_t = pi_train_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t) (its log clamped
to +-log_ratio_clamp), from the trainer's recomputed old logprobs and the engine's sampling logprobs; a response's
ratio is their geometric mean W = exp(mean_t log w_t) (a product of token ratios is another mode, not this one:
it leaves [low, high] at any mismatch once responses are long). Each mode gives every token a weight that
multiplies its loss (no gradient flows through it):

    token_tis   min(w_t, high)                          truncated IS per token (high = algorithm.tis_cap)
    seq_tis     min(W, high) on every token             truncated IS per response
    token_mask  1 if low <= w_t <= high else 0          the token rejected (no IS weight)
    seq_mask    1 if low <= W <= high else 0            the response rejected
    icepop      w_t if low <= w_t <= high else 0        IcePop (Ring-1T): kept tokens IS-weighted, bounds inclusive
    none        1

A masked token (weight 0) stays in the loss's divisor in every mode, as in IcePop's 1 / sum |y_i|: the divisor is
fixed from the responses before the step, so a correction never changes how much the kept tokens weigh.
Each mode registers itself (registry.correction) with the config keys of its bounds; torch is imported inside the
functions so that the config reads the registry without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_dapo.algorithm.registry import CORRECTIONS, Correction, correction

if TYPE_CHECKING:
    import torch


@correction("token_tis", high="tis_cap")
def _truncated_is(w: torch.Tensor, low: Optional[float], high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(w, high): truncated IS, one-sided (small weights stay as they are). w: [R] float64, each mode's input."""
    weight, corrected = w.clamp(max=high), w > high
    return weight, corrected


correction("seq_tis", high="tis_cap", per_sequence=True)(_truncated_is)  # the same, of the response's W


@correction("token_mask", low="rollout_mask_low", high="rollout_mask_high")
def _mask(w: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1 where w is kept, else 0: the token or response rejected, the kept ones not reweighted."""
    import torch

    kept = _kept(w, low, high)
    return torch.where(kept, torch.ones_like(w), torch.zeros_like(w)), ~kept


correction("seq_mask", low="rollout_mask_low", high="rollout_mask_high", per_sequence=True)(_mask)  # of W


@correction("icepop", low="icepop_low", high="icepop_high")
def _icepop(w: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w where w is kept, else 0: IcePop's kept tokens IS-weighted."""
    import torch

    kept = _kept(w, low, high)
    return torch.where(kept, w, torch.zeros_like(w)), ~kept


@correction("none")
def _no_correction(w: torch.Tensor, low: None, high: None) -> tuple[torch.Tensor, torch.Tensor]:
    """1 on every token."""
    import torch

    return torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)


def _kept(w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[R] bool: low <= w <= high, bounds inclusive (IcePop's and verl's)."""
    return (w >= low) & (w <= high)


def rollout_log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, log_ratio_clamp: float) -> torch.Tensor:
    """[R] float64: log w = old_logp - rollout_logp per token, clamped so that exp() stays finite."""
    return (old_logp.detach().double() - rollout_logp.detach().double()).clamp(-log_ratio_clamp, log_ratio_clamp)


def correction_weight(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, correction: Correction, log_ratio_clamp: float = 20.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One response's per-token weights under the correction, and which tokens it capped or masked.

    old_logp, rollout_logp: [R] the response's logprobs under the trainer (recomputed) and the engine (sampled).
    Returns (weight [R] float32, corrected [R] bool), both detached.
    """
    import torch

    mode, low, high = correction
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: expected one of {tuple(CORRECTIONS)}")
    if old_logp.shape != rollout_logp.shape or old_logp.dim() != 1:
        raise ValueError(
            f"correction_weight: old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} "
            "must be the same [R]"
        )
    spec = CORRECTIONS[mode]
    if (spec.high is not None and (high is None or high <= 0)) or (spec.low is not None and low is None):
        raise ValueError(f"rollout correction {mode!r}: bounds low={low}, high={high} (need high > 0, and low)")
    log_w = rollout_log_ratio(old_logp, rollout_logp, log_ratio_clamp)
    if spec.per_sequence:  # the geometric mean, on every token of the response (1 for an empty response)
        log_w = log_w.mean().expand(log_w.shape) if log_w.numel() else log_w
    weight, corrected = spec.weight(torch.exp(log_w), low, high)
    return weight.float(), corrected
