"""Group-relative advantages (GRPO / DAPO eq. 4; Dr. GRPO without the division by the standard deviation)."""

from __future__ import annotations

import torch

from megatron_dapo.choices import ADV_NORMS


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, norm: str = "std") -> torch.Tensor:
    """Within each group, norm "std": A_i = (R_i - mean(R)) / (std(R) + eps), std unbiased (torch's default);
    norm "none" (Dr. GRPO): A_i = R_i - mean(R).

    rewards: [N, G] (any float dtype) shaped rewards of N groups of G responses.
    Returns [N, G] float32, computed in float64; the trainer broadcasts A_i to every token of response i.
    """
    if norm not in ADV_NORMS:
        raise ValueError(f"group_advantages: norm={norm!r}, expected one of {ADV_NORMS}")
    if rewards.dim() != 2:
        raise ValueError(
            f"group_advantages: rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}"
        )
    if rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: group_size must be >= 2 for a standard deviation, got {rewards.shape[1]}")
    r = rewards.double()
    if r.shape[0] == 0:
        return r.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if norm == "std":
        centred = centred / (r.std(dim=1, keepdim=True) + eps)  # unbiased (G - 1), as the paper's reference code
    # Equal rewards carry no signal: the rounding of their mean must not become an advantage (of std / eps).
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, 0.0, centred).float()
