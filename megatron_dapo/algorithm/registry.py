"""The objectives (algorithm.policy_loss) and rollout corrections (algorithm.rollout_correction) by name: one
record each, registered where it is defined (objectives.py, rollout_correction.py, by decorator).

Design: this module and the two that register into it load no torch (they import it inside their functions), so
choices.py and the config read the names and settings of every objective and correction without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

if TYPE_CHECKING:
    import torch

Flags = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class TokenLossInput:
    """What every objective's token loss reads: [B, T] float32 tensors, zero off the mask.

    logp:      current policy's logprobs, differentiable
    log_ratio: logp - old_logp clamped to +-log_ratio_clamp
    adv:       the advantages, per token
    mask:      [B, T] bool, the valid response tokens
    seq_index: [B, T] long, which response each position belongs to (objectives.sequence_index)
    eps_low, eps_high: the objective's bounds (its Objective.low / .high keys); eps_low None only where low_optional
    dual_clip_c: the dual clip (None: off), read by the objectives whose dual_clip is set (DAPO)
    """

    logp: torch.Tensor
    log_ratio: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    seq_index: torch.Tensor
    eps_low: Optional[float]
    eps_high: float
    dual_clip_c: Optional[float] = None


TokenLoss = Callable[[TokenLossInput], "tuple[torch.Tensor, Flags]"]


@dataclass(frozen=True)
class Objective:
    """An objective: its token loss (loss [B, T] float32 and flags: ratio [B, T], clip_low / clip_high [B, T] bool,
    optionally clip_dual) and which settings it reads."""

    name: str
    token_loss: TokenLoss
    low: str
    """The AlgorithmConfig key of its lower bound (eps_low of TokenLossInput)."""
    high: str
    """The AlgorithmConfig key of its upper bound (eps_high)."""
    low_optional: bool = False
    """Its lower bound may be None (no bound below)."""
    dual_clip: bool = False
    """algorithm.dual_clip_c applies to it."""
    whole_responses: bool = False
    """It needs all of a response's tokens on one rank (a per-response ratio): no context parallel."""
    fused: bool = False
    """The fused Triton kernel (losses._fused_dapo) computes it."""


OBJECTIVES: dict[str, Objective] = {}


def objective(name: str, *, low: str, high: str, **settings) -> Callable[[TokenLoss], TokenLoss]:
    """Register the decorated token loss as algorithm.policy_loss=name, its bounds read from config keys low and
    high; settings: Objective's other fields."""

    def register(token_loss: TokenLoss) -> TokenLoss:
        if name in OBJECTIVES:
            raise ValueError(f"policy loss {name!r} is registered already")
        OBJECTIVES[name] = Objective(name, token_loss, low, high, **settings)
        return token_loss

    return register


class Correction(NamedTuple):
    """The rollout correction in force and its bounds (Config.rollout_correction(); rollout_correction.py applies
    it)."""

    mode: str = "none"
    low: Optional[float] = None
    """token_mask, seq_mask, icepop: the lowest kept ratio (inclusive)."""
    high: Optional[float] = None
    """token_tis, seq_tis: the cap; token_mask, seq_mask, icepop: the highest kept ratio (inclusive)."""


CorrectionWeight = Callable[["torch.Tensor", Optional[float], Optional[float]], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class CorrectionMode:
    """A rollout-correction mode: weight(w [R] float64, low, high) -> (weight [R], corrected [R] bool)."""

    name: str
    weight: CorrectionWeight
    low: Optional[str] = None
    """The AlgorithmConfig key of its lowest kept ratio (None: no lower bound)."""
    high: Optional[str] = None
    """The AlgorithmConfig key of its cap or highest kept ratio (None: no bound). 'tis_cap' reads the cap in force
    (Config.tis_cap(): FP8 rollouts bring one of their own)."""
    per_sequence: bool = False
    """w is the response's geometric mean W on every token, not the token's own ratio."""


CORRECTIONS: dict[str, CorrectionMode] = {}


def correction(name: str, **settings) -> Callable[[CorrectionWeight], CorrectionWeight]:
    """Register the decorated weight function as algorithm.rollout_correction=name; settings: CorrectionMode's
    other fields."""

    def register(weight: CorrectionWeight) -> CorrectionWeight:
        if name in CORRECTIONS:
            raise ValueError(f"rollout correction {name!r} is registered already")
        CORRECTIONS[name] = CorrectionMode(name, weight, **settings)
        return weight

    return register
