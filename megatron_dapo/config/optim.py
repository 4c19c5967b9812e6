"""The optim section: the optimizer and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config.base import check


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a constant learning rate (paper section 4.1)."""

    lr: float = 1e-6
    """Peak (and constant, after warm-up) learning rate."""
    warmup_steps: int = 320
    """Linear warm-up from 0 to lr, counted in optimizer steps: the paper warms up over 20
    rollout steps of 16 updates each = 320 (set 20 x updates per rollout step for other sizes)."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    mini_batch_size: int = 512
    """Responses per optimizer step: 512 x 16 responses per rollout step give 16 updates."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.lr > 0, "optim.lr", self.lr, "a value > 0")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a value >= 0")
        check(self.clip_grad > 0, "optim.clip_grad", self.clip_grad, "a value > 0")
        check(self.mini_batch_size >= 1, "optim.mini_batch_size", self.mini_batch_size, "an integer >= 1")
