"""Score responses in isolated worker processes with a hard per-response time limit.

    with RewardPool.from_config(cfg.reward) as pool:
        batch = pool.score(responses, ground_truths, data_sources)   # blocks; RewardBatch, input order

        # or without blocking: score each finished group while a StreamingEngine keeps generating
        tickets = {}
        while engine.in_flight():
            for key, group in engine.step():   # group: the n Responses of one prompt
                tickets[key] = pool.submit([r.text for r in group], [gold[key]] * n, [source[key]] * n)
            pool.poll()                       # cheap: hand out work, read results, enforce time limits
        batches = {key: pool.result(t) for key, t in tickets.items()}   # waits for the rest
        # pool.done(ticket) polls, then says whether result(ticket) would return at once

Why processes: math-verify times out with SIGALRM (main thread only), sympy can hang in
C code that never looks at signals, and a pathological answer can allocate without bound.
So each worker (multiprocessing 'spawn') runs verifiers under RLIMIT_AS and a SIGALRM soft
limit, and the parent SIGKILLs a worker whose current response runs past ``timeout_s`` plus
a grace period, records that response as 'timeout', starts a replacement and re-sends the
worker's unscored responses. Workers get responses in chunks (low IPC cost) and report
every result as it finishes, so the parent always knows which response is running and
since when. Per-response problems never raise: they score -1 with status 'timeout' or
'error' and are logged on the ``megatron_dapo.reward`` logger.

Tickets: score() is submit() followed by result(). Any number of tickets may be outstanding;
their responses go to the workers in submission order (first in, first out across tickets)
and each ticket's RewardBatch.metrics counts its own responses only. The pool has no thread
of its own: it makes progress only inside submit(), poll(), done(), result() and score(),
so a response's time limit is enforced at the pool's next turn. Between two poll() calls a
hung response may hold its worker longer than ``timeout_s``; it is never cut short. The
pool is meant for one thread.

This module is the parent's event loop; worker.py is the code each scoring process runs,
process.py the parent's handle on one, tickets.py the records of one submit() (RewardBatch).
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing.connection
import time
import weakref
from collections import deque
from typing import Any

from megatron_dapo.reward.process import WorkerProcess, install_spawn_hook
from megatron_dapo.reward.registry import select_verifier
from megatron_dapo.reward.tickets import Key, RewardBatch, Ticket, as_text, excerpt

logger = logging.getLogger("megatron_dapo.reward")

_GRACE_S = 0.5
"""Extra time the parent allows past timeout_s, so the worker's own soft limit fires first."""
_MAX_CHUNK = 16
"""Responses per chunk at most: a ticket submitted later may wait for a worker to finish its chunk. Results come
back one message each, so larger chunks would save little IPC."""
_STARTUP_TIMEOUT_S = 120.0
_MAX_START_FAILURES = 3


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """At interpreter exit, before multiprocessing joins its children: our workers ignore SIGTERM, which is all
    multiprocessing sends them, so a pool nobody closed (an exception at start-up) would hang the exit forever."""
    for pool in list(_LIVE_POOLS):
        pool.close()


