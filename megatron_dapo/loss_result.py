"""What a policy-loss implementation returns: the contract between algorithm/ and kernels/.

algorithm/policy_loss.py (the PyTorch reference) and kernels/fused_loss.py (the fused Triton kernel) both return a
PolicyLoss with these stats, and algorithm/losses.py picks one of them. A leaf, so that the kernels need nothing
from algorithm/ (which imports them): the imports between the two go one way. No torch at import: the annotations
are strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The statistics policy_loss returns, as sums over valid tokens (reduce them across
# micro-batches and ranks by summing, except ratio_max which reduces by max). kl_sum: the
# reference KL estimate k summed over tokens; kl_loss_sum: the KL term's part of loss_sum.
# The fused kernel writes them in this order.
STAT_KEYS = (
    "tokens",
    "clip_low",
    "clip_high",
    "clip_dual",
    "ratio_sum",
    "ratio_max",
    "approx_kl_sum",
    "kl_sum",
    "kl_loss_sum",
)


@dataclass
class PolicyLoss:
    """What one micro-batch contributes to the mini-batch loss."""

    loss_sum: torch.Tensor
    """[] float32, differentiable. seq-mean-token-mean: the sum over responses of each response's mean
    token loss; every other mode: the sum of token losses."""
    normalizer: torch.Tensor
    """[] float32: this micro-batch's share of what the summed loss_sum is divided by (loss_normalizer)."""
    stats: dict[str, torch.Tensor]
    """STAT_KEYS -> [] float32, detached."""
