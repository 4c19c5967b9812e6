"""Rollout: the RolloutEngine interface and its vLLM implementation (imported lazily: vllm is heavy and optional)."""

from __future__ import annotations

from typing import Any

from megatron_dapo.rollout.engine import (
    GroupRequest,
    RolloutEngine,
    StreamingEngine,
    continuation_seed,
    new_stats,
    validate_generate_args,
)

__all__ = [
    "GroupRequest",
    "RolloutEngine",
    "StreamingEngine",
    "VLLMEngine",
    "continuation_seed",
    "new_stats",
    "validate_generate_args",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":  # importing vllm costs seconds and sets process-wide state: only on first use
        from megatron_dapo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
