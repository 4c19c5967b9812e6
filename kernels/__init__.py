"""Triton kernels, installed as megatron_dapo.kernels."""

from megatron_dapo.kernels.ratio_clip_reduce import LOSS_IMPLS, compute_policy_loss, fused_policy_loss

__all__ = ["LOSS_IMPLS", "compute_policy_loss", "fused_policy_loss"]
