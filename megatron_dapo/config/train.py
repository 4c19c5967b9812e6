"""The train section: how a mini-batch runs through the policy (micro-batches, packing)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config.base import check


@dataclass
class TrainConfig:
    """How a mini-batch runs through the policy."""

    max_tokens_per_microbatch: int = 15360
    """Token budget of a micro-batch of the train step (padded prompt + response tokens per sequence, summed):
    sequences are packed into micro-batches under it, so long and short responses balance. The default is what
    model/memory.py's memory model allows its REFERENCE_CASE: the Qwen2.5-1.5B shape (untied, as the preflight builds
    it) alone on one 80 GiB GPU, SDPA attention, bf16, no recompute, the one-pass vocabulary code, 10% of the GPU left
    free: a peak of 71.2 GiB (16384 would plan 74.0 GiB). For another model or layout: memory.max_tokens."""
    max_tokens_per_forward: int = 0
    """Token budget of a micro-batch of the forward-only passes (the old logprobs, the KL reference's logprobs),
    which keep nothing for backward; 0 = max_tokens_per_microbatch, so the old-logprob forward runs the train step's
    own micro-batches and the on-policy ratio is exactly 1. A larger budget means fewer, larger forward passes (the
    memory model allows 144384 tokens in the reference case above, 41 GiB of it bf16 logits), but other GEMM shapes:
    the last bits of some bf16 logprobs change, and the ratio is then 1 only to about 1e-3."""
    packed_sequences: bool = True
    """Pack each micro-batch's sequences into one row (THD format, no padding, the budget counts real tokens) when
    the attention takes packed rows (model.attention 'sdpa' or Transformer Engine's); otherwise, and always with
    model.attention=unfused, context parallel or algorithm.loss_agg_mode=seq-mean-token-mean (which means over each
    response's row), rows are right-padded."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(
            self.max_tokens_per_microbatch >= 1,
            "train.max_tokens_per_microbatch",
            self.max_tokens_per_microbatch,
            "an integer >= 1",
        )
        check(
            self.max_tokens_per_forward >= 0,
            "train.max_tokens_per_forward",
            self.max_tokens_per_forward,
            "an integer >= 0 (0 = train.max_tokens_per_microbatch)",
        )

    def microbatch_tokens(self, forward_only: bool) -> int:
        """The token budget of a pass: max_tokens_per_forward for a forward-only one (0: the train step's)."""
        return (forward_only and self.max_tokens_per_forward) or self.max_tokens_per_microbatch
