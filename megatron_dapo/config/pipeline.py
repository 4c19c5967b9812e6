"""The pipeline section: colocated or asynchronous rollout and how weights reach it."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.choices import PIPELINE_MODES, WEIGHTS_BACKENDS
from megatron_dapo.config.base import check, either


@dataclass
class PipelineConfig:
    """Where generation and training run (docs/async.md): colocated on the same processes, or split."""

    mode: str = "colocated"
    """colocated: every process trains and generates in turn (the default); async: the first
    pipeline.rollout_gpus processes run the engines and the rollout controller, the others train,
    batches and weights travel between them (docs/async.md): the controller collects up to
    sampler.max_staleness batches ahead of training (0: the colocated run's steps exactly)."""
    rollout_gpus: int = 1
    """async: processes (GPUs) of the rollout side, a multiple of rollout.tp: one engine per
    rollout.tp of them (on CPU one per process), in lockstep; the train side is the rest of the
    job's processes."""
    recompute_kv: bool = True
    """async: a weight update arriving while groups generate re-reads their context under the new
    weights; false keeps the KV cache the old weights computed."""
    weights_backend: str = "auto"
    """async: the process group that carries each weight update from train rank 0 to the rollout
    side: auto (NCCL where CUDA is available, else gloo), nccl, or gloo (through host memory: for
    two sides sharing one GPU, where NCCL refuses two ranks on one device)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.mode in PIPELINE_MODES, "pipeline.mode", self.mode, either(PIPELINE_MODES))
        check(self.rollout_gpus >= 1, "pipeline.rollout_gpus", self.rollout_gpus, "an integer >= 1")
        check(
            self.weights_backend in WEIGHTS_BACKENDS,
            "pipeline.weights_backend",
            self.weights_backend,
            either(WEIGHTS_BACKENDS),
        )
