"""The data section: the prompt datasets."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.choices import BAD_ROW_POLICIES, DATASET_FORMATS
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
