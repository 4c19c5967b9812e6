"""The colocated rollout side (pipeline.mode=colocated): the engines, reward pool and loader in the train processes.

ColocatedRollout implements the `Rollout` protocol (protocol.py) with every rank driving its engine share and loader
(docs/architecture.md); build_rollout_parts builds the engine, pool, evaluator and loader for ColocatedRollout and for
the asynchronous rollout processes (controller.py) alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_dapo.config import Config
from megatron_dapo.model.comm import Comm
from megatron_dapo.rollout.held_out import HeldOutEval
from megatron_dapo.sampling.exchange import RouteShape, SampleId, deliver
from megatron_dapo.sampling.loader import DynamicSamplingLoader, StepBatch
from megatron_dapo.types import Prompt, Response


@dataclass
class RolloutParts:
    """What generates on one rank: its engine (a share of one: rollout.tp ranks drive it), the reward pool, the
    held-out evaluator and the dynamic-sampling loader over them."""

    engine: Any
    pool: Any
    held_out: HeldOutEval
    loader: DynamicSamplingLoader

    def close(self) -> None:
        """The pool, then the engine (whose shutdown takes torch.distributed's default group with it)."""
        self.pool.close()
        self.engine.close()


def build_rollout_parts(
    cfg: Config, tokenizer: Any, dataset: Any, comm: Comm, enable_sleep_mode: Optional[bool] = None
) -> RolloutParts:
    """Engine, pool, evaluator and loader for rank comm.rank of a world of comm.world ranks, one engine per
    rollout.tp consecutive ranks (vLLM groups them so), its first rank owning the engine's groups. The engine starts
    from dummy weights (the first sync loads the policy's); enable_sleep_mode None: vLLM's default here (on GPU).
    What started is closed if a later part fails."""
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.vllm_env import rollout_tp

    tp, stop = rollout_tp(cfg), [tokenizer.eos_token_id]
    hf = str(Path(cfg.model.hf_path))
    engine = VLLMEngine.from_config(cfg, model_path=hf, load_format="dummy", enable_sleep_mode=enable_sleep_mode)
    try:
        pool = RewardPool.from_config(cfg.reward)
    except BaseException:
        engine.close()
        raise
    engine_id = comm.rank // tp
    loader = DynamicSamplingLoader(
        cfg,
        dataset,
        {engine_id: engine},
        pool,
        num_engines=comm.world // tp,
        owned={engine_id} if comm.rank % tp == 0 else set(),
        comm=comm,
        stop_token_ids=stop,
    )
    # evaluation; training rollouts are scored by their engine's rank
    held_out = HeldOutEval(engine, pool, comm, tp, cfg.seed, stop)
    return RolloutParts(engine, pool, held_out, loader)


class ColocatedRollout:
    """The engines in the train processes (pipeline.mode=colocated): each rank drives its engine share and loader;
    the engine sleeps while the policy trains and wakes with the new weights. A batch's responses move to the ranks
    that train them (exchange.deliver)."""

    def __init__(self, cfg: Config, tokenizer: Any, dataset: Any, comm: Comm) -> None:
        from megatron_dapo.rollout.vllm_env import rollout_tp

        self.cfg, self.tokenizer, self.comm = cfg, tokenizer, comm
        self.tp = rollout_tp(cfg)
        self.parts = build_rollout_parts(cfg, tokenizer, dataset, comm)
        self.route_shape = route_shape(cfg, dataset)
        self.parts.engine.show_progress = cfg.trainer.progress_bar and comm.rank == 0
        self._val_prompts: Optional[list[Prompt]] = None

    def start(self) -> None:
        """Nothing to hand over: the loader is this process's."""

    def next_batch(self) -> StepBatch:
        batch = self.parts.loader.next_batch()
        self.parts.engine.sleep()  # GPU: free the KV cache and offload vLLM's weights while Megatron trains
        return batch

    def responses(
        self, batch: StepBatch, wanted_by: Callable[[int], list[SampleId]]
    ) -> tuple[dict[SampleId, Response], float]:
        return deliver(
            self.comm,
            batch.groups,
            batch.local,
            owner_rank=lambda g: g.engine * self.tp,  # an engine's first rank holds its groups
            wanted_by=wanted_by,
            routes=None if self.route_shape is None else self.route_shape(batch),
        )

    def sync(self, bridge: Any, version: int, evaluate: bool = False) -> dict[str, float]:
        """The weights into this rank's engine (a sleeping engine wakes its weights for the update), then its KV
        cache for the next rollout; the evaluation waits for held_out(), in this process."""
        metrics = bridge.sync(self.parts.engine, version)
        self.parts.engine.wake()
        return metrics

    def evaluate(
        self, prompts: list[Prompt], k: int, temperature: float, top_p: float, max_tokens: int
    ) -> dict[str, float]:
        return self.parts.held_out.evaluate(prompts, k, temperature, top_p, max_tokens)

    def held_out(self) -> dict[str, float]:
        from megatron_dapo.data.datasets import PromptDataset

        if self._val_prompts is None:
            self._val_prompts = list(PromptDataset.from_config(self.cfg.data, self.tokenizer, split="val"))
        e = self.cfg.eval
        return self.evaluate(self._val_prompts, e.k, e.temperature, e.top_p, self.cfg.eval_response_length())

    def state_dict(self) -> dict[str, Any]:
        return self.parts.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parts.loader.load_state_dict(state)

    def close(self) -> None:
        self.parts.close()


def route_shape(cfg: Config, dataset: Any) -> Optional[Callable[[StepBatch], RouteShape]]:
    """batch -> the shape of its responses' routes when the engines capture them (model.router_replay=r3 on a MoE
    model), else None."""
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.routing import route_dtype

    arch = ModelArch.from_hf_dir(cfg.model.hf_path)
    if cfg.model.router_replay != "r3" or not arch.is_moe:
        return None

    def shape(batch: StepBatch) -> RouteShape:
        by_key = {g.key: g for g in batch.groups}

        def rows(sid: SampleId) -> int:
            g = by_key[sid[0]]
            return len(dataset[g.index].token_ids) + g.lengths[sid[1]] - 1

        return RouteShape(rows, len(arch.moe_layers), arch.num_experts_per_tok, route_dtype(arch.num_experts))

    return shape
