"""The colocated rollout side (pipeline.mode=colocated): the engines, reward pool and loader in the train processes.

ColocatedRollout implements the `Rollout` protocol (protocol.py) with every rank driving its engine share and loader
(docs/architecture.md); colocated_rollout builds it from the run's Config. build_rollout_parts builds the engine, pool,
evaluator and loader for ColocatedRollout and for the asynchronous rollout processes (controller.py) alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from megatron_dapo.config import Config, ModelConfig
from megatron_dapo.model.comm import Comm
from megatron_dapo.placement.evaluation import Evaluation, Evaluator, Synced
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.rollout.engine import WeightSource
from megatron_dapo.rollout.held_out import HeldOutEval
from megatron_dapo.sampling.exchange import RouteShape, SampleId, deliver
from megatron_dapo.sampling.loader import DynamicSamplingLoader, LoaderState, StepBatch
from megatron_dapo.types import EvalRequest, Prompt, Response

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.vllm_engine import VLLMEngine


@dataclass
class RolloutParts:
    """What generates on one rank: its engine (a share of one: rollout.tp ranks drive it), the reward pool, the
    evaluator and the dynamic-sampling loader over them."""

    engine: VLLMEngine
    pool: RewardPool
    evaluator: Evaluator
    loader: DynamicSamplingLoader

    def close(self, *, exiting: bool = False) -> None:
        """The pool, then the engine (whose shutdown takes torch.distributed's default group with it). exiting: the
        process ends next (VLLMEngine.close)."""
        self.pool.close()
        self.engine.close(exiting=exiting)


def loader_options(cfg: Config) -> dict:
    """DynamicSamplingLoader's settings from the run's Config: the sections it acts on and the values derived across
    them (lockstep, the soft overlong maximum)."""
    return dict(
        algorithm=cfg.algorithm,
        sampler=cfg.sampler,
        rollout=cfg.rollout,
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
        lockstep=cfg.lockstep(),
        overlong_soft_max=cfg.overlong_soft_max(),
    )


def build_rollout_parts(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Sequence[Prompt],
    comm: Comm,
    enable_sleep_mode: Optional[bool] = None,
) -> RolloutParts:
    """Engine, pool, evaluator and loader for rank comm.rank of a world of comm.world ranks, one engine per
    rollout.tp consecutive ranks (vLLM groups them so), its first rank owning the engine's groups. The engine starts
    from dummy weights (the first sync loads the policy's); enable_sleep_mode None: vLLM's default here (on GPU).
    What started is closed if a later part fails."""
    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.vllm_env import rollout_tp

    tp, stop = rollout_tp(cfg.rollout, cfg.parallel), [tokenizer.eos_token_id]
    hf = str(Path(cfg.model.hf_path))
    engine = VLLMEngine.from_config(
        cfg.model,
        cfg.rollout,
        tp=tp,
        max_prompt_length=cfg.data.max_prompt_length,
        seed=cfg.seed,
        model_path=hf,
        load_format="dummy",
        enable_sleep_mode=enable_sleep_mode,
    )
    try:
        pool = RewardPool.from_config(cfg.reward)
    except BaseException:
        engine.close()
        raise
    engine_id = comm.rank // tp
    loader = DynamicSamplingLoader(
        dataset,
        {engine_id: engine},
        pool,
        **loader_options(cfg),
        num_engines=comm.world // tp,
        owned={engine_id} if comm.rank % tp == 0 else set(),
        comm=comm,
        stop_token_ids=stop,
    )
    # evaluation; training rollouts are scored by their engine's rank
    held_out = HeldOutEval(engine, pool, comm, tp, cfg.seed, stop)
    evaluator = Evaluator(held_out, lambda: list(PromptDataset.from_config(cfg.data, tokenizer, split="val")))
    return RolloutParts(engine, pool, evaluator, loader)


def colocated_rollout(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, dataset: Sequence[Prompt], comm: Comm, split: TrainSplit
) -> ColocatedRollout:
    """This train rank's ColocatedRollout (comm: the train world's); its parts are closed if a later step fails."""
    from megatron_dapo.model.parallel import arm_group_timeouts
    from megatron_dapo.rollout.vllm_env import rollout_tp

    parts = build_rollout_parts(cfg, tokenizer, dataset, comm)
    try:
        # the engine's groups (vLLM makes them with torch's default) before the first sync runs over them
        arm_group_timeouts(cfg.trainer.collective_timeout_s)
        return ColocatedRollout(
            parts,
            comm,
            split,
            tp=rollout_tp(cfg.rollout, cfg.parallel),
            route_shape=route_shape(cfg.model, dataset),
            show_progress=cfg.trainer.progress_bar and comm.rank == 0,
        )
    except BaseException:
        parts.close()
        raise


class ColocatedRollout:
    """The engines in the train processes (pipeline.mode=colocated): each rank drives its engine share and loader;
    the engine sleeps while the policy trains and wakes with the new weights. A batch's responses move to the ranks
    that train them (exchange.deliver). An evaluation asked for with a sync runs at its result() or before the next
    batch, whichever comes first; one asked for with evaluate() runs at once."""

    def __init__(
        self,
        parts: RolloutParts,
        comm: Comm,
        split: TrainSplit,
        *,
        tp: int,
        route_shape: Optional[Callable[[StepBatch], RouteShape]],
        show_progress: bool,
    ) -> None:
        """parts: this rank's engine, pool, evaluator and loader (build_rollout_parts), closed by close(). comm: the
        train world's. split: which rank trains which response. tp: ranks per engine (vllm_env.rollout_tp).
        route_shape: the shape of a batch's routes when the engines capture them (route_shape()), else None.
        show_progress: the engine's progress bar (trainer.progress_bar, on rank 0)."""
        self.comm, self.split, self.parts, self.tp, self.route_shape = comm, split, parts, tp, route_shape
        self.parts.engine.show_progress = show_progress
        self.version: Optional[int] = None  # the engine's weights (None: the dummy ones it started with)
        self.asleep = False
        self.pending: list[Evaluation] = []  # asked for with a sync, not run yet

    def start(self, state: Optional[LoaderState], weights: WeightSource, version: int) -> None:
        """The loader resumes from state (None: a fresh run); the engine takes the first weights. A rank without one
        takes rank 0's: an asynchronous run's checkpoint holds the whole state on train rank 0 only."""
        first = self.comm.broadcast_object(state if self.comm.rank == 0 else None)
        state = first if state is None else state
        if state is not None:
            self.parts.loader.load_state_dict(state)
        self.sync(weights, version)

    def next_batch(self) -> StepBatch:
        self._settle()
        batch = self.parts.loader.next_batch()
        self.parts.engine.sleep()  # GPU: free the KV cache and offload vLLM's weights while Megatron trains
        self.asleep = True
        return batch

    def responses(self, batch: StepBatch) -> tuple[dict[SampleId, Response], float]:
        return deliver(
            self.comm,
            batch.groups,
            batch.local,
            owner_rank=lambda g: g.engine * self.tp,  # an engine's first rank holds its groups
            wanted_by=self.split.wanted_by(batch.groups),
            routes=None if self.route_shape is None else self.route_shape(batch),
        )

    def sync(self, weights: WeightSource, version: int, evaluate: Optional[EvalRequest] = None) -> Synced:
        """The weights into this rank's engine (a sleeping engine wakes its weights for the update), then its KV
        cache for the next rollout."""
        self._settle()
        metrics = weights.sync(self.parts.engine, version)
        self.parts.engine.wake()
        self.version, self.asleep = version, False
        if evaluate is None:
            return Synced(metrics)
        evaluation = Evaluation(version, evaluate, lambda _: self._settle())
        self.pending.append(evaluation)
        return Synced(metrics, evaluation)

    def evaluate(self, request: EvalRequest) -> Evaluation:
        self._settle()
        evaluation = Evaluation(self._synced(), request, lambda _: None)
        evaluation.resolve(self._run(request))
        return evaluation

    def _settle(self) -> None:
        """Run every evaluation asked for with a sync, on the weights it asked for (the engine's until the next)."""
        while self.pending:
            self.pending[0].resolve(self._run(self.pending[0].request))
            self.pending.pop(0)

    def _run(self, request: EvalRequest) -> dict[str, float]:
        """request on the engine's weights; an engine asleep (while the policy trains) wakes for it."""
        if not self.asleep:
            return self.parts.evaluator.run(request)
        self.parts.engine.wake()
        try:
            return self.parts.evaluator.run(request)
        finally:
            self.parts.engine.sleep()

    def _synced(self) -> int:
        if self.version is None:
            raise RuntimeError("evaluate(): the engine holds no weights yet (start() syncs the first)")
        return self.version

    def state_dict(self) -> LoaderState:
        return self.parts.loader.state_dict()

    def close(self, *, exiting: bool = False) -> None:
        self.parts.close(exiting=exiting)


def route_shape(model: ModelConfig, dataset: Sequence[Prompt]) -> Optional[Callable[[StepBatch], RouteShape]]:
    """batch -> the shape of its responses' routes when the engines capture them (model.router_replay=r3 on a MoE
    model), else None. model: the model section."""
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.routing import route_dtype

    arch = ModelArch.from_hf_dir(model.hf_path)
    if model.router_replay != "r3" or not arch.is_moe:
        return None

    def shape(batch: StepBatch) -> RouteShape:
        by_key = {g.key: g for g in batch.groups}

        def rows(sid: SampleId) -> int:
            g = by_key[sid[0]]
            return len(dataset[g.index].token_ids) + g.lengths[sid[1]] - 1

        return RouteShape(rows, len(arch.moe_layers), arch.num_experts_per_tok, route_dtype(arch.num_experts))

    return shape
