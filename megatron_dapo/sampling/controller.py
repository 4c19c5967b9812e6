"""Asynchronous DAPO's two sides (pipeline.mode=async; docs/async.md): the rollout controller and the trainer's end.

The rollout side is one process here: the vLLM engine, the reward pool and the dynamic-sampling loader, exactly as
a colocated rank runs them; the train side is Megatron's world (any TP x PP x DP). They meet in two transport
groups (rollout/weight_transport.py), both hosted by the controller at DAPO_TRANSPORT=host:port:

    batches  (gloo, port):      rank 0 the controller, ranks 1.. the train ranks: commands from train rank 0,
                                batches from the controller
    weights  (gloo|nccl, port+1): rank 0 the controller, rank 1 train rank 0, which sends every update

The conversation, each message a broadcast_object:

    train rank 0 -> all:  {"cmd": "start", "state": loader state to resume from, or None}
    controller -> all:    {"weight_format": the engine's}
    train -> controller:  the first weights (version = steps trained)
    per step:  train rank 0 -> all: {"cmd": "batch"};  controller -> all: the batch (groups, every response,
               stats, the loader's state after it) or {"error": ...};  train -> controller: the new weights
    at the end: train rank 0 -> all: {"cmd": "stop"}

The loader's state travels with each batch, so the trainer's checkpoint holds both sides' state and a step is
complete when that one directory is (the controller writes nothing). With sampler.max_staleness=0 the controller
waits for each batch's weights before generating again, exactly as a colocated rank pauses for its sync: the run
takes the colocated run's steps, and its checkpoints resume either way.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from megatron_dapo.config import Config, ConfigError
from megatron_dapo.sampling.loader import DynamicSamplingError, StepBatch

log = logging.getLogger("megatron_dapo.sampling")

ROLE_ENV, TRANSPORT_ENV, TRAIN_PROCS_ENV = "DAPO_ROLE", "DAPO_TRANSPORT", "DAPO_TRAIN_PROCS"
"""How a process of an asynchronous job learns its side, the controller's host:port and the train side's size."""


@dataclass(frozen=True)
class Transport:
    """Where the two sides meet (from the environment the launcher sets)."""

    host: str
    port: int
    train_procs: int

    @staticmethod
    def from_env() -> Transport:
        where, procs = os.environ.get(TRANSPORT_ENV, ""), os.environ.get(TRAIN_PROCS_ENV, "")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit() or not procs.isdigit() or int(procs) < 1:
            raise ConfigError(
                f"pipeline.mode=async: {TRANSPORT_ENV}={where!r} and {TRAIN_PROCS_ENV}={procs!r}: expected host:port "
                "and the number of train processes (python -m megatron_dapo.train sets them when it starts both sides)"
            )
        return Transport(host, int(port), int(procs))

    def connect(self, rank: int, backend: str) -> tuple[Any, Any]:
        """(batches group, weights group) for this process: rank 0 the controller, 1.. the train ranks (None: a
        train rank other than 0 is not in the weights group)."""
        from megatron_dapo.rollout.weight_transport import TransportGroup

        batches = TransportGroup.connect(self.host, self.port, rank, 1 + self.train_procs, "gloo")
        weights = TransportGroup.connect(self.host, self.port + 1, rank, 2, backend) if rank <= 1 else None
        return batches, weights


def transport_backend(cfg: Config) -> str:
    """The weights group's backend: pipeline.weights_backend, auto resolved by whether CUDA is available."""
    import torch

    backend = cfg.pipeline.weights_backend
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("config field pipeline.weights_backend='nccl': expected CUDA in this process (none found)")
    return backend


# ----------------------------------------------------------------------------- the rollout side


