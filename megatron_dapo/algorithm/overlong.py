"""Overlong reward shaping (DAPO section 3.4): soft punishment (the paper's buffer ramp, or the seed notes' penalty on
the excess over a soft maximum) and overlong filtering."""

from __future__ import annotations

import torch


def soft_overlong_punishment(
    lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """The length penalty added to the reward (paper eq. 13, scaled by `factor`).

    With L_max = max_response_length and L_cache = overlong_buffer_len:
        0                                    if |o| <= L_max - L_cache
        ((L_max - L_cache) - |o|) / L_cache  if L_max - L_cache < |o| <= L_max   (times factor)
        -factor                              if |o| > L_max
    lengths: [N] response lengths in tokens. Returns [N] float32, in [-factor, 0].
    """
    if not 1 <= overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"soft_overlong_punishment: overlong_buffer_len={overlong_buffer_len} must be in "
            f"[1, max_response_length={max_response_length}]"
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"soft_overlong_punishment: response lengths must be >= 0, got min {int(lengths.min())}")
    expected_len = max_response_length - overlong_buffer_len
    penalty = (expected_len - lengths.double()) / overlong_buffer_len * factor
    return penalty.clamp(min=-factor, max=0.0).float()


def excess_overlong_penalty(lengths: torch.Tensor, soft_max: int, factor: float = 0.1) -> torch.Tensor:
    """The seed notes' length penalty added to the reward: -factor * (|o| - soft_max) / soft_max past soft_max, else 0.

    lengths: [N] response lengths in tokens. Returns [N] float32, <= 0 (no floor: the generation limit bounds it).
    """
    if soft_max < 1:
        raise ValueError(f"excess_overlong_penalty: soft_max={soft_max} must be >= 1")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"excess_overlong_penalty: response lengths must be >= 0, got min {int(lengths.min())}")
    excess = (lengths.double() - soft_max).clamp(min=0.0)
    return (-factor * excess / soft_max).float()


def overlong_filter_mask(truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: which responses stay in the loss. truncated: [N] bool -> keep: [N] bool."""
    return ~truncated.bool()
