"""Wall time per named phase of a step, for the progress line and the timing/* metrics; which metrics are not times."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_dapo import progress


class PhaseTimer:
    """`with timer.phase("train"): ...` adds the block's seconds to timer.seconds["train"], and is this process's
    phase for the stall watchdog (progress.py) meanwhile.

    elapsed(): seconds since the timer was made, so time between phases still counts toward the step.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            with progress.phase(name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# the metric families a rerun with the same seed must reproduce (timing/, perf/ and weight_sync/ are clocks)
DETERMINISTIC = ("reward/", "sampler/", "skip/", "actor/", "response/", "trainer/", "rollout/", "eval/", "step")


def comparable(m: dict) -> dict:
    """The metrics a rerun must reproduce: not times, and not bytes moved between ranks (they depend on the layout)."""
    return {k: v for k, v in m.items() if k.startswith(DETERMINISTIC) and "seconds" not in k and "bytes" not in k}
