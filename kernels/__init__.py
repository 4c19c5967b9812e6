"""Triton kernels, installed as megatron_dapo.kernels."""
