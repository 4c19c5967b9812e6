"""Triton kernels, installed as megatron_dapo.kernels."""

from megatron_dapo.kernels.fused_loss import fused_policy_loss
from megatron_dapo.kernels.ratio_clip_reduce import fused_runs_on, interpreter_enabled

__all__ = ["fused_policy_loss", "fused_runs_on", "interpreter_enabled"]
