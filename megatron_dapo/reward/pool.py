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
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import resource
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.reward.verifiers import VerifyResult, select_verifier

logger = logging.getLogger("megatron_dapo.reward")

_WORKER_NAME_PREFIX = "megatron-dapo-reward-"
_GRACE_S = 0.5
"""Extra time the parent allows past timeout_s, so the worker's own soft limit fires first."""
_MAX_CHUNK = 16
"""Responses per chunk at most: a ticket submitted later may wait for a worker to finish its chunk. Results come
back one message each, so larger chunks would save little IPC."""
_STARTUP_TIMEOUT_S = 120.0
_MAX_START_FAILURES = 3
_EXCERPT_CHARS = 80
_MAX_DETAIL_CHARS = 300

STATUSES = ("ok", "timeout", "error")


@dataclass
class RewardBatch:
    """Scores of one score() call or ticket; every list has one entry per response, in input order."""

    scores: list[float]
    """+1.0 correct, -1.0 otherwise (also for 'timeout' and 'error')."""
    acc: list[bool]
    """Raw correctness."""
    preds: list[str | None]
    """The extracted answers (None when none was found or scoring failed)."""
    status: list[str]
    """'ok' | 'timeout' | 'error'."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/timeouts, reward/errors (counts in this call or ticket), reward/seconds (from submit to the
    last result), reward/responses_per_s, reward/accuracy, reward/score_mean, reward/worker_restarts
    (see RewardPool.submit for which ticket a restart is counted in)."""


# --------------------------------------------------------------------------- worker side


class _SoftTimeout(BaseException):
    """Raised by the worker's SIGALRM handler; BaseException so verifiers' `except Exception` miss it."""


def _raise_soft_timeout(signum: int, frame: Any) -> None:
    raise _SoftTimeout()


