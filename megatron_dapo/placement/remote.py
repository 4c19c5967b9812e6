"""The train side's end of asynchronous DAPO (pipeline.mode=async): a `Rollout` whose engines and loader run in the
rollout processes (controller.py), reached through the transport groups and the keys of their TCP store (the
protocol: controller.py's docstring)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_dapo import progress, safe_pickle
from megatron_dapo.placement.evaluation import Evaluation, Synced
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.placement.transport import Transport
from megatron_dapo.rollout.engine import WeightSource
from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.loader import DynamicSamplingError, LoaderState, StepBatch
from megatron_dapo.types import EvalRequest, Response


@dataclass
class DeliveredBatch(StepBatch):
    """A batch as a train rank receives it from the rollout side: no responses of its own (local is empty), the
    ones it trains already delivered."""

    delivered: dict[SampleId, Response] = field(default_factory=dict)
    """(key, j) -> Response for every id this rank trains (TrainSplit.wanted_by)."""


class RemoteRollout:
    """What a train rank holds of the rollout side: next_batch() asks the controller for a batch, which brings this
    rank's share of the responses (and, on train rank 0, the loader state after it: what the trainer's checkpoint
    saves); sync() streams the bridge's buckets to the controller; each evaluation asked for is a numbered request in
    the store, whose result the controller broadcasts."""

    POLL_S = 0.005
    """How often a train rank waiting for a batch looks at the store."""

    def __init__(
        self, transport: Transport, rank: int, rollout_procs: int, backend: str, timeout_s: float, split: TrainSplit
    ) -> None:
        from megatron_dapo.rollout.weight_transport import WeightSender

        self.rank = rank  # this process's train rank
        self.split = split
        self.timeout_s = timeout_s  # trainer.collective_timeout_s: the longest this side waits for the other
        self.batches, weights = transport.connect("train", rank, rollout_procs, backend, timeout_s)
        self.store = self.batches.store
        self.sender = WeightSender(weights)
        self.state: Optional[LoaderState] = None  # train rank 0's: the loader's after the last batch
        self.batch = 0  # the index of the next batch to ask for
        self.version: Optional[int] = None  # the weights last sent
        self.asked = 0  # evaluations asked for so far (the next one's number)
        self.pending: list[tuple[int, Evaluation]] = []  # (number, evaluation) whose result has not come yet

    def state_dict(self) -> Optional[LoaderState]:
        return self.state

    def start(self, state: Optional[LoaderState], weights: WeightSource, version: int) -> None:
        """Hand the controller the state to resume from (None: a fresh run) and the split it sends responses by;
        learn what its engine loads; send the first weights."""
        with progress.waiting("the rollout side (its start)"):
            start = {"cmd": "start", "state": state, "split": asdict(self.split)}
            self.batches.broadcast_object(start if self.rank == 0 else None, src=1)
            reply = self.batches.broadcast_object(None, src=0)
        self.sender.weight_format, self.batch = reply["weight_format"], reply["batch"]
        self.state = state if self.rank == 0 else None
        self.sync(weights, version)

    def next_batch(self) -> DeliveredBatch:
        """The controller's next batch, with the responses this rank trains: every evaluation asked for comes first
        (the controller ran it at a batch boundary before this batch was handed out)."""
        self._settle(len(self.pending))
        t0 = time.perf_counter()
        if self.rank == 0:
            self.store.set("dapo/want", str(self.batch))
        with progress.waiting(f"the rollout side (batch {self.batch})"):
            self._poll(
                lambda: self.store.check(["dapo/ready"]) and int(self.store.get("dapo/ready")) >= self.batch,
                f"batch {self.batch}",
            )
            received = self.batches.bytes_received
            reply = self.batches.scatter_object(None, src=0)
        self.batch += 1
        if "error" in reply:
            raise DynamicSamplingError(reply["error"])
        if "groups" not in reply:  # the two sides disagree on what comes next: fail now, never wait
            raise RuntimeError(f"rollout controller: expected batch {self.batch - 1}, got {sorted(reply)}")
        if self.rank == 0:
            self.state = reply["state"]
        stats = {
            **reply["stats"],
            "timing/batch_wait": time.perf_counter() - t0,
            "pipeline/batch_bytes": float(self.batches.bytes_received - received),
        }
        return DeliveredBatch(groups=reply["groups"], local={}, stats=stats, delivered=reply["responses"])

    def responses(self, batch: StepBatch) -> tuple[dict[SampleId, Response], float]:
        """The responses the controller sent this rank with the batch: nothing moves here."""
        if not isinstance(batch, DeliveredBatch):
            raise TypeError(f"RemoteRollout.responses: expected a batch of its own next_batch(), got {type(batch)}")
        return batch.delivered, 0.0

    def sync(self, weights: WeightSource, version: int, evaluate: Optional[EvalRequest] = None) -> Synced:
        """Every train rank iterates the bridge (it is collective); train rank 0 sends, after saying so in the store
        (the controller joins the broadcast between two of its ticks). evaluate: asked for before the update is
        announced, so the controller evaluates at the first batch boundary after it applies these weights."""
        self._settle(len(self.pending))  # what was asked about the weights before these comes first
        evaluation = None if evaluate is None else self._ask(version, evaluate)
        if self.rank == 0:
            self.store.set("dapo/update", f"{version} {time.time()!r}")
        self.sender.begin(version)
        metrics = weights.sync(self.sender, version)
        self.version = version
        return Synced({**metrics, **self.sender.stats}, evaluation)

    def evaluate(self, request: EvalRequest) -> Evaluation:
        """An evaluation of the weights last sent; the controller runs it at its next batch boundary."""
        if self.version is None:
            raise RuntimeError("evaluate(): no weights sent yet (start() sends the first)")
        return self._ask(self.version, request)

    def _ask(self, version: int, request: EvalRequest) -> Evaluation:
        """Request number `asked`, in the store (dapo/evaluate/N) for the controller to read."""
        number = self.asked
        if self.rank == 0:
            self.store.set(f"dapo/evaluate/{number}", safe_pickle.dumps({"version": version, "request": request}))
        self.asked += 1
        evaluation = Evaluation(version, request, lambda e: self._settle(self._position(e) + 1))
        self.pending.append((number, evaluation))
        return evaluation

    def _position(self, evaluation: Evaluation) -> int:
        return next(i for i, (_, e) in enumerate(self.pending) if e is evaluation)

    def _settle(self, count: int) -> None:
        """Receive the results of the first `count` pending evaluations, in the order they were asked for."""
        for _ in range(count):
            number, evaluation = self.pending[0]
            with progress.waiting(f"the rollout side (evaluation {number}, of weights {evaluation.version})"):
                self._poll(  # the controller evaluates at its next batch boundary
                    lambda n=number: (
                        self.store.check(["dapo/evaluated"]) and int(self.store.get("dapo/evaluated")) >= n
                    ),
                    f"evaluation {number} (of weights {evaluation.version})",
                )
                reply = self.batches.broadcast_object(None, src=0)
            if reply.get("evaluation") != number:
                raise RuntimeError(f"rollout controller: expected the result of evaluation {number}, got {reply!r}")
            self.pending.pop(0)
            evaluation.resolve(reply["eval"])

    def _poll(self, ready: Callable[[], bool], what: str) -> None:
        """Look at the store until ready(), at most trainer.collective_timeout_s (TimeoutError naming what)."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the rollout side did not hand over {what} within trainer.collective_timeout_s={self.timeout_s:g} "
                    "s (its processes' own errors, if any, are in the log)"
                )
            time.sleep(self.POLL_S)

    def close(self, *, exiting: bool = False) -> None:
        """Tell the controller to stop (it looks between ticks, and while it waits). exiting changes nothing here: the
        engines are the rollout processes', which close them as they exit (controller.run_rollout)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):  # a controller already gone (its store with it) ended the run
                self.store.set("dapo/stop", "1")
