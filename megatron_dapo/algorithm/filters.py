"""Dynamic sampling's group test (DAPO section 3.2)."""

from __future__ import annotations

import torch


def informative_groups(correct: torch.Tensor) -> torch.Tensor:
    """A group is informative when 0 < #correct < G, judged on raw correctness.

    Never judge on shaped rewards: an all-wrong group with different overlong penalties has
    reward variance but no correct answer, and training on it collapses the policy.
    correct: [N, G] bool. Returns [N] bool.
    """
    if correct.dim() != 2:
        raise ValueError(
            f"informative_groups: correct must be [num_groups, group_size], got shape {tuple(correct.shape)}"
        )
    num_correct = correct.bool().sum(dim=1)
    return (num_correct > 0) & (num_correct < correct.shape[1])
