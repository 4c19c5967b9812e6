"""The root of the tree: its sections, the settings derived from several of them (the rollout correction in force,
lockstep, the soft overlong maximum, the evaluation's length), and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_dapo.algorithm.registry import CORRECTIONS, OBJECTIVES, Correction  # torch-free
from megatron_dapo.config.algorithm import AlgorithmConfig
from megatron_dapo.config.base import check
from megatron_dapo.config.data import DataConfig
from megatron_dapo.config.eval import EvalConfig
from megatron_dapo.config.model import ModelConfig
from megatron_dapo.config.optim import OptimConfig
from megatron_dapo.config.parallel import ParallelConfig
from megatron_dapo.config.pipeline import PipelineConfig
from megatron_dapo.config.reward import RewardConfig
from megatron_dapo.config.rollout import RolloutConfig
from megatron_dapo.config.sampler import SamplerConfig
from megatron_dapo.config.train import TrainConfig
from megatron_dapo.config.trainer import TrainerConfig


@dataclass
class Config:
    """The root of the tree."""

    seed: int = 42
    """Seeds the prompt order, each group's sampling seeds, the prompt memory's skip draws and Megatron's RNG
    (model_parallel_cuda_manual_seed: the init of any weight the checkpoint does not hold)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """See AlgorithmConfig."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """See RolloutConfig."""
    data: DataConfig = field(default_factory=DataConfig)
    """See DataConfig."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """See SamplerConfig."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """See RewardConfig."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """See OptimConfig."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """See ModelConfig."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """See ParallelConfig."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """See TrainConfig."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """See TrainerConfig."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """See EvalConfig."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """See PipelineConfig."""

    def tis_cap(self) -> Optional[float]:
        """The truncated-IS cap in force: algorithm.tis_cap, else rollout.quantization_tis_cap with FP8 rollouts."""
        if self.algorithm.tis_cap is not None:
            return self.algorithm.tis_cap
        return self.rollout.quantization_tis_cap if self.rollout.quantization == "fp8" else None

    def rollout_correction(self) -> Correction:
        """The rollout correction in force (algorithm.rollout_correction, else 'token_tis' when a cap is in force),
        with its bounds."""
        a, cap = self.algorithm, self.tis_cap()
        mode = a.rollout_correction or ("token_tis" if cap is not None else "none")
        spec = CORRECTIONS[mode]

        def bound(key: Optional[str]) -> Optional[float]:  # tis_cap: the cap in force, FP8 rollouts' too
            return None if key is None else cap if key == "tis_cap" else getattr(a, key)

        return Correction(mode, bound(spec.low), bound(spec.high))

    def lockstep(self) -> bool:
        """sampler.lockstep in force: as set, else off only in async at max_staleness >= 1."""
        if self.sampler.lockstep is not None:
            return self.sampler.lockstep
        return not (self.pipeline.mode == "async" and self.sampler.max_staleness >= 1)

    def overlong_soft_max(self) -> int:
        """overlong_shape=excess: algorithm.overlong_soft_max, else where the paper's ramp starts."""
        a = self.algorithm
        if a.overlong_soft_max is not None:
            return a.overlong_soft_max
        return self.rollout.max_response_length - a.overlong_buffer_len

    def eval_response_length(self) -> int:
        """The evaluation's generation limit: eval.max_response_length, else rollout.max_response_length."""
        return self.eval.max_response_length or self.rollout.max_response_length

    def validate(self) -> Config:
        """Each section checks its own fields; here only the checks that span sections. Return self."""
        for f in dataclasses.fields(self):
            if dataclasses.is_dataclass(section := getattr(self, f.name)):
                section.validate()
        a, r, s, o = self.algorithm, self.rollout, self.sampler, self.optim
        if a.overlong_punishment and (a.overlong_shape == "buffer" or a.overlong_soft_max is None):
            check(
                1 <= a.overlong_buffer_len <= r.max_response_length,
                "algorithm.overlong_buffer_len",
                a.overlong_buffer_len,
                f"an integer in [1, rollout.max_response_length={r.max_response_length}]",
            )
        if a.overlong_punishment and a.overlong_shape == "excess":
            check(
                1 <= self.overlong_soft_max() < r.max_response_length,
                "algorithm.overlong_soft_max" if a.overlong_soft_max is not None else "algorithm.overlong_buffer_len",
                a.overlong_soft_max if a.overlong_soft_max is not None else a.overlong_buffer_len,
                f"a soft maximum in [1, rollout.max_response_length={r.max_response_length}) (no response is longer "
                "than the limit, so a soft maximum at it never punishes)",
            )
        check(
            s.engine_sequences >= a.group_size,
            "sampler.engine_sequences",
            s.engine_sequences,
            f"at least algorithm.group_size={a.group_size} (an engine takes whole groups)",
        )
        correction = self.rollout_correction().mode
        if CORRECTIONS[correction].high == "tis_cap":
            check(
                self.tis_cap() is not None,
                "algorithm.tis_cap",
                a.tis_cap,
                f"a cap > 0 (e.g. 2.0) with algorithm.rollout_correction={correction}",
            )
        for needs, why in (
            (s.partial_rollout, "sampler.partial_rollout=true: tokens sampled by an older policy"),
            (r.quantization == "fp8", "rollout.quantization=fp8: tokens sampled by the FP8-rounded policy"),
        ):
            if needs:
                check(
                    correction != "none",
                    "algorithm.rollout_correction" if a.rollout_correction else "algorithm.tis_cap",
                    a.rollout_correction or a.tis_cap,
                    f"a correction (e.g. algorithm.tis_cap=2.0, or a rollout_correction other than none) with {why} "
                    "are weighted against the trainer's",
                )
        if self.parallel.cp > 1:
            per_response = [f"loss_agg_mode={a.loss_agg_mode}"] if a.loss_agg_mode == "seq-mean-token-mean" else []
            per_response += [f"policy_loss={a.policy_loss}"] if OBJECTIVES[a.policy_loss].whole_responses else []
            check(
                not per_response,
                "parallel.cp",
                self.parallel.cp,
                f"1 with algorithm.{' and '.join(per_response)}: a mean over each response needs all its tokens on "
                "one rank, and context parallel splits them",
            )
        if s.skip:
            check(
                a.dynamic_sampling and s.filter is None,
                "sampler.skip",
                True,
                "algorithm.dynamic_sampling=true and no sampler.filter: skipping predicts the informative test "
                "(0 < #correct < G) from past groups",
            )
        if self.eval.every:
            check(
                bool(self.data.val_files),
                "data.val_files",
                self.data.val_files,
                "files to evaluate on (eval.every > 0)",
            )
        if self.pipeline.mode == "async":
            if r.tp is not None:
                check(
                    self.pipeline.rollout_gpus % r.tp == 0,
                    "pipeline.rollout_gpus",
                    self.pipeline.rollout_gpus,
                    f"a multiple of rollout.tp={r.tp}: each engine spans rollout.tp processes",
                )
        responses = s.train_batch_size * a.group_size
        if s.mode != "dynamic_bs" and s.on_shortfall == "error":
            check(
                responses % o.mini_batch_size == 0,
                "optim.mini_batch_size",
                o.mini_batch_size,
                f"a divisor of sampler.train_batch_size x algorithm.group_size = {responses} responses per rollout step",
            )
        return self
