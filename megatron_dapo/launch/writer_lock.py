"""One live writer per run directory: trainer.run_dir/.writer.lock (docs/training.md, "One writer per run directory").

The process that writes checkpoints and metrics (rank 0 of the train side) takes the lock before it builds anything.
The file holds the owner's host, pid (and that pid's start time), job tag and a nonce of its own; a daemon thread
refreshes its mtime every HEARTBEAT_S. A second writer is refused with one line while the heartbeat is fresh, and
takes the lock over, saying so, when

- the heartbeat is older than STALE_S (the owner's machine is gone, or it hangs without its thread running),
- the owner is on this host and not running (killed: nothing released the lock), or is this very process,
- the owner carries this process's job tag: the same Slurm job (a requeue: SLURM_JOB_ID) or the same launch (a Ray
  restart: the driver's DAPO_RUN_TAG).

Creation is atomic (a file written aside, then hard-linked to the lock's name: link fails if the name exists), so of
two starters one wins; takeovers go one at a time under a guard file created the same way: the taker reads the lock
again, and if it is still the owner it judged, overwrites it in one rename. A clean exit removes the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_dapo.cli import UserError
from megatron_dapo.launch.lifeline import RUN_TAG_ENV, start_time

LOCK_NAME = ".writer.lock"
HEARTBEAT_S = 5.0
"""How often the owner refreshes the lock's mtime."""
STALE_S = 60.0
"""A lock whose heartbeat is older than this is taken over (its owner stopped beating: gone, or hung)."""
ATTEMPTS = 20
"""Takeovers lost to another starter before giving up."""
GUARD_STALE_S = 10.0
"""A takeover guard older than this was left by a taker that died holding it (a takeover holds it milliseconds)."""


class RunDirLocked(UserError):
    """Another live process writes this run directory."""


def job_tag(environ: Optional[dict[str, str]] = None) -> str:
    """What a restart of the same job shares: the Slurm job (a requeue keeps its id), else the launch's run tag (a Ray
    driver's attempts share it); "" for neither."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}"
    return environ.get(RUN_TAG_ENV, "")


def _read(path: Path) -> tuple[Optional[dict[str, Any]], Optional[float]]:
    """(the owner's record, the lock's mtime); (None, None) when there is no lock; ({}, mtime) for an unreadable
    one (half written by hand: judged by its heartbeat alone)."""
    try:
        mtime = path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    try:
        owner = json.loads(text)
        return (owner if isinstance(owner, dict) else {}), mtime
    except ValueError:
        return {}, mtime


class WriterLock:
    """The lock on run_dir, held by this process from acquire() to release()."""

    def __init__(self, run_dir: Path, record: dict[str, Any]) -> None:
        self.run_dir, self.path, self.record = run_dir, run_dir / LOCK_NAME, record
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    @classmethod
    def acquire(
        cls,
        run_dir: str | os.PathLike,
        tag: Optional[str] = None,
        log: Callable[[str], None] = print,
        heartbeat: bool = True,
    ) -> WriterLock:
        """Take the lock on run_dir (created if missing) or raise RunDirLocked naming its live owner; log(line) says
        when a lock was taken over. tag: this process's job tag (default job_tag())."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": start_time(os.getpid()) or "",
            "tag": job_tag() if tag is None else tag,
            "nonce": secrets.token_hex(8),
        }
        lock = cls(run_dir, record)
        for _ in range(ATTEMPTS):
            if lock._create():
                break
            owner, mtime = _read(lock.path)
            if owner is None:
                continue  # released meanwhile: try again
            why = lock._takeover_reason(owner, mtime)
            if why is None:
                raise RunDirLocked(lock._refusal(owner, mtime))
            if lock._replace(owner):
                log(f"{run_dir}: took over the writer lock of {_who(owner)} ({why})")
                break
            time.sleep(0.01 * (1 + secrets.randbelow(10)))  # another taker holds the guard: let it finish
        else:
            raise RunDirLocked(f"{run_dir}: could not take the writer lock ({ATTEMPTS} tries lost to other starters)")
        if heartbeat:
            lock._beat = threading.Thread(target=lock._heartbeat, name="writer-lock", daemon=True)
            lock._beat.start()
        return lock

    def _create(self) -> bool:
        """Atomically create the lock holding this record; False when one exists."""
        tmp = self.run_dir / f"{LOCK_NAME}.{self.record['nonce']}"
        return _link_new(self.path, tmp, json.dumps(self.record) + "\n")

    def _takeover_reason(self, owner: dict[str, Any], mtime: float) -> Optional[str]:
        """Why the lock of owner (heartbeat at mtime) may be taken over; None: it is live, refuse."""
        age = time.time() - mtime
        if age > STALE_S:
            return f"its heartbeat is {age:.0f} s old, over {STALE_S:g} s"
        if owner.get("host") == self.record["host"] and isinstance(owner.get("pid"), int):
            running = start_time(owner["pid"])
            if running is None or (owner.get("start") and running != owner["start"]):
                return "it is not running on this host"
            if owner["pid"] == os.getpid():
                return "it is this process"
        if owner.get("tag") and owner.get("tag") == self.record["tag"]:
            return f"the same job, {owner['tag']}"
        return None

    def _refusal(self, owner: dict[str, Any], mtime: float) -> str:
        age = time.time() - mtime
        return (
            f"{self.run_dir} is being written by {_who(owner)}, whose heartbeat is {age:.0f} s old: stop that run "
            f"first (or use another trainer.run_dir); its lock {self.path} is taken over once its heartbeat is over "
            f"{STALE_S:g} s old or that process is gone"
        )

    def _replace(self, owner: dict[str, Any]) -> bool:
        """Replace the lock of `owner` (judged gone) by this one; False when another starter got there first. One taker
        at a time: the takeover guard is created atomically, and under it the lock is read again and, still owner's,
        overwritten in one rename; a guard older than GUARD_STALE_S is a taker's that died holding it, removed."""
        guard = self.run_dir / f"{LOCK_NAME}.takeover"
        if not _link_new(guard, self.run_dir / f"{guard.name}.{self.record['nonce']}", self.record["nonce"]):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - guard.stat().st_mtime > GUARD_STALE_S:
                    guard.unlink()
            return False
        try:
            current, _ = _read(self.path)
            if current is None or current.get("nonce") != owner.get("nonce"):
                return False  # taken over or released meanwhile: judge again
            tmp = self.run_dir / f"{LOCK_NAME}.{self.record['nonce']}"
            tmp.write_text(json.dumps(self.record) + "\n")
            os.replace(tmp, self.path)
            return True
        finally:
            guard.unlink()

    def held(self) -> bool:
        """The lock file is still this process's."""
        owner, _ = _read(self.path)
        return owner is not None and owner.get("nonce") == self.record["nonce"]

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held():  # taken over (our heartbeat stalled) or removed by hand: not ours to touch
                print(f"warning: {self.path} is no longer this process's; the heartbeat stops", flush=True)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=HEARTBEAT_S)
        if self.held():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _link_new(path: Path, tmp: Path, text: str) -> bool:
    """Create path holding text, atomically (written to tmp, hard-linked: the link fails if path exists, also over
    NFS, where O_EXCL may not hold); False when path exists."""
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _who(owner: dict[str, Any]) -> str:
    where = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
    return f"{where} (job {owner['tag']})" if owner.get("tag") else where
