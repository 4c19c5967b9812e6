"""Triton kernels, installed as megatron_dapo.kernels."""

from megatron_dapo.kernels.ratio_clip_reduce import fused_policy_loss, fused_runs_on, interpreter_enabled

__all__ = ["fused_policy_loss", "fused_runs_on", "interpreter_enabled"]