class RewardPool:
    """A pool of scoring processes; see the module docstring.

    num_workers: scoring processes; timeout_s: wall-clock limit per response;
    worker_memory_mb: RLIMIT_AS of each worker; verifier: reward.verifier ('auto', 'hybrid', 'dapo',
    'math_verify' or 'package.module:function'), checked here (ValueError when invalid).
    Workers start in the background at construction.
    """

    def __init__(
        self, num_workers: int = 2, timeout_s: float = 5.0, worker_memory_mb: int = 4096, verifier: str = "auto"
    ) -> None:
        self._workers: list[WorkerProcess | None] = []
        self._tickets: dict[int, Ticket] = {}
        """Submitted and not yet collected, in submission order."""
        self._todo: deque[Key] = deque()
        """Responses waiting for a worker, oldest ticket first; every key belongs to a ticket in _tickets."""
        self._closed = False
        if num_workers < 1:
            raise ValueError(f"config field reward.num_workers={num_workers!r}: expected an integer >= 1")
        if not timeout_s > 0:
            raise ValueError(f"config field reward.timeout_s={timeout_s!r}: expected a value > 0")
        select_verifier("", verifier)  # raises ValueError naming reward.verifier; imports a user module here too
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.worker_memory_mb = worker_memory_mb
        self.verifier = verifier
        self._start_failures = 0
        self._last_failure = ""
        self._next_ticket = 1
        self._unowned_restarts = 0
        """Restarts while no ticket was waiting, counted in the next ticket submitted."""
        install_spawn_hook()
        _LIVE_POOLS.add(self)
        self._workers = [self._spawn(slot) for slot in range(num_workers)]

    @classmethod
    def from_config(cls, cfg: Any) -> RewardPool:
        """From a megatron_dapo.config.RewardConfig (or anything with the same attributes)."""
        return cls(
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            worker_memory_mb=cfg.worker_memory_mb,
            verifier=cfg.verifier,
        )

    # ----------------------------------------------------------------------- public API

    def score(self, responses: list[str | bytes], ground_truths: list[str], data_sources: list[str]) -> RewardBatch:
        """Score responses[i] against ground_truths[i] with the verifier for data_sources[i].

        bytes are decoded as strict UTF-8 (invalid -> 'error'). Returns a RewardBatch in input
        order. Raises ValueError when the lists differ in length, RuntimeError when workers
        repeatedly fail to start; never for a problem with one response. The same as submit()
        then result(); tickets submitted earlier are scored first.
        """
        ticket = self._submit(responses, ground_truths, data_sources, "score")
        try:
            return self.result(ticket)
        except BaseException:
            self._forget(ticket)  # the caller never saw the ticket, so nobody else can collect it
            raise

    def submit(self, responses: list[str | bytes], ground_truths: list[str], data_sources: list[str]) -> int:
        """Queue responses for scoring like score() and return a ticket for done() and result(); never waits.

        Checks and decodes the input as score() does (the same ValueError, the same per-response
        'error's) and hands what it can to idle workers at once. Tickets are scored in submission
        order. A worker restart is counted in the ticket whose response caused it (a timeout or a
        crash while scoring it); one that no response caused (a worker that died idle or failed to
        start) in the oldest ticket still being scored, else in the next one submitted, so that the
        tickets' metrics summed count every restart once.
        """
        return self._submit(responses, ground_truths, data_sources, "submit")

    def poll(self) -> None:
        """Make progress without waiting: hand out queued responses, read results, enforce time limits, replace
        dead workers. Cheap when there is nothing to do (one zero-timeout wait on the workers' pipes); does
        nothing after close()."""
        if not self._closed:
            self._step(block=False)

    def done(self, ticket: int) -> bool:
        """poll(), then whether every response of the ticket has a result (result() would not wait).

        KeyError for a ticket never submitted or already collected; RuntimeError after close().
        """
        t = self._lookup(ticket, "done")
        self._step(block=False)
        return t.pending == 0

    def result(self, ticket: int) -> RewardBatch:
        """Wait, making progress, until every response of the ticket has a result; its RewardBatch in input order.

        The ticket is then forgotten: KeyError for a ticket never submitted or already collected,
        RuntimeError after close() (which drops outstanding tickets). An exception while waiting
        (Ctrl-C; RuntimeError when workers repeatedly fail to start) leaves the ticket outstanding.
        """
        t = self._lookup(ticket, "result")
        while t.pending > 0:
            self._step(block=True)
        del self._tickets[ticket]
        return t.batch()

    def close(self) -> None:
        """Stop every worker and drop outstanding tickets. Idempotent."""
        self._closed = True
        self._tickets.clear()
        self._todo.clear()
        workers, self._workers = self._workers, []
        for w in workers:
            if w is not None:
                w.stop(kill=bool(w.inflight))

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser (e.g. at interpreter exit)
            pass

    # ----------------------------------------------------------------------- tickets

    def _submit(self, responses: list, ground_truths: list, data_sources: list, method: str) -> int:
        if self._closed:
            raise RuntimeError(f"RewardPool.{method}() called after close()")
        n = len(responses)
        if len(ground_truths) != n or len(data_sources) != n:
            raise ValueError(
                f"RewardPool.{method}: responses ({n}), ground_truths ({len(ground_truths)}) and data_sources "
                f"({len(data_sources)}) must have the same length"
            )
        t = Ticket(self._next_ticket, n)
        self._next_ticket += 1
        t.restarts, self._unowned_restarts = self._unowned_restarts, 0
        self._tickets[t.id] = t
        for i, (response, gold, source) in enumerate(zip(responses, ground_truths, data_sources)):
            text, problem = as_text(response, gold, source)
            if problem:
                self._record(t, i, response, -1.0, False, None, "error", problem)
            else:
                t.tasks[i] = (text, gold, source)
                self._todo.append((t.id, i))
        self._start_failures = 0  # every call gets _MAX_START_FAILURES tries, as score() always has
        try:
            self._replace_missing_workers()
            self._dispatch()
        except BaseException:
            self._forget(t.id)  # the caller gets no ticket
            self._reset_busy_workers()
            raise
        return t.id

    def _lookup(self, ticket: int, method: str) -> Ticket:
        if self._closed:
            raise RuntimeError(
                f"RewardPool.{method}({ticket!r}) called after close(); close() drops every outstanding ticket"
            )
        t = self._tickets.get(ticket)
        if t is None:
            raise KeyError(f"RewardPool.{method}: no ticket {ticket!r} (never submitted, or its result was collected)")
        return t

    def _forget(self, ticket: int) -> None:
        """Drop a ticket nobody will collect, with its queued responses and any worker busy with them."""
        if self._tickets.pop(ticket, None) is None:
            return
        self._todo = deque(key for key in self._todo if key[0] != ticket)
        if any(key[0] == ticket for w in self._workers if w is not None for key in w.inflight):
            self._reset_busy_workers()  # a worker busy with responses nobody owns would hold up every other ticket

    # ----------------------------------------------------------------------- scheduling

    def _spawn(self, slot: int) -> WorkerProcess:
        return WorkerProcess(slot, (self.verifier, self.timeout_s, self.worker_memory_mb))

    def _step(self, block: bool) -> None:
        """The event loop's one step, for poll(), done() and result() alike.

        Hands out work, waits for worker messages (until the next deadline when block, not at all
        otherwise), reads them, enforces deadlines and hands out again. After an exception (Ctrl-C
        mid-step, workers that cannot start) the busy workers are replaced and their responses
        queued again, so no worker is left holding work in a state the parent no longer knows.
        """
        try:
            if None in self._workers:
                self._replace_missing_workers()  # a slot left empty when workers failed to start (which raised)
            self._dispatch()
            ready = multiprocessing.connection.wait(self._waitables(), timeout=self._wait_timeout() if block else 0.0)
            for slot, w in enumerate(self._workers):
                if w is None:
                    continue
                if w.conn in ready or w.proc.sentinel in ready:
                    self._drain(slot, w)
            self._check_deadlines()
            # Workers freed by this step's results start on the queue now: after poll() the next turn may be a
            # whole engine step away.
            self._dispatch()
        except BaseException:
            self._reset_busy_workers()
            raise

    def _waitables(self) -> list:
        objs: list = []
        for w in self._workers:
            if w is not None:
                objs += [w.conn, w.proc.sentinel]
        return objs

    def _dispatch(self) -> None:
        """Give each ready, idle worker a chunk: large enough to amortise IPC, small enough to balance.

        Chunks are sized from the whole queue, so a big ticket gets big chunks; _MAX_CHUNK bounds
        how long a ticket submitted afterwards waits for a worker to come free.
        """
        for w in self._workers:
            if not self._todo:
                return
            if w is None or not w.ready or w.inflight:
                continue
            size = max(1, min(_MAX_CHUNK, math.ceil(len(self._todo) / (2 * self.num_workers))))
            chunk = [self._todo.popleft() for _ in range(min(size, len(self._todo)))]
            w.inflight.extend(chunk)
            w.item_since = time.monotonic()
            try:
                w.conn.send(("chunk", [(key, *self._tickets[key[0]].tasks[key[1]]) for key in chunk]))
            except (OSError, ValueError):
                # The worker died before it got the chunk: no item is to blame; its sentinel reports the death.
                w.inflight.clear()
                self._todo.extendleft(reversed(chunk))

    def _wait_timeout(self) -> float:
        """Seconds until the earliest per-response or start-up deadline."""
        now = time.monotonic()
        deadline = now + 1.0
        for w in self._workers:
            if w is None:
                continue
            if w.inflight:
                deadline = min(deadline, w.item_since + self.timeout_s + _GRACE_S)
            elif not w.ready:
                deadline = min(deadline, w.started_at + _STARTUP_TIMEOUT_S)
        return max(0.0, deadline - now) + 0.001

    def _drain(self, slot: int, w: WorkerProcess) -> None:
        """Read every message the worker has sent; handle its death if it has exited."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass  # a closed pipe: the process is gone or going
        if not w.proc.is_alive():
            code = w.proc.exitcode
            self._lose_worker(slot, w, "error", f"worker exited with code {code} while scoring it")

    def _handle(self, w: WorkerProcess, message: tuple) -> None:
        kind = message[0]
        if kind == "result":
            _, key, score, acc, pred, status, detail = message
            if w.inflight and w.inflight[0] == key:
                w.inflight.popleft()
            w.item_since = time.monotonic()
            self._record_key(key, score, acc, pred, status, detail)
        elif kind == "ready":
            w.ready = True
            self._start_failures = 0
        elif kind == "fatal":
            w.fatal = message[1]

    def _check_deadlines(self) -> None:
        """Kill workers whose current response or start-up is past its limit."""
        now = time.monotonic()
        for slot, w in enumerate(self._workers):
            if w is None:
                continue
            if w.inflight and now - w.item_since > self.timeout_s + _GRACE_S:
                self._drain(slot, w)  # its result may have just arrived
                w = self._workers[slot]
                if w is not None and w.inflight and time.monotonic() - w.item_since > self.timeout_s + _GRACE_S:
                    self._lose_worker(slot, w, "timeout", f"over {self.timeout_s:g} s (worker killed)")
            elif not w.ready and now - w.started_at > _STARTUP_TIMEOUT_S:
                w.fatal = w.fatal or f"not ready after {_STARTUP_TIMEOUT_S:g} s"
                self._lose_worker(slot, w, "error", "")

    def _lose_worker(self, slot: int, w: WorkerProcess, status: str, detail: str) -> None:
        """Kill and replace a worker: its running item gets `status`, its unscored items go back to the queue."""
        exitcode = w.proc.exitcode
        w.stop(kill=True)
        self._workers[slot] = None
        culprit = None
        if w.inflight:
            culprit = w.inflight.popleft()
            self._record_key(culprit, -1.0, False, None, status, detail)
            self._todo.extendleft(reversed([key for key in w.inflight if key[0] in self._tickets]))
        if not w.ready:
            self._start_failures += 1
            self._last_failure = w.fatal or f"exit code {exitcode}"
            if self._start_failures >= _MAX_START_FAILURES:
                raise RuntimeError(
                    f"reward workers failed to start {self._start_failures} times in a row (last: {self._last_failure}); "
                    f"check reward.verifier={self.verifier!r} and reward.worker_memory_mb={self.worker_memory_mb}"
                )
        self._count_restart(culprit)
        self._workers[slot] = self._spawn(slot)

    def _count_restart(self, culprit: Key | None) -> None:
        """Count a restart in the culprit's ticket; with none, in the oldest ticket still being scored (see submit)."""
        t = self._tickets.get(culprit[0]) if culprit is not None else None
        if t is None:
            t = next((t for t in self._tickets.values() if t.pending > 0), None)
        if t is None:
            self._unowned_restarts += 1
        else:
            t.restarts += 1

    def _replace_missing_workers(self) -> None:
        """Start workers for empty slots and for workers that died while idle (between calls).

        A dead worker that still holds responses is left to the event loop, which blames its running one.
        """
        for slot, w in enumerate(self._workers):
            if w is not None and not w.inflight and not w.proc.is_alive():
                w.stop(kill=True)
                w = self._workers[slot] = None
            if w is None:
                self._count_restart(None)
                self._workers[slot] = self._spawn(slot)

    def _reset_busy_workers(self) -> None:
        """After an exception: replace the workers that hold responses and queue every unscored response again.

        A step cut short may have half-sent a chunk or half-handled a result, so the busy workers'
        state is unknown. With them gone nothing is in flight, so the queue is rebuilt from the
        tickets themselves: no response is lost, dropped tickets' responses go, none is blamed.
        """
        # The bookkeeping first, the slow part (joining processes) after: a second Ctrl-C during the joins then
        # leaves only empty slots, which the next step fills.
        stopped: dict[int, WorkerProcess] = {}
        for slot, w in enumerate(self._workers):
            if w is not None and (w.inflight or not w.proc.is_alive()):
                stopped[slot], self._workers[slot] = w, None
        self._todo = deque((t.id, idx) for t in self._tickets.values() for idx in t.tasks if t.status[idx] == "")
        for w in stopped.values():
            w.stop(kill=True)
        if not self._closed:
            for slot in stopped:
                self._workers[slot] = self._spawn(slot)

    # ----------------------------------------------------------------------- results

    def _record_key(self, key: Key, score: float, acc: bool, pred: str | None, status: str, detail: str) -> None:
        t = self._tickets.get(key[0])
        if t is not None:  # None: a ticket dropped meanwhile; nobody wants its results
            self._record(t, key[1], t.tasks[key[1]][0], score, acc, pred, status, detail)

    def _record(
        self,
        t: Ticket,
        idx: int,
        response: Any,
        score: float,
        acc: bool,
        pred: str | None,
        status: str,
        detail: str,
    ) -> None:
        t.set(idx, score, acc, pred, status)
        if status != "ok":
            logger.warning(
                "reward: ticket %d, response %d %s: %s; response %s", t.id, idx, status, detail, excerpt(response)
            )
