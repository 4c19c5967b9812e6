"""Where this process is, for the stall watchdog (launch/watchdog.py): its phase, a counter of progress points and
whether it is waiting on other processes; and the fault points the tests name (DAPO_FAULT).

Progress points are the places a healthy run passes every few seconds at most: an engine step, a micro-batch's
forward pass, a weight bucket, a stage of a checkpoint save. The code marks them with `point(name)`, its waits on
other processes with `waiting(on)`, and the trainer's phases with `phase(name)` (timing.PhaseTimer does). Nothing
here does I/O: the watchdog thread reads STATE and publishes it.

DAPO_FAULT=ACTION:WHERE:A[:B][@LABEL] makes this process fail at a named place once per run directory: ACTION stop
(SIGSTOP: a process that cannot run; continued, it stays there), kill (SIGKILL: a crash) or corrupt (the caller
damages what it sends); WHERE
and its numbers are the place's: `micro_batch:S:K`, `engine_step:S:K` and `save:S:K` the K-th such point (from 0)
of step S, `send:V:B` / `receive:V:B` / `corrupt`'s `bucket:V:B` bucket B of weight update V; LABEL (e.g. rank1,
train0, rollout0) the one process that fails. Tests only: a place no signal from outside could aim at.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

FAULT_ENV = "DAPO_FAULT"
START_UP = "start-up"
"""The phase before the first step: model loading and engine start have no progress points; waits there are bounded
by the collective timeout instead, and neither the stall detector nor the backstop counts time spent in it."""


@dataclass
class State:
    """This process's place; written by the main thread, read by the watchdog's."""

    label: str = ""
    """This process in the run: 'rank R' (colocated), 'train R' or 'rollout R' (asynchronous)."""
    phase: str = START_UP
    step: int = 0
    """The rollout step being trained (train side) or the batch being collected (rollout side)."""
    point: str = ""
    """The last progress point's name."""
    counter: int = 0
    progress_at: float = field(default_factory=time.time)
    """Wall time of the last progress point (or of entering the phase)."""
    waiting: Optional[str] = None
    """What this process waits for (other processes), or None."""
    groups: dict[str, float] = field(default_factory=dict)
    """{process group: its timeout in seconds}, as armed (model/parallel.py, rollout/weight_transport.py)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Progress points of each name in this step (fault places count them)."""
    fault_marker: Optional[Path] = None
    """Where a fault that fired is recorded, so a restarted run does not fail again (None: no record)."""
    on_change: Callable[[], None] = lambda: None
    """Called (in the changing thread) when the phase or step changes: the watchdog publishes then, so a process
    that stops right after shows where it stopped, not where it was a second before."""
    backstop_s: Optional[float] = None
    backstop_file: Any = None
    _armed_at: float = 0.0


STATE = State()


def point(name: str) -> None:
    """A progress point: count it, and act on DAPO_FAULT if it names this occurrence."""
    now = time.time()
    STATE.counter += 1
    STATE.point = name
    STATE.progress_at = now
    k = STATE.counts.get(name, 0)
    STATE.counts[name] = k + 1
    if now - STATE._armed_at > 1.0:  # re-armed at most once a second
        _arm_backstop(now)
    fault(name, STATE.step, k)


def set_phase(name: str, step: Optional[int] = None) -> None:
    """Enter phase `name` (of rollout step `step`, if given: the fault places count from 0 in each step)."""
    STATE.phase = name
    if step is not None and step != STATE.step:
        STATE.step, STATE.counts = step, {}
    STATE.progress_at = time.time()
    _arm_backstop(STATE.progress_at)
    STATE.on_change()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    before = STATE.phase
    set_phase(name)
    try:
        yield
    finally:
        STATE.phase = before
        _arm_backstop(time.time())
        STATE.on_change()


@contextlib.contextmanager
def waiting(on: str) -> Iterator[None]:
    """A wait on other processes: this process is not the one a stall is blamed on while inside (nested: the
    outermost wait is the one shown)."""
    outer = STATE.waiting
    STATE.waiting = outer or on
    try:
        yield
    finally:
        STATE.waiting = outer


def arm_backstop(seconds: float, file: Any) -> None:
    """faulthandler's last resort: every thread's stack to `file` and exit 1 if no progress point re-arms it for
    `seconds` (the watchdog thread itself cannot run: the interpreter is stuck holding its lock). Held off while the
    phase is START_UP, whose long stretches without a progress point (a model loading, the other side's engine
    starting) are not stalls."""
    STATE.backstop_s, STATE.backstop_file = seconds, file
    _arm_backstop(time.time())


def _arm_backstop(now: float) -> None:
    if STATE.backstop_s is None:
        return
    STATE._armed_at = now
    if STATE.phase == START_UP:
        faulthandler.cancel_dump_traceback_later()
    else:
        faulthandler.dump_traceback_later(STATE.backstop_s, exit=True, file=STATE.backstop_file)


def disarm_backstop() -> None:
    STATE.backstop_s = None
    faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------- fault injection (tests)


@dataclass(frozen=True)
class Fault:
    action: str
    where: str
    numbers: tuple[int, ...]
    label: Optional[str]
    text: str


ACTIONS = ("stop", "kill", "corrupt")


def parse_fault(text: str) -> Fault:
    """DAPO_FAULT's value (see the module docstring); ValueError naming what is wrong."""
    spec, _, label = text.partition("@")
    parts = spec.split(":")
    if len(parts) < 3 or parts[0] not in ACTIONS or not all(p.isdigit() for p in parts[2:]):
        raise ValueError(
            f"{FAULT_ENV}={text!r}: expected ACTION:WHERE:NUMBER[:NUMBER][@LABEL] with ACTION one of {ACTIONS}"
        )
    return Fault(parts[0], parts[1], tuple(int(p) for p in parts[2:]), label or None, text)


def fault(where: str, *numbers: int) -> bool:
    """Act on DAPO_FAULT here (`where` with `numbers`): stop or kill this process; True when it asks the caller to
    corrupt what it sends. Each fault fires once per run directory (STATE.fault_marker)."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return False
    f = parse_fault(text)
    if f.where != where or f.numbers != numbers[: len(f.numbers)] or len(f.numbers) != len(numbers):
        return False
    if f.label is not None and f.label != STATE.label.replace(" ", ""):
        return False
    marker = STATE.fault_marker
    if marker is not None:
        if marker.is_file() and text in marker.read_text().splitlines():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "a") as out:
            out.write(text + "\n")
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops here, its watchdog thread too
        threading.Event().wait()  # continued (to write its stacks), it stays where it stopped until it is ended
    return f.action == "corrupt"
