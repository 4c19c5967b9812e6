"""The eval section: held-out evaluation during training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.config.base import check


@dataclass
class EvalConfig:
    """Periodic evaluation on data.val_files during training (the paper: AIME avg@32)."""

    every: int = 0
    """Evaluate every this many rollout steps (and after the last); 0 = never."""
    k: int = 32
    """Samples per problem: avg@k is the mean correctness over all k x problems."""
    temperature: float = 1.0
    """Sampling temperature for evaluation (the paper: 1.0); 0 = greedy (then use k = 1)."""
    top_p: float = 0.7
    """Nucleus sampling for evaluation (the paper: 0.7)."""
    max_response_length: Optional[int] = None
    """Generation limit for evaluation in tokens; null = rollout.max_response_length."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.every >= 0, "eval.every", self.every, "an integer >= 0 (0 = never)")
        check(self.k >= 1, "eval.k", self.k, "an integer >= 1")
        check(self.temperature >= 0, "eval.temperature", self.temperature, "a value >= 0 (0 = greedy)")
        check(0 < self.top_p <= 1, "eval.top_p", self.top_p, "a value in (0, 1]")
        if self.max_response_length is not None:
            check(
                self.max_response_length >= 1, "eval.max_response_length", self.max_response_length, "an integer >= 1"
            )
