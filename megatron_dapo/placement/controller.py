"""Asynchronous DAPO's rollout side (pipeline.mode=async; docs/async.md): its processes' entry point and controller.

The rollout side is pipeline.rollout_gpus processes (one, or a torch.distributed world of its own started by torchrun),
each running a vLLM engine, a reward pool and the dynamic-sampling loader exactly as a colocated rank does: in
lockstep, one engine per rollout.tp of them. Its rank 0 is the controller, the only one that talks to the train side;
what it decides between two ticks it broadcasts to the others, so every rank hands out, updates and stops at the same
tick. The train side is Megatron's world (any TP x PP x DP), whose end is remote.py's RemoteRollout. They meet in
two transport groups hosted by the controller at DAPO_TRANSPORT=host:port (transport.py): batches, whose TCP store
holds the keys below, and weights.

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

import logging
import time
from pathlib import Path
from typing import Any, Optional

from megatron_dapo import progress
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.model.comm import Comm
from megatron_dapo.placement.colocated import build_rollout_parts
from megatron_dapo.placement.transport import Transport, transport_backend
from megatron_dapo.sampling.loader import DynamicSamplingError

log = logging.getLogger("megatron_dapo.placement")


def run_rollout(cfg: Config) -> None:
    """A rollout process: build the engine, pool, evaluator and loader (as a colocated rank does: colocated.py),
    then serve the train side until it says stop."""
    from transformers import AutoTokenizer

    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.model.parallel import arm_group_timeouts, env_place, init_plain_world
    from megatron_dapo.rollout.weight_transport import WeightReceiver

    rank, world, _ = env_place()
    if world != cfg.pipeline.rollout_gpus:
        raise ConfigError(
            f"config field pipeline.rollout_gpus={cfg.pipeline.rollout_gpus!r}: expected the rollout side's processes "
            f"(WORLD_SIZE={world}): one per GPU, started together (torchrun --nproc-per-node on one node)"
        )
    transport = Transport.from_env()
    tokenizer = AutoTokenizer.from_pretrained(Path(cfg.model.hf_path))
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    parts = None
    try:
        # its own torch.distributed world (several processes: the loaders' collectives, the engines' groups)
        timeout_s = cfg.trainer.collective_timeout_s
        comm = Comm(init_plain_world(timeout_s))
        # never asleep: the engines here generate while the train side trains
        parts = build_rollout_parts(cfg, tokenizer, dataset, comm, enable_sleep_mode=False)
        arm_group_timeouts(timeout_s)  # the engine's groups too (vLLM makes them with torch's default)
        held_out = None
        if cfg.eval.every:
            held_out = (parts.held_out, list(PromptDataset.from_config(cfg.data, tokenizer, split="val")))
        batches, weights = transport.connect("rollout", rank, world, transport_backend(cfg), timeout_s)
        start = _expect(batches.broadcast_object(None, src=1), "start") if rank == 0 else None
        state = comm.broadcast_object(start["state"] if rank == 0 else None)
        loader = parts.loader
        if state is not None:
            loader.load_state_dict(state, merged=True)
        if rank == 0:
            batches.broadcast_object({"weight_format": parts.engine.weight_format, "batch": loader.version}, src=0)
        receiver = WeightReceiver(weights, src=world)
        RolloutController(cfg, loader, parts.engine, batches, receiver, comm, held_out).run()
    finally:
        if parts is not None:
            parts.close()


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
    between-ticks service is this controller's). engine: the VLLMEngine it drives. batches: the batches TransportGroup (rank 0; None
    elsewhere). receiver: a WeightReceiver over the weights group. comm: the rollout side's Comm. held_out:
    (HeldOutEval, the validation prompts) where eval.every > 0.

    An update the train side marks for evaluation is evaluated at the next batch boundary (where no group is in
    flight: the groups still generating at a batch's end are paused), before anything else is collected; the train
    side waits for the result (RemoteRollout.held_out), so no later update can land first.
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
        self.timeout_s = cfg.trainer.collective_timeout_s  # the longest wait for the train side

    def run(self) -> None:
        """Until the train side sets stop (or a batch could not be collected and its error was handed out)."""
        self.loader.run_between_ticks(self._service)
        try:
            self._wait(lambda: self.weights is not None)  # the first weights: version = steps trained
            while True:
                # the next batch only while the batches collected and not trained stay within eta
                self._wait(lambda: self.loader.version - self.weights <= self.eta)
                progress.set_phase("collect", step=self.loader.version + 1)  # the step this batch trains
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
                self.loader.weights_updated(self.weights)  # admission counts the batch handed out as started
        except _Stop:
            return

    def _hand_out(self, reply: dict[str, Any]) -> None:
        self.outbox.append(reply)
        if self.leader:
            self.store.set("dapo/ready", str(self.served + len(self.outbox) - 1))
        self._service(boundary=True)

    def _wait(self, done: Any) -> None:
        """At a batch boundary: serve the train side until done(), at most trainer.collective_timeout_s without its
        asking for anything (TimeoutError)."""
        deadline = time.monotonic() + self.timeout_s
        with progress.waiting("the train side"):
            while not done():
                if self._service(boundary=True):
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rollout controller: the train side asked for nothing within trainer.collective_timeout_s="
                        f"{self.timeout_s:g} s (the next batch is {self.served}; the engines hold weights "
                        f"{'none' if self.weights is None else self.weights})"
                    )
                else:
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
        with progress.phase("weight update"):
            pause = self.engine.update_weights_in_flight(self.receiver.tensors(), version, self.recompute_kv)
        self.weights = version
        self.loader.weights_updated(version)  # tokens are tagged with it from here on
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
        with progress.phase("evaluate"):
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
