"""The data and reward sections: the prompt datasets and the verifiers that score their responses."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.choices import BAD_ROW_POLICIES, DATASET_FORMATS, VERIFIER_NAMES
from megatron_dapo.config.base import check


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet files with the DAPO-Math-17K or GSM8K schema."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files for periodic evaluation."""
    format: str = "auto"
    """'dapo' (prompt messages + reward_model.ground_truth), 'gsm8k' (question + answer
    ending in '#### N'), or 'auto' (decided per row from the keys present)."""
    dedup: bool = True
    """Drop rows whose prompt text was already seen (DAPO-Math-17K repeats each prompt ~100 times)."""
    on_bad_row: str = "error"
    """'error' stops at the first malformed row naming file, row and field; 'skip' drops
    it and counts it in the dataset's statistics."""
    max_prompt_length: int = 2048
    """Prompts longer than this many tokens after the chat template are dropped and counted."""
    shuffle: bool = True
    """Shuffle prompts every epoch (deterministically from seed and epoch)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.format in DATASET_FORMATS, "data.format", self.format, f"one of {DATASET_FORMATS}")
        check(self.on_bad_row in BAD_ROW_POLICIES, "data.on_bad_row", self.on_bad_row, f"one of {BAD_ROW_POLICIES}")
        check(self.max_prompt_length >= 1, "data.max_prompt_length", self.max_prompt_length, "an integer >= 1")


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
