"""The parallel section: the policy's tensor, pipeline, context, data and expert splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.config.base import check


@dataclass
class ParallelConfig:
    """Megatron parallel layout; data parallel is world_size / (tp x pp x cp)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved schedule; null = off."""
    cp: int = 1
    """Context-parallel size (needs Transformer Engine)."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each MoE layer's experts are split over this many ranks,
    which hold different data (the experts' data parallel is world / (pp x ep x etp)); it must divide the number of
    experts and world / pp."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's weights split over this many ranks. 1 (each expert whole) as the
    Qwen3-MoE recipes of verl, slime and NeMo-RL run; at most tp."""
    sequence_parallel: bool = True
    """Sequence parallel with tp > 1: each TP rank holds a share of the positions between the tensor-parallel layers
    (Transformer Engine's norms, or on the local spec model/provider.py's SequenceParallelRMSNorm). A MoE model with
    tp > 1 needs it (Megatron's MoE layer refuses to train without)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        for key in ("tp", "pp", "cp", "ep", "etp"):
            check(getattr(self, key) >= 1, f"parallel.{key}", getattr(self, key), "an integer >= 1")
        if self.vpp is not None:
            check(
                self.vpp >= 2 and self.pp >= 2,
                "parallel.vpp",
                self.vpp,
                "an integer >= 2 with parallel.pp >= 2, or null",
            )