def _describe(e: BaseException) -> str:
    """'TypeName: message', bounded; str() of an exotic exception may itself fail."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001
        text = "<unprintable>"
    return f"{type(e).__name__}: {text}"[:_MAX_DETAIL_CHARS] if text else type(e).__name__


def _address_space_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prepare_worker(configured: str, memory_mb: int) -> None:
    """Imports and warms up the verifiers, then caps the address space. Raises on failure."""
    # Ctrl-C and the stop signals (Slurm and torchrun deliver them to the whole process group) are the
    # trainer's to handle: it finishes its step, which needs us, and then closes us (EOF, or SIGKILL)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: we bound time here
    if configured in ("auto", "math_verify", "hybrid"):
        select_verifier("", "math_verify", math_verify_timeout_s=None)("\\boxed{1}", "1")  # import + first-call cost
    elif configured != "dapo":
        select_verifier("", configured)  # import the user's module now: a failure is a start failure
    limit = memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    used = _address_space_mb()
    if used >= limit / 2**20:
        raise MemoryError(
            f"reward.worker_memory_mb={memory_mb} is below the worker's address space at start ({used:.0f} MiB)"
        )
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.signal(signal.SIGALRM, _raise_soft_timeout)


def _score_one(
    verifiers: dict[str, Any], configured: str, text: str, gold: str, source: str, timeout_s: float
) -> tuple:
    """(score, acc, pred, status, detail) for one response; never raises."""
    try:
        try:
            verify = verifiers.get(source)
            if verify is None:
                verify = verifiers[source] = select_verifier(source, configured, math_verify_timeout_s=None)
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            result: VerifyResult = verify(text, gold)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        pred = result.pred if isinstance(result.pred, str) or result.pred is None else str(result.pred)
        return float(result.score), bool(result.acc), pred, "ok", ""
    except _SoftTimeout:
        return -1.0, False, None, "timeout", f"over {timeout_s:g} s (soft limit)"
    except BaseException as e:  # noqa: BLE001 - MemoryError, SystemExit, anything a verifier raises
        return -1.0, False, None, "error", _describe(e)


def _worker_main(
    conn: multiprocessing.connection.Connection, configured: str, timeout_s: float, memory_mb: int
) -> None:
    """A scoring process: ('chunk', [(key, text, gold, source), ...]) in, one ('result', key, ...) per item out.

    The key is the parent's (ticket, index) pair, echoed back untouched.
    """
    try:
        _prepare_worker(configured, memory_mb)
        conn.send(("ready", os.getpid()))
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send(("fatal", _describe(e)))
        finally:
            os._exit(3)
    verifiers: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed its end or died
            break
        if message[0] != "chunk":
            break
        for key, text, gold, source in message[1]:
            _send_result(conn, key, _score_one(verifiers, configured, text, gold, source, timeout_s))
    os._exit(0)


def _send_result(conn: multiprocessing.connection.Connection, key: Any, result: tuple) -> None:
    """Report one result; one that cannot be pickled is reported as an error instead."""
    try:
        conn.send(("result", key, *result))
    except (EOFError, OSError):
        os._exit(0)  # the parent is gone
    except BaseException as e:  # noqa: BLE001 - pickling fails before anything is written, so the pipe is intact
        conn.send(("result", key, -1.0, False, None, "error", f"cannot send the result: {_describe(e)}"))


# --------------------------------------------------------------------------- parent side


def _install_spawn_hook() -> None:
    """Stop spawn from re-running the parent's __main__ in our workers.

    By default a spawn child re-imports the launching script, which for the trainer means
    importing torch (seconds and GBs of address space) in every scoring process.
    """
    original = multiprocessing.spawn.get_preparation_data
    if getattr(original, "_megatron_dapo_reward", False):
        return

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        if name.startswith(_WORKER_NAME_PREFIX):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data._megatron_dapo_reward = True  # type: ignore[attr-defined]
    multiprocessing.spawn.get_preparation_data = get_preparation_data


_Key = tuple[int, int]
"""(ticket, index of the response in its ticket): how the parent names a response to the workers and back."""


class _Worker:
    """The parent's handle on one scoring process and the items it holds."""

    def __init__(self, slot: int, args: tuple) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child_conn, *args), name=f"{_WORKER_NAME_PREFIX}{slot}", daemon=True
        )
        self.proc.start()
        child_conn.close()
        self.ready = False
        self.fatal = ""
        self.started_at = time.monotonic()
        self.inflight: deque[_Key] = deque()
        """Keys sent and not yet reported, in the order the worker scores them."""
        self.item_since = 0.0
        """When the parent last heard from the worker: the running item started no earlier."""

    def stop(self, kill: bool) -> None:
        """Close the pipe (the worker exits at EOF); SIGKILL it when kill or when it lingers."""
        try:
            self.conn.close()
        except OSError:
            pass
        if kill:
            self.proc.kill()
        self.proc.join(timeout=0.5 if not kill else 5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5.0)
        try:
            self.proc.close()
        except ValueError:
            pass


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """At interpreter exit, before multiprocessing joins its children: our workers ignore SIGTERM, which is all
    multiprocessing sends them, so a pool nobody closed (an exception at start-up) would hang the exit forever."""
    for pool in list(_LIVE_POOLS):
        pool.close()


class _Ticket:
    """One submit() call: its responses, its results so far and what its metrics need."""

    def __init__(self, ticket_id: int, n: int) -> None:
        self.id = ticket_id
        self.scores = [-1.0] * n
        self.acc = [False] * n
        self.preds: list[str | None] = [None] * n
        self.status = [""] * n
        self.pending = n
        """Indices without a result yet."""
        self.tasks: dict[int, tuple[str, str, str]] = {}
        """index -> (text, gold, source) of the responses that go to the workers, in index order."""
        self.restarts = 0
        self.submitted_at = time.monotonic()
        self.done_at = self.submitted_at if n == 0 else 0.0
        """When the last result came in (reward/seconds ends there, not when result() collects it)."""

    def set(self, idx: int, score: float, acc: bool, pred: str | None, status: str) -> None:
        if self.status[idx] == "":
            self.pending -= 1
            if self.pending == 0:
                self.done_at = time.monotonic()
        self.scores[idx], self.acc[idx], self.preds[idx], self.status[idx] = score, acc, pred, status


