"""The reward section: the verifier and its worker pool."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.choices import VERIFIER_NAMES
from megatron_dapo.config.base import check


@dataclass
class RewardConfig:
    """Rule-based verifiers, run in a process pool."""

    verifier: str = "auto"
    """'hybrid' (the last 'Answer:' line, or the last \\boxed{}; exact rational comparison, then
    math-verify on that answer alone; rules in megatron_dapo/reward/hybrid.py), 'dapo' (last
    'Answer:' line, string comparison after normalisation), 'math_verify' (LaTeX/boxed, GSM8K
    '#### N' golds), 'auto' (hybrid when the prompt's data_source names dapo, else math_verify),
    or a user function 'package.module:function' taking (response, ground_truth)."""
    num_workers: int = 2
    """Scoring processes."""
    timeout_s: float = 5.0
    """Wall-clock limit per response; a response over it scores as incorrect and is
    counted in reward/timeouts (its worker is killed and replaced)."""
    worker_memory_mb: int = 4096
    """Address-space limit of a scoring process, so one pathological answer cannot eat the node."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(
            self.verifier in VERIFIER_NAMES or ":" in self.verifier,
            "reward.verifier",
            self.verifier,
            f"one of {VERIFIER_NAMES} or a user function 'package.module:function'",
        )
        check(self.num_workers >= 1, "reward.num_workers", self.num_workers, "an integer >= 1")
        check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "a value > 0")
        check(self.worker_memory_mb >= 256, "reward.worker_memory_mb", self.worker_memory_mb, "an integer >= 256")
