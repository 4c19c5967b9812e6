"""Parameter dtype names: the config's 'bf16' | 'fp16' | 'fp32' (config.DTYPES), as torch and Hugging Face name them.

Torch is imported inside torch_dtype only, so the conversion tools that read these names answer --help fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_dapo.config import DTYPES

if TYPE_CHECKING:
    import torch

HF_DTYPE_NAMES = dict(zip(DTYPES, ("bfloat16", "float16", "float32"), strict=True))
"""'bf16' -> 'bfloat16', ...: the torch attribute, and what a Hugging Face config.json's dtype field says."""

DTYPE_OF_HF_NAME = {hf: name for name, hf in HF_DTYPE_NAMES.items()}
"""'bfloat16' -> 'bf16', ...: the inverse of HF_DTYPE_NAMES."""


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' -> torch dtype."""
    import torch

    return getattr(torch, HF_DTYPE_NAMES[name])