def _excerpt(response: Any) -> str:
    # repr() escapes lone surrogates and control characters, so logging never fails on them.
    return (
        f"{response[:_EXCERPT_CHARS]!r} ({len(response)} chars)"
        if isinstance(response, (str, bytes))
        else repr(response)[:_EXCERPT_CHARS]
    )


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
        self._workers: list[_Worker | None] = []
        self._tickets: dict[int, _Ticket] = {}
        """Submitted and not yet collected, in submission order."""
        self._todo: deque[_Key] = deque()
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
        _install_spawn_hook()
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
        return self._batch(t)

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
        t = _Ticket(self._next_ticket, n)
        self._next_ticket += 1
        t.restarts, self._unowned_restarts = self._unowned_restarts, 0
        self._tickets[t.id] = t
        for i, (response, gold, source) in enumerate(zip(responses, ground_truths, data_sources)):
            text, problem = _as_text(response, gold, source)
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

    def _lookup(self, ticket: int, method: str) -> _Ticket:
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

    def _spawn(self, slot: int) -> _Worker:
        return _Worker(slot, (self.verifier, self.timeout_s, self.worker_memory_mb))

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

    def _drain(self, slot: int, w: _Worker) -> None:
        """Read every message the worker has sent; handle its death if it has exited."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass  # a closed pipe: the process is gone or going
        if not w.proc.is_alive():
            code = w.proc.exitcode
            self._lose_worker(slot, w, "error", f"worker exited with code {code} while scoring it")

    def _handle(self, w: _Worker, message: tuple) -> None:
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

    def _lose_worker(self, slot: int, w: _Worker, status: str, detail: str) -> None:
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

    def _count_restart(self, culprit: _Key | None) -> None:
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
        stopped: dict[int, _Worker] = {}
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

    def _record_key(self, key: _Key, score: float, acc: bool, pred: str | None, status: str, detail: str) -> None:
        t = self._tickets.get(key[0])
        if t is not None:  # None: a ticket dropped meanwhile; nobody wants its results
            self._record(t, key[1], t.tasks[key[1]][0], score, acc, pred, status, detail)

    def _record(
        self,
        t: _Ticket,
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
                "reward: ticket %d, response %d %s: %s; response %s", t.id, idx, status, detail, _excerpt(response)
            )

    def _batch(self, t: _Ticket) -> RewardBatch:
        n = len(t.scores)
        seconds = t.done_at - t.submitted_at
        metrics = {
            "reward/timeouts": float(t.status.count("timeout")),
            "reward/errors": float(t.status.count("error")),
            "reward/seconds": seconds,
            "reward/responses_per_s": n / seconds if seconds > 0 else 0.0,
            "reward/accuracy": sum(t.acc) / n if n else 0.0,
            "reward/score_mean": sum(t.scores) / n if n else 0.0,
            "reward/worker_restarts": float(t.restarts),
        }
        return RewardBatch(scores=t.scores, acc=t.acc, preds=t.preds, status=t.status, metrics=metrics)


def _as_text(response: Any, gold: Any, source: Any) -> tuple[str, str]:
    """(text, problem): the response as str, or a description of why it cannot be scored."""
    if not isinstance(gold, str) or not isinstance(source, str):
        return "", f"ground truth and data source must be str, got {type(gold).__name__} and {type(source).__name__}"
    if isinstance(response, bytes):
        try:
            return response.decode("utf-8", errors="strict"), ""
        except UnicodeDecodeError as e:
            return "", f"invalid UTF-8 ({e.reason} at byte {e.start})"
    if isinstance(response, str):
        return response, ""
    return "", f"response must be str or bytes, got {type(response).__name__}"
