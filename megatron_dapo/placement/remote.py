"""The train side's end of asynchronous DAPO (pipeline.mode=async): a `Rollout` whose engines and loader run in the
rollout processes (controller.py), reached through the transport groups and the keys of their TCP store (the
protocol: controller.py's docstring)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

from megatron_dapo import progress
from megatron_dapo.config import ConfigError
from megatron_dapo.placement.transport import Transport
from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.loader import DynamicSamplingError, StepBatch
from megatron_dapo.types import Prompt, Response


class RemoteRollout:
    """What a train rank holds of the rollout side: next_batch() asks the controller for a batch, state_dict() is
    the loader's state that came with the last batch (what the trainer's checkpoint saves), load_state_dict() keeps a
    checkpoint's for start() to hand over; sync() streams the bridge's buckets to the controller."""

    POLL_S = 0.005
    """How often a train rank waiting for a batch looks at the store."""

    def __init__(self, transport: Transport, rank: int, rollout_procs: int, backend: str, timeout_s: float) -> None:
        from megatron_dapo.rollout.weight_transport import WeightSender

        self.rank = rank  # this process's train rank
        self.timeout_s = timeout_s  # trainer.collective_timeout_s: the longest this side waits for the other
        self.batches, weights = transport.connect("train", rank, rollout_procs, backend, timeout_s)
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
        with progress.waiting("the rollout side (its start)"):
            self.batches.broadcast_object({"cmd": "start", "state": self.state} if self.rank == 0 else None, src=1)
            reply = self.batches.broadcast_object(None, src=0)
        self.sender.weight_format, self.batch = reply["weight_format"], reply["batch"]

    def next_batch(self) -> StepBatch:
        """The controller's next batch; every response of it is on every train rank (`local`)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.store.set("dapo/want", str(self.batch))
        with progress.waiting(f"the rollout side (batch {self.batch})"):
            self._poll(
                lambda: self.store.check(["dapo/ready"]) and int(self.store.get("dapo/ready")) >= self.batch,
                f"batch {self.batch}",
                self._no_unasked_evaluation,
            )
            reply = self.batches.broadcast_object(None, src=0)
        self.batch += 1
        if "error" in reply:
            raise DynamicSamplingError(reply["error"])
        if "groups" not in reply:  # the two sides disagree on what comes next: fail now, never wait
            raise RuntimeError(f"rollout controller: expected batch {self.batch - 1}, got {sorted(reply)}")
        self.state = reply["state"]
        stats = {**reply["stats"], "timing/batch_wait": time.perf_counter() - t0}
        return StepBatch(groups=reply["groups"], local=reply["responses"], stats=stats)

    def responses(
        self, batch: StepBatch, wanted_by: Callable[[int], list[SampleId]]
    ) -> tuple[dict[SampleId, Response], float]:
        """The controller sent every response to every train rank: nothing moves here."""
        return {(key, j): r for key, group in batch.local.items() for j, r in enumerate(group)}, 0.0

    def sync(self, bridge: Any, version: int, evaluate: bool = False) -> dict[str, float]:
        """Every train rank iterates the bridge (it is collective); train rank 0 sends, after saying so in the store
        (the controller joins the broadcast between two of its ticks). evaluate: the rollout side evaluates
        these weights; held_out() waits for the result."""
        if self.rank == 0:
            self.store.set("dapo/update", f"{version} {time.time()!r} {int(evaluate)}")
        self.evaluating = version if evaluate else None
        self.sender.begin(version)
        metrics = bridge.sync(self.sender, version)
        return {**metrics, **self.sender.stats}

    def _poll(self, ready: Callable[[], bool], what: str, check: Callable[[], None] = lambda: None) -> None:
        """Look at the store until ready() (and check() each time), at most trainer.collective_timeout_s
        (TimeoutError naming what)."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the rollout side did not hand over {what} within trainer.collective_timeout_s={self.timeout_s:g} "
                    "s (its processes' own errors, if any, are in the log)"
                )
            time.sleep(self.POLL_S)

    def _no_unasked_evaluation(self) -> None:
        """An evaluation the train side did not mark waits in the controller's broadcast for a receiver that never
        comes: fail at once instead."""
        if self.store.check(["dapo/evaluated"]) and int(self.store.get("dapo/evaluated")) > self.evaluated:
            raise RuntimeError(
                f"rollout controller: evaluated update {int(self.store.get('dapo/evaluated'))}, which the train side "
                f"did not mark for evaluation (last evaluated: {self.evaluated})"
            )

    def evaluate(
        self, prompts: list[Prompt], k: int, temperature: float, top_p: float, max_tokens: int
    ) -> dict[str, float]:
        raise ConfigError("pipeline.mode=async: the rollout side evaluates data.val_files (eval.every) only")

    def held_out(self) -> dict[str, float]:
        """The rollout side's held-out evaluation of the weights last sent (sync(..., evaluate=True))."""
        if self.evaluating is None:
            raise RuntimeError("held_out() without weights sent for evaluation")
        with progress.waiting(f"the rollout side (the evaluation of update {self.evaluating})"):
            self._poll(  # the controller evaluates at its next batch boundary
                lambda: (
                    self.store.check(["dapo/evaluated"]) and int(self.store.get("dapo/evaluated")) >= self.evaluating
                ),
                f"the held-out evaluation of update {self.evaluating}",
            )
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
