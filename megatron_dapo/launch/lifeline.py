"""Nothing of a run outlives the process that started it (docs/training.md, "When the launcher dies").

A launcher (`launch local`, the asynchronous job's two sides, a Ray actor) starts its children in sessions of their
own, so a Ctrl-C reaches the launcher only; the cost is that a launcher killed with SIGKILL (a terminal's hang-up,
the OOM killer, a batch system signalling the group) would leave them running with nobody to stop them. So:

- every process of a run carries RUN_TAG_ENV (one id per launch, inherited by every descendant: a test or a person
  finds a run's processes by it in /proc/<pid>/environ, orphans adopted by init included);
- a launcher's direct children that are not trainers (torchrun's agent) die with it: the kernel's parent-death
  signal, SIGKILL (die_with_parent, set in the child before exec);
- every trainer process watches the launcher named in LAUNCHER_PID_ENV / LAUNCHER_START_ENV (its pid and its start
  time, so a reused pid is not taken for it) from a daemon thread (watch_launcher); once the launcher is gone it
  kills its own descendants (reward workers, engine processes), prints one line and exits with status 1, as a rank
  that lost its peer does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Optional

RUN_TAG_ENV = "DAPO_RUN_TAG"
"""One id per launch, set by the launcher and inherited by every process of the run."""
LAUNCHER_PID_ENV, LAUNCHER_START_ENV = "DAPO_LAUNCHER_PID", "DAPO_LAUNCHER_START"
"""The process a trainer dies with: its pid and its start time (/proc/<pid>/stat's field 22)."""
WATCH_S = 0.5
"""How often a trainer process looks at its launcher."""

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: a child calls it and nothing else


def new_run_tag() -> str:
    """A launch's id: host, pid, time and randomness (unique across machines and launches)."""
    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}-{secrets.token_hex(4)}"


def start_time(pid: int) -> Optional[str]:
    """pid's start time in clock ticks since boot (/proc/<pid>/stat, field 22); None when it is not running (gone,
    or a zombie: killed and not reaped yet)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command, in parentheses, may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """env for a launcher's children: this process as the launcher they die with, and the run's tag (the one this
    process carries, or a new one)."""
    return {
        **env,
        RUN_TAG_ENV: env.get(RUN_TAG_ENV) or new_run_tag(),
        LAUNCHER_PID_ENV: str(os.getpid()),
        LAUNCHER_START_ENV: start_time(os.getpid()) or "",
    }


def die_with_parent() -> None:
    """In a child before exec (Popen's preexec_fn): SIGKILL it when its parent thread exits."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def launcher_alive(pid: int, started: str) -> bool:
    """The launcher pid (started at `started`, or any start when empty) is still running."""
    now = start_time(pid)
    return now is not None and (not started or now == started)


def kill_descendants() -> None:
    """SIGKILL every process under this one (reward workers, engine processes, compile workers)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def launcher_gone_exit(pid: int) -> None:
    """What a trainer process does once its launcher is gone: its descendants killed, one line, status 1."""
    kill_descendants()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '?')}] " if world > 1 else ""
    with contextlib.suppress(Exception):
        print(f"{prefix}error: the launcher (pid {pid}) is gone; this process and its children stop", file=sys.stderr,
              flush=True)  # fmt: skip
    os._exit(1)  # from a thread: the main thread may be inside a collective that never returns


def watch_launcher(environ: Optional[dict[str, str]] = None) -> Optional[threading.Thread]:
    """Start the daemon thread that ends this process once the launcher named in the environment is gone (at once,
    if it is gone already: a launcher killed before this process got here); None without a launcher named."""
    environ = os.environ if environ is None else environ
    pid = environ.get(LAUNCHER_PID_ENV, "")
    if not pid.isdigit():
        return None
    started = environ.get(LAUNCHER_START_ENV, "")

    def watch() -> None:
        while launcher_alive(int(pid), started):
            time.sleep(WATCH_S)
        launcher_gone_exit(int(pid))

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
