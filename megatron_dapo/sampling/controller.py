"""Asynchronous DAPO's two sides (pipeline.mode=async; docs/async.md): the rollout controller and the trainer's end.

The rollout side is pipeline.rollout_gpus processes (one, or a torch.distributed world of its own started by torchrun),
each running a vLLM engine, a reward pool and the dynamic-sampling loader exactly as a colocated rank does: in
lockstep, one engine per rollout.tp of them. Its rank 0 is the controller, the only one that talks to the train side;
what it decides between two ticks it broadcasts to the others, so every rank hands out, updates and stops at the same
tick. The train side is Megatron's world (any TP x PP x DP). They meet in two transport groups
(rollout/weight_transport.py), both hosted by the controller at DAPO_TRANSPORT=host:port:

    batches  (gloo, port):        rank 0 the controller, ranks 1.. the train ranks; its TCP store holds the keys below
    weights  (gloo|nccl, port+1): ranks 0..R-1 the rollout ranks, rank R train rank 0, which sends every update

At start, two broadcasts: train rank 0 -> all {"cmd": "start", "state": loader state to resume from, or None};
controller -> all {"weight_format": the engine's, "batch": the index of the next batch}. After that neither side
waits for the other except where it must, each saying in the store what it is ready for:

    dapo/update = "V T E": train rank 0 is sending update V (V = steps trained; T its clock; E = 1: evaluate it)
                         over the weights group
    dapo/want = K:       train rank 0 asks for batch K; every train rank waits until dapo/ready >= K, then receives
                         it (the groups, every response, stats, the loader's state after it; or {"error": ...})
    dapo/ready = K:      the controller has collected batches up to K, and broadcasts K once it is wanted
    dapo/evaluated = V:  the controller has evaluated update V (at the batch boundary after it: no group in
                         flight) and broadcasts the result; the train ranks wait for it before asking for more
    dapo/stop:           train rank 0, at the end

A key holding what the other side did not expect (an update or a batch out of order) is an error, never a wait.

The controller collects batch K + 1 while batch K trains, as long as the batches collected and not trained stay
within sampler.max_staleness (eta); between two ticks of a step it hands out a wanted batch and applies an update
that has arrived (VLLMEngine.update_weights_in_flight, pipeline.recompute_kv: the groups in flight go on, their
later tokens tagged with the new version). With eta = 0 it waits for each batch's weights before collecting the
next, exactly as a colocated rank pauses for its sync: the run takes the colocated run's steps. The loader's state
travels with each batch, so the trainer's checkpoint holds both sides' state and a step is complete when that one
directory is (the controller writes nothing); at eta >= 1 what the controller generated after that state is
generated again on resume (each prompt visit trained or rejected once).
"""

from __future__ import annotations

import contextlib
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

    def connect(self, role: str, rank: int, rollout_procs: int, backend: str) -> tuple[Any, Any]:
        """(batches group, weights group) for rank `rank` of side `role` (rollout or train), None where it is not a
        member: batches = the controller (rollout rank 0) and every train rank; weights = every rollout rank (each
        drives an engine) and train rank 0, the sender."""
        from megatron_dapo.rollout.weight_transport import TransportGroup

        if role == "rollout":
            in_batches, in_weights = (0 if rank == 0 else None), rank
        else:
            in_batches, in_weights = rank + 1, (rollout_procs if rank == 0 else None)
        batches = weights = None
        if in_batches is not None:
            batches = TransportGroup.connect(self.host, self.port, in_batches, 1 + self.train_procs, "gloo")
        if in_weights is not None:
            weights = TransportGroup.connect(self.host, self.port + 1, in_weights, rollout_procs + 1, backend)
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
    """A rollout process: build the engine, pool and loader, then serve the train side until it says stop."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.held_out import HeldOutEval
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.vllm_env import rollout_tp
    from megatron_dapo.rollout.weight_transport import WeightReceiver
    from megatron_dapo.sampling.loader import DynamicSamplingLoader

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.pipeline.rollout_gpus:
        raise ConfigError(
            f"config field pipeline.rollout_gpus={cfg.pipeline.rollout_gpus!r}: expected the rollout side's processes "
            f"(WORLD_SIZE={world}): one per GPU, started together (torchrun --nproc-per-node on one node)"
        )
    transport = Transport.from_env()
    tp = rollout_tp(cfg)
    hf = Path(cfg.model.hf_path)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    engine = pool = None
    try:
        comm = _rollout_world(rank, world)
        # never asleep: the engines here generate while the train side trains
        engine = VLLMEngine.from_config(cfg, model_path=str(hf), load_format="dummy", enable_sleep_mode=False)
        pool = RewardPool.from_config(cfg.reward)
        loader = DynamicSamplingLoader(
            cfg,
            dataset,
            {rank // tp: engine},
            pool,
            num_engines=world // tp,
            owned={rank // tp} if rank % tp == 0 else set(),  # an engine's first rank holds its groups
            comm=comm,
            stop_token_ids=[tokenizer.eos_token_id],
        )
        held_out = None
        if cfg.eval.every:
            val = list(PromptDataset.from_config(cfg.data, tokenizer, split="val"))
            held_out = (HeldOutEval(engine, pool, rank, world, tp, cfg.seed, [tokenizer.eos_token_id]), val)
        batches, weights = transport.connect("rollout", rank, world, transport_backend(cfg))
        start = _expect(batches.broadcast_object(None, src=1), "start") if rank == 0 else None
        state = comm.broadcast_object(start["state"] if rank == 0 else None)
        if state is not None:
            loader.load_state_dict(state, merged=True)
        if rank == 0:
            batches.broadcast_object({"weight_format": engine.weight_format, "batch": loader.version}, src=0)
        RolloutController(cfg, loader, engine, batches, WeightReceiver(weights, src=world), comm, held_out).run()
    finally:
        if pool is not None:
            pool.close()
        if engine is not None:
            engine.close()


def _rollout_world(rank: int, world: int) -> Any:
    """The rollout side's own torch.distributed world (several processes: the loaders' collectives, the engines'
    groups; objects over gloo, CUDA tensors over NCCL) as the loader's Comm."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.sampling.exchange import Comm

    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return Comm(rank, world)


