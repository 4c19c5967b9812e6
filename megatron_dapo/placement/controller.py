"""Asynchronous DAPO's rollout side (pipeline.mode=async; docs/async.md): its processes' entry point and controller.

The rollout side is pipeline.rollout_gpus processes (one, or a torch.distributed world of its own started by torchrun),
each running a vLLM engine, a reward pool and the dynamic-sampling loader exactly as a colocated rank does: in
lockstep, one engine per rollout.tp of them. Its rank 0 is the controller, the only one that talks to the train side;
what it decides between two ticks it broadcasts to the others, so every rank hands out, updates and stops at the same
tick. The train side is Megatron's world (any TP x PP x DP), whose end is remote.py's RemoteRollout. They meet in
two transport groups hosted by the controller at DAPO_TRANSPORT=host:port (transport.py): batches, whose TCP store
holds the keys below, and weights.

At start, two broadcasts: train rank 0 -> all {"cmd": "start", "state": loader state to resume from, or None,
"split": the TrainSplit}; controller -> all {"weight_format": the engine's, "batch": the index of the next batch}.
After that neither side waits for the other except where it must, each saying in the store what it is ready for:

    dapo/update = "V T":   train rank 0 is sending update V (V = steps trained; T its clock) over the weights group
    dapo/evaluate/N:       the train side's N-th evaluation request (pickled {"version": V, "request": EvalRequest}),
                           set before the update it asks about is announced
    dapo/want = K:         train rank 0 asks for batch K; every train rank waits until dapo/ready >= K, then receives
                           its own reply: the groups and stats, the responses it trains (TrainSplit), and on train
                           rank 0 the loader's state after the batch; or {"error": ...}
    dapo/ready = K:        the controller has collected batches up to K, and sends K once it is wanted
    dapo/evaluated = N:    the controller has run request N (at a batch boundary with the engines holding weights V:
                           no group in flight) and broadcasts the result; the train ranks receive every result they
                           asked for before they ask for another batch
    dapo/stop:             train rank 0, at the end

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from megatron_dapo import progress, safe_pickle
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.model.comm import Comm
from megatron_dapo.placement.colocated import build_rollout_parts
from megatron_dapo.placement.evaluation import Evaluator
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.placement.transport import Transport, transport_backend
from megatron_dapo.sampling.loader import DynamicSamplingError, DynamicSamplingLoader, LoaderState, StepBatch
from megatron_dapo.types import EvalRequest, Response

if TYPE_CHECKING:
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_transport import TransportGroup, WeightReceiver

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
        batches, weights = transport.connect("rollout", rank, world, transport_backend(cfg), timeout_s)
        serve(cfg, parts.loader, parts.engine, parts.evaluator, batches, WeightReceiver(weights, src=world), comm)
    finally:
        if parts is not None:
            parts.close(exiting=True)  # the rollout process ends here


def serve(
    cfg: Config,
    loader: DynamicSamplingLoader,
    engine: VLLMEngine,
    evaluator: Evaluator,
    batches: Optional[TransportGroup],
    receiver: WeightReceiver,
    comm: Comm,
) -> None:
    """The start (the loader state to resume from and the TrainSplit from train rank 0; the engine's weight format and
    the next batch's index back), then the controller until the train side says stop. batches: rank 0's (None
    elsewhere)."""
    start = _expect(batches.broadcast_object(None, src=1), "start") if batches is not None else None
    state, shares = comm.broadcast_object((start["state"], start["split"]) if start is not None else None)
    split = TrainSplit(shares["mini_batch_size"], shares["dp"], tuple(shares["dp_rank_of"]))
    if state is not None:
        loader.load_state_dict(state)
    if batches is not None:
        batches.broadcast_object({"weight_format": engine.weight_format, "batch": loader.version}, src=0)
    RolloutController(
        loader,
        engine,
        batches,
        receiver,
        comm,
        evaluator,
        split,
        eta=cfg.sampler.max_staleness,
        recompute_kv=cfg.pipeline.recompute_kv,
        timeout_s=cfg.trainer.collective_timeout_s,
    ).run()


def _expect(msg: Any, *cmds: str) -> dict:
    if not isinstance(msg, dict) or msg.get("cmd") not in cmds:
        raise RuntimeError(
            f"rollout controller: expected a {' or '.join(cmds)} command from the train side, got {msg!r}"
        )
    return msg


def batch_replies(
    batch: StepBatch, responses: Mapping[int, Sequence[Response]], state: Optional[LoaderState], split: TrainSplit
) -> Iterator[dict[str, Any]]:
    """Each train rank's reply for a batch, in train rank order: the groups and stats (every rank), the responses it
    trains ({(key, j): Response}, split.wanted_by) and, on train rank 0 only, the loader state after the batch (what
    its checkpoint holds; None elsewhere). responses: every response of the batch by group key."""
    wanted = split.wanted_by(batch.groups)
    for rank in range(len(split.dp_rank_of)):
        yield {
            "groups": batch.groups,
            "stats": batch.stats,
            "responses": {(key, j): responses[key][j] for key, j in wanted(rank)},
            "state": state if rank == 0 else None,
        }


def _wanted(store: Any) -> Optional[int]:
    """The batch train rank 0 asks for (None: none yet)."""
    return int(store.get("dapo/want")) if store.check(["dapo/want"]) else None


class _Stop(Exception):
    """The train side set dapo/stop."""


class RolloutController:
    """Collects batches ahead of training within eta, hands each out when it is wanted, applies each weight update
    as it arrives; what it decides depends on engine ticks and completed batches (the loader's), never on wall time.

    Runs on every rollout rank; rank 0 (the controller proper) reads the store and broadcasts its plan over `comm`,
    so every rank's loader, engine and receiver take the same steps. loader: the DynamicSamplingLoader, which it
    drives (a TickDriver: the weights the engines hold, its service between ticks). engine: the VLLMEngine it
    drives. batches: the batches TransportGroup (rank 0; None elsewhere). receiver: a WeightReceiver over the weights
    group. comm: the rollout side's Comm. evaluator: the engines' Evaluator. split: which train rank trains which
    response (each gets only those). eta: sampler.max_staleness, how many batches collection may run ahead of
    training. recompute_kv: pipeline.recompute_kv, whether an update re-reads the context of the groups in flight.
    timeout_s: trainer.collective_timeout_s, the longest wait for the train side.

    An evaluation request runs at the first batch boundary (where no group is in flight: the groups still generating
    at a batch's end are paused) at which the engines hold the weights it asks about, before anything else is
    collected; the train side receives the result before it asks for another batch, so no later update can land
    first.
    """

    POLL_S = 0.005
    """How often a controller with nothing to do looks at the store."""

    def __init__(
        self,
        loader: DynamicSamplingLoader,
        engine: VLLMEngine,
        batches: Optional[TransportGroup],
        receiver: WeightReceiver,
        comm: Comm,
        evaluator: Evaluator,
        split: TrainSplit,
        *,
        eta: int,
        recompute_kv: bool,
        timeout_s: float,
    ) -> None:
        self.eta = eta
        self.evaluator, self.split = evaluator, split
        self.asked = 0  # evaluation requests read from the store (the next one's number)
        self.evaluations: list[tuple[int, int, EvalRequest]] = []  # (number, version, request) not run yet
        self.recompute_kv = recompute_kv
        self.loader, self.engine, self.batches, self.receiver, self.comm = loader, engine, batches, receiver, comm
        self.leader = comm.rank == 0
        self.store = batches.store if batches is not None else None
        self.served = loader.version  # the index of the next batch to hand out
        self.outbox: list[list[dict[str, Any]]] = []  # collected, not handed out yet, in order (rank 0: per train rank)
        self.weights_version: Optional[int] = None  # the version of the engines' weights (None: dummy weights)
        self.pauses: list[float] = []  # update pauses since the last batch handed out
        self.e2e: list[float] = []
        self.timeout_s = timeout_s

    # the loader's TickDriver
    def weights(self) -> int:
        if self.weights_version is None:
            raise RuntimeError("rollout controller: collecting before the first weights arrived")
        return self.weights_version

    def between_ticks(self) -> None:
        self._service()

    def run(self) -> None:
        """Until the train side sets stop (or a batch could not be collected and its error was handed out)."""
        try:
            self._wait(lambda: self.weights_version is not None)  # the first weights: version = steps trained
            while True:
                # the next batch only while the batches collected and not trained stay within eta
                self._wait(lambda: self.loader.version - self.weights_version <= self.eta)
                progress.set_phase("collect", step=self.loader.version + 1)  # the step this batch trains
                try:
                    batch = self.loader.next_batch(self)
                except DynamicSamplingError as e:  # the trainer raises it: one error line, as colocated
                    self._hand_out([{"error": str(e)}] * len(self.split.dp_rank_of))
                    self._wait(lambda: not self.outbox)
                    return
                # every response of the batch and every rank's share of the state, on the controller
                parts = self.comm.gather_objects((batch.local, self.loader.state_dict()))
                replies: list[dict[str, Any]] = []
                if self.leader:
                    responses = {k: g for local, _ in parts for k, g in local.items()}
                    state = DynamicSamplingLoader.merge_states([state for _, state in parts])
                    replies = list(batch_replies(batch, responses, state, self.split))
                self._hand_out(replies)
        except _Stop:
            return

    def _hand_out(self, replies: list[dict[str, Any]]) -> None:
        """A batch's replies, one per train rank (rank 0; empty elsewhere), in the outbox."""
        self.outbox.append(replies)
        if self.leader:
            self.store.set("dapo/ready", str(self.served + len(self.outbox) - 1))
        self._service(boundary=True)

    def _wait(self, done: Callable[[], bool]) -> None:
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
                        f"{'none' if self.weights_version is None else self.weights_version})"
                    )
                else:
                    time.sleep(self.POLL_S)

    def _service(self, boundary: bool = False) -> bool:
        """Hand out a wanted batch, then apply an update that has arrived, as rank 0 planned, then (at a batch
        boundary) run the evaluations asked about the engines' weights; True if it did any. Raises _Stop once the
        train side has set stop and nothing is left to do (what it asked for and stopped waiting for included)."""
        plan = self.comm.broadcast_object(self._plan() if self.leader else None)
        if plan["error"]:
            raise RuntimeError(plan["error"])
        if plan["stop"]:
            raise _Stop
        if plan["hand_out"]:
            replies = self.outbox.pop(0)
            if self.leader:
                if "stats" in replies[0]:
                    stats = {**replies[0]["stats"], **self._update_stats()}
                    replies = [{**reply, "stats": stats} for reply in replies]
                self.batches.scatter_object([{}, *replies], src=0)
            self.served += 1
        if plan["update"] is not None:
            self._apply_update(*plan["update"])
        if plan["evaluate"] is not None:
            self.evaluations.append((self.asked, plan["evaluate"]["version"], plan["evaluate"]["request"]))
            self.asked += 1
        evaluated = boundary and self._evaluate()
        return plan["hand_out"] or plan["update"] is not None or plan["evaluate"] is not None or evaluated

    def _plan(self) -> dict[str, Any]:
        """Rank 0: what the store says to do now."""
        plan: dict[str, Any] = {"error": None, "hand_out": False, "update": None, "evaluate": None, "stop": False}
        wanted = _wanted(self.store)
        if wanted is not None and wanted not in (self.served - 1, self.served):
            plan["error"] = f"rollout controller: the train side asks for batch {wanted}, the next is {self.served}"
            return plan
        plan["hand_out"] = bool(self.outbox) and wanted == self.served
        if self.store.check(["dapo/update"]):
            version, sent_at = self.store.get("dapo/update").decode().split()
            if int(version) != self.weights_version:  # a new one: the sender waits in the broadcast until it is taken
                plan["update"] = (int(version), float(sent_at))
        key = f"dapo/evaluate/{self.asked}"  # read after the update: a request about it is set before it
        if self.store.check([key]):
            plan["evaluate"] = safe_pickle.loads(self.store.get(key), f"the train side's {key}")
        plan["stop"] = not plan["hand_out"] and plan["update"] is None and self.store.check(["dapo/stop"])
        return plan

    def _apply_update(self, version: int, sent_at: float) -> None:
        """Update `version`, streamed into every engine between two of its steps; the groups in flight go on, their
        later tokens tagged with it (the loader asks weights() after every tick)."""
        expected = self.loader.version if self.weights_version is None else self.weights_version + 1
        if version != expected or self.receiver.begin() != version:
            raise RuntimeError(
                f"rollout controller: expected weight update {expected} (the engine holds "
                f"{'none' if self.weights_version is None else self.weights_version}), the train side sent {version}"
            )
        with progress.phase("weight update"):
            pause = self.engine.update_weights_in_flight(self.receiver.tensors(), version, self.recompute_kv)
        self.weights_version = version
        self.pauses.append(self.comm.max([pause["pause_s"]])[0])  # the slowest engine's
        self.e2e.append(time.time() - sent_at)

    def _evaluate(self) -> bool:
        """At a batch boundary: run the requests about the engines' weights, in order (every rank), each result
        handed to the train side (rank 0); True if it ran any. A request about older weights is an error: the train
        side receives every result before it sends newer ones."""
        ran = False
        while self.evaluations and self.evaluations[0][1] == self.weights_version:
            number, version, request = self.evaluations.pop(0)
            with progress.phase("evaluate"):
                metrics = self.evaluator.run(request)
            if self.leader:
                self.store.set("dapo/evaluated", str(number))
                self.batches.broadcast_object({"evaluation": number, "version": version, "eval": metrics}, src=0)
            ran = True
        if self.evaluations and self.weights_version is not None and self.evaluations[0][1] < self.weights_version:
            number, version, _ = self.evaluations[0]
            raise RuntimeError(
                f"rollout controller: evaluation {number} asks about weights {version}, the engines hold "
                f"{self.weights_version} already"
            )
        return ran

    def _update_stats(self) -> dict[str, float]:
        """The weight updates applied since the last batch handed out: the engines' pause, the end-to-end time
        (from the train side's key to applied, on the two sides' clocks) and the version now generating."""
        out = {
            "pipeline/updates": float(len(self.pauses)),
            "pipeline/update_pause_s": sum(self.pauses),
            "pipeline/update_e2e_s": max(self.e2e, default=0.0),
            "pipeline/weights_version": float(self.weights_version if self.weights_version is not None else -1),
        }
        self.pauses, self.e2e = [], []
        return out
