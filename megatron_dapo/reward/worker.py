"""The worker side of the reward pool: what runs inside each scoring process.

A worker (started by RewardPool with multiprocessing 'spawn', entry point worker_main) imports and
warms up the verifiers, caps its address space with RLIMIT_AS, then scores the chunks the parent
sends, each response under a SIGALRM soft limit, and reports every result as it finishes. It never
raises for one response: a timeout or an exception becomes a -1 score with status 'timeout' or 'error'.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import resource
import signal
from typing import Any

from megatron_dapo.choices import MATH_VERIFY_USERS
from megatron_dapo.reward.answers import VerifyResult
from megatron_dapo.reward.registry import select_verifier

_MAX_DETAIL_CHARS = 300


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
    if configured in MATH_VERIFY_USERS:
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


def worker_main(conn: multiprocessing.connection.Connection, configured: str, timeout_s: float, memory_mb: int) -> None:
    """A scoring process: ('chunk', [(key, text, gold, source), ...]) in, one ('result', key, ...) per item out.

    The key is the parent's (ticket, index) pair, echoed back untouched. A top-level function: spawn pickles it
    by name.
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