def _expect(msg: Any, *cmds: str) -> dict:
    if not isinstance(msg, dict) or msg.get("cmd") not in cmds:
        raise RuntimeError(
            f"rollout controller: expected a {' or '.join(cmds)} command from the train side, got {msg!r}"
        )
    return msg


def _wanted(store: Any) -> Optional[int]:
    """The batch train rank 0 asks for (None: none yet)."""
    return int(store.get("dapo/want")) if store.check(["dapo/want"]) else None


class _Stop(Exception):
    """The train side set dapo/stop."""


class RolloutController:
    """Collects batches ahead of training within eta, hands each out when it is wanted, applies each weight update
    as it arrives; what it decides depends on engine ticks and completed batches (the loader's), never on wall time.

    Runs on every rollout rank; rank 0 (the controller proper) reads the store and broadcasts its plan over `comm`,
    so every rank's loader, engine and receiver take the same steps. loader: the DynamicSamplingLoader (its
    between_ticks is set here). engine: the VLLMEngine it drives. batches: the batches TransportGroup (rank 0; None
    elsewhere). receiver: a WeightReceiver over the weights group. comm: the rollout side's Comm. held_out:
    (HeldOutEval, the validation prompts) where eval.every > 0.

    An update the train side marks for evaluation is evaluated at the next batch boundary (where no group is in
    flight: the groups still generating at a batch's end are paused), before anything else is collected; the train
    side waits for the result (RemoteRollout.evaluation), so no later update can land first.
    """

    POLL_S = 0.005
    """How often a controller with nothing to do looks at the store."""

    def __init__(
        self, cfg: Config, loader: Any, engine: Any, batches: Any, receiver: Any, comm: Any, held_out: Any = None
    ) -> None:
        self.eta = cfg.sampler.max_staleness
        self.eval_cfg, self.held_out = cfg.eval, held_out  # (HeldOutEval, prompts), or None: eval.every = 0
        self.eval_tokens = cfg.eval_response_length()
        self.eval_pending: Optional[int] = None  # the version of an update to evaluate at the next batch boundary
        self.recompute_kv = cfg.pipeline.recompute_kv
        self.loader, self.engine, self.batches, self.receiver, self.comm = loader, engine, batches, receiver, comm
        self.leader = comm.rank == 0
        self.store = batches.store if self.leader else None
        self.served = loader.version  # the index of the next batch to hand out
        self.outbox: list[dict[str, Any]] = []  # collected, not handed out yet, in order (the replies on rank 0)
        self.weights: Optional[int] = None  # the version of the engines' weights (None: dummy weights)
        self.pauses: list[float] = []  # update pauses since the last batch handed out
        self.e2e: list[float] = []

    def run(self) -> None:
        """Until the train side sets stop (or a batch could not be collected and its error was handed out)."""
        self.loader.between_ticks = self._service
        try:
            self._wait(lambda: self.weights is not None)  # the first weights: version = steps trained
            while True:
                # the next batch only while the batches collected and not trained stay within eta
                self._wait(lambda: self.loader.version - self.weights <= self.eta)
                try:
                    batch = self.loader.next_batch()
                except DynamicSamplingError as e:  # the trainer raises it: one error line, as colocated
                    self._hand_out({"error": str(e)})
                    self._wait(lambda: not self.outbox)
                    return
                # every response of the batch and every rank's share of the state, on the controller
                parts = self.comm.gather_objects((batch.local, self.loader.state_dict()))
                reply: dict[str, Any] = {}
                if self.leader:
                    reply = {
                        "groups": batch.groups,
                        "responses": {k: g for local, _ in parts for k, g in local.items()},
                        "stats": batch.stats,
                        "state": self.loader.merge_states([state for _, state in parts]),
                    }
                self._hand_out(reply)
                self.loader.scheduler.untrained_batches = self.loader.version - self.weights
        except _Stop:
            return

    def _hand_out(self, reply: dict[str, Any]) -> None:
        self.outbox.append(reply)
        if self.leader:
            self.store.set("dapo/ready", str(self.served + len(self.outbox) - 1))
        self._service(boundary=True)

    def _wait(self, done: Any) -> None:
        """At a batch boundary: serve the train side until done()."""
        while not done():
            if not self._service(boundary=True):
                time.sleep(self.POLL_S)

    def _service(self, boundary: bool = False) -> bool:
        """Hand out a wanted batch, then apply an update that has arrived, as rank 0 planned, then (at a batch
        boundary) evaluate an update marked for it; True if it did any. Raises _Stop once the train side has set
        stop and nothing is left to do."""
        plan = self.comm.broadcast_object(self._plan() if self.leader else None)
        if plan["error"]:
            raise RuntimeError(plan["error"])
        if plan["hand_out"]:
            reply = self.outbox.pop(0)
            if self.leader:
                if "stats" in reply:
                    reply["stats"] = {**reply["stats"], **self._update_stats()}
                self.batches.broadcast_object(reply, src=0)
            self.served += 1
        if plan["update"] is not None:
            self._apply_update(*plan["update"])
        evaluated = boundary and self.eval_pending is not None
        if evaluated:
            self._evaluate()
        if plan["stop"] and not evaluated:
            raise _Stop
        return plan["hand_out"] or plan["update"] is not None or evaluated

    def _plan(self) -> dict[str, Any]:
        """Rank 0: what the store says to do now."""
        plan: dict[str, Any] = {"error": None, "hand_out": False, "update": None, "stop": False}
        wanted = _wanted(self.store)
        if wanted is not None and wanted not in (self.served - 1, self.served):
            plan["error"] = f"rollout controller: the train side asks for batch {wanted}, the next is {self.served}"
            return plan
        plan["hand_out"] = bool(self.outbox) and wanted == self.served
        if self.store.check(["dapo/update"]):
            version, sent_at, evaluate = self.store.get("dapo/update").decode().split()
            if int(version) != self.weights:  # a new one: the sender waits in the broadcast until it is taken
                plan["update"] = (int(version), float(sent_at), evaluate == "1")
        plan["stop"] = not plan["hand_out"] and plan["update"] is None and self.store.check(["dapo/stop"])
        return plan

    def _apply_update(self, version: int, sent_at: float, evaluate: bool) -> None:
        """Update `version`, streamed into every engine between two of its steps; the groups in flight go on.
        evaluate: the train side waits for its evaluation."""
        expected = self.loader.version if self.weights is None else self.weights + 1
        if version != expected or self.receiver.begin() != version:
            raise RuntimeError(
                f"rollout controller: expected weight update {expected} (the engine holds "
                f"{'none' if self.weights is None else self.weights}), the train side sent {version}"
            )
        pause = self.engine.update_weights_in_flight(self.receiver.tensors(), version, self.recompute_kv)
        self.weights = self.loader.weights_version = version
        # admission counts the batches collected and not trained as started (sampler.max_staleness)
        self.loader.scheduler.untrained_batches = max(0, self.loader.version - version)
        self.pauses.append(self.comm.max([pause["pause_s"]])[0])  # the slowest engine's
        self.e2e.append(time.time() - sent_at)
        if evaluate:
            if self.held_out is None:
                raise RuntimeError(f"rollout controller: update {version} asks for evaluation, but eval.every is 0")
            self.eval_pending = version

    def _evaluate(self) -> None:
        """The held-out evaluation of the engines' weights (every rank), handed to the train side (rank 0)."""
        evaluator, prompts = self.held_out
        e = self.eval_cfg
        metrics = evaluator.evaluate(prompts, e.k, e.temperature, e.top_p, self.eval_tokens)
        if self.leader:
            self.store.set("dapo/evaluated", str(self.eval_pending))
            self.batches.broadcast_object({"eval": metrics, "version": self.eval_pending}, src=0)
        self.eval_pending = None

    def _update_stats(self) -> dict[str, float]:
        """The weight updates applied since the last batch handed out: the engines' pause, the end-to-end time
        (from the train side's key to applied, on the two sides' clocks) and the version now generating."""
        out = {
            "pipeline/updates": float(len(self.pauses)),
            "pipeline/update_pause_s": sum(self.pauses),
            "pipeline/update_e2e_s": max(self.e2e, default=0.0),
            "pipeline/weights_version": float(self.weights if self.weights is not None else -1),
        }
        self.pauses, self.e2e = [], []
        return out