def run_rollout(cfg: Config) -> None:
    """The rollout process: build the engine, pool and loader, then serve the train side until it says stop."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.vllm_env import rollout_tp
    from megatron_dapo.rollout.weight_transport import WeightReceiver
    from megatron_dapo.sampling.loader import DynamicSamplingLoader

    if cfg.pipeline.rollout_gpus != rollout_tp(cfg):
        raise ConfigError(
            f"config field pipeline.rollout_gpus={cfg.pipeline.rollout_gpus!r}: expected rollout.tp={rollout_tp(cfg)} "
            "(one engine on the rollout side; several are not built yet)"
        )
    transport = Transport.from_env()
    hf = Path(cfg.model.hf_path)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    engine = pool = None
    try:
        # never asleep: the engines here generate while the train side trains
        engine = VLLMEngine.from_config(cfg, model_path=str(hf), load_format="dummy", enable_sleep_mode=False)
        pool = RewardPool.from_config(cfg.reward)
        loader = DynamicSamplingLoader(cfg, dataset, {0: engine}, pool, stop_token_ids=[tokenizer.eos_token_id])
        batches, weights = transport.connect(0, transport_backend(cfg))
        receiver = WeightReceiver(weights, src=1)
        start = _expect(batches.broadcast_object(None, src=1), "start")
        if start["state"] is not None:
            loader.load_state_dict(start["state"])
        batches.broadcast_object({"weight_format": engine.weight_format}, src=0)
        _apply_weights(engine, receiver)
        while _expect(batches.broadcast_object(None, src=1), "batch", "stop")["cmd"] == "batch":
            try:
                batch = loader.next_batch()
            except DynamicSamplingError as e:  # the trainer raises it: one error line, as colocated
                batches.broadcast_object({"error": str(e)}, src=0)
                return
            reply = {"groups": batch.groups, "responses": batch.local, "stats": batch.stats}
            batches.broadcast_object({**reply, "state": loader.state_dict()}, src=0)
            _apply_weights(engine, receiver)
    finally:
        if pool is not None:
            pool.close()
        if engine is not None:
            engine.close()


def _expect(msg: Any, *cmds: str) -> dict:
    if not isinstance(msg, dict) or msg.get("cmd") not in cmds:
        raise RuntimeError(
            f"rollout controller: expected a {' or '.join(cmds)} command from the train side, got {msg!r}"
        )
    return msg


def _apply_weights(engine: Any, receiver: Any) -> None:
    """The next update from the train side into the idle engine, tensor by tensor as it arrives."""
    receiver.begin()
    for name, tensor in receiver.tensors():
        engine.update_weights([(name, tensor)])
    engine.finish_weight_update()


# ----------------------------------------------------------------------------- the train side's end


class RemoteRollout:
    """What a train rank holds of the rollout side, with the colocated loader's interface: next_batch() asks the
    controller for a batch, state_dict() is the loader's state that came with the last batch (what the trainer's
    checkpoint saves), load_state_dict() keeps a checkpoint's for start() to hand over; send_weights() streams the
    bridge's buckets to the controller."""

    def __init__(self, transport: Transport, rank: int, backend: str) -> None:
        from megatron_dapo.rollout.weight_transport import WeightSender

        self.rank = rank  # this process's train rank
        self.batches, weights = transport.connect(rank + 1, backend)
        self.sender = WeightSender(weights if rank == 0 else None)
        self.state: Optional[dict[str, Any]] = None
        self.idle = False  # the controller waits for a command: set once it has its weights

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

    def start(self) -> None:
        """Hand the controller the state to resume from (None: a fresh run); learn what its engine loads."""
        self.batches.broadcast_object({"cmd": "start", "state": self.state} if self.rank == 0 else None, src=1)
        self.sender.weight_format = self.batches.broadcast_object(None, src=0)["weight_format"]

    def next_batch(self) -> StepBatch:
        """The controller's next batch; every response of it is on every train rank (`local`)."""
        t0 = time.perf_counter()
        self.idle = False
        self.batches.broadcast_object({"cmd": "batch"} if self.rank == 0 else None, src=1)
        reply = self.batches.broadcast_object(None, src=0)
        if "error" in reply:
            raise DynamicSamplingError(reply["error"])
        self.state = reply["state"]
        stats = {**reply["stats"], "timing/batch_wait": time.perf_counter() - t0}
        return StepBatch(groups=reply["groups"], local=reply["responses"], stats=stats)

    def send_weights(self, bridge: Any, version: int) -> dict[str, float]:
        """Every train rank iterates the bridge (it is collective); train rank 0 sends."""
        self.sender.begin(version)
        metrics = bridge.sync(self.sender)
        self.idle = True
        return {**metrics, **self.sender.stats}

    def close(self) -> None:
        """Tell a controller waiting for a command to stop; one in the middle of a step is the launcher's to end
        (python -m megatron_dapo.train stops the rollout process when the train side has exited)."""
        if self.idle:
            self.idle = False
            self.batches.broadcast_object({"cmd": "stop"} if self.rank == 0 else None, src=1)