# ----------------------------------------------------------------------------- the train side's end


class RemoteRollout:
    """What a train rank holds of the rollout side, with the colocated loader's interface: next_batch() asks the
    controller for a batch, state_dict() is the loader's state that came with the last batch (what the trainer's
    checkpoint saves), load_state_dict() keeps a checkpoint's for start() to hand over; send_weights() streams the
    bridge's buckets to the controller."""

    POLL_S = 0.005
    """How often a train rank waiting for a batch looks at the store."""

    def __init__(self, transport: Transport, rank: int, rollout_procs: int, backend: str) -> None:
        from megatron_dapo.rollout.weight_transport import WeightSender

        self.rank = rank  # this process's train rank
        self.batches, weights = transport.connect("train", rank, rollout_procs, backend)
        self.store = self.batches.store
        self.sender = WeightSender(weights)
        self.state: Optional[dict[str, Any]] = None
        self.batch = 0  # the index of the next batch to ask for
        self.evaluating: Optional[int] = None  # the version sent for evaluation, its result not received yet
        self.evaluated = -1  # the last version whose evaluation this rank received

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

    def start(self) -> None:
        """Hand the controller the state to resume from (None: a fresh run); learn what its engine loads."""
        self.batches.broadcast_object({"cmd": "start", "state": self.state} if self.rank == 0 else None, src=1)
        reply = self.batches.broadcast_object(None, src=0)
        self.sender.weight_format, self.batch = reply["weight_format"], reply["batch"]

    def next_batch(self) -> StepBatch:
        """The controller's next batch; every response of it is on every train rank (`local`)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.store.set("dapo/want", str(self.batch))
        while not self.store.check(["dapo/ready"]) or int(self.store.get("dapo/ready")) < self.batch:
            self._no_unasked_evaluation()
            time.sleep(self.POLL_S)  # no collective timeout while the batch is collected
        reply = self.batches.broadcast_object(None, src=0)
        self.batch += 1
        if "error" in reply:
            raise DynamicSamplingError(reply["error"])
        if "groups" not in reply:  # the two sides disagree on what comes next: fail now, never wait
            raise RuntimeError(f"rollout controller: expected batch {self.batch - 1}, got {sorted(reply)}")
        self.state = reply["state"]
        stats = {**reply["stats"], "timing/batch_wait": time.perf_counter() - t0}
        return StepBatch(groups=reply["groups"], local=reply["responses"], stats=stats)

    def send_weights(self, bridge: Any, version: int, evaluate: bool = False) -> dict[str, float]:
        """Every train rank iterates the bridge (it is collective); train rank 0 sends, after saying so in the store
        (the controller joins the broadcast between two of its ticks). evaluate: the rollout side evaluates
        these weights; evaluation() waits for the result."""
        if self.rank == 0:
            self.store.set("dapo/update", f"{version} {time.time()!r} {int(evaluate)}")
        self.evaluating = version if evaluate else None
        self.sender.begin(version)
        metrics = bridge.sync(self.sender)
        return {**metrics, **self.sender.stats}

    def _no_unasked_evaluation(self) -> None:
        """An evaluation the train side did not mark waits in the controller's broadcast for a receiver that never
        comes: fail at once instead."""
        if self.store.check(["dapo/evaluated"]) and int(self.store.get("dapo/evaluated")) > self.evaluated:
            raise RuntimeError(
                f"rollout controller: evaluated update {int(self.store.get('dapo/evaluated'))}, which the train side "
                f"did not mark for evaluation (last evaluated: {self.evaluated})"
            )

    def evaluation(self) -> dict[str, float]:
        """The rollout side's held-out evaluation of the weights last sent (send_weights(..., evaluate=True))."""
        if self.evaluating is None:
            raise RuntimeError("evaluation() without weights sent for evaluation")
        while not self.store.check(["dapo/evaluated"]) or int(self.store.get("dapo/evaluated")) < self.evaluating:
            time.sleep(self.POLL_S)  # the controller evaluates at its next batch boundary
        reply = self.batches.broadcast_object(None, src=0)
        if reply.get("version") != self.evaluating:
            raise RuntimeError(f"rollout controller: expected the evaluation of {self.evaluating}, got {reply!r}")
        self.evaluated, self.evaluating = self.evaluating, None
        return reply["eval"]

    def close(self) -> None:
        """Tell the controller to stop (it looks between ticks, and while it waits)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):  # a controller already gone (its store with it) ended the run
                self.store.set("dapo/stop", "1")
