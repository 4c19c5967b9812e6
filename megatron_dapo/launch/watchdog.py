"""A stall is a failure with a name (docs/training.md, "When a run stalls").

Every process of a run (each rank, both asynchronous sides) runs a watchdog thread that publishes where the process
is (megatron_dapo/progress.py: phase, step, progress counter, whether it waits on others) to the run's log folder,
and reads what the others published. When no process has reached a progress point for trainer.stall_timeout_s, or
one has stopped running altogether (its record is no longer refreshed: stopped, stuck in the kernel, its
interpreter held), the run has stalled: the first to see it writes stall.json naming that process (phase, rank,
host, seconds), every process that sees stall.json writes its stacks and exits with STALL_EXIT, and a process on
the same host that cannot run is sent STACK_SIGNAL then SIGCONT, so it writes its own stacks (faulthandler, in C)
before it is killed. faulthandler's dump_traceback_later, re-armed at each progress point (progress.py), is the
backstop for a process whose watchdog thread itself cannot run.

A launcher (launch local, a Ray actor, a Slurm node's stall_watch) does the same for its processes from outside:
`watch_run` sees a stall.json or a record of a process of its own host that stopped being refreshed; then
`end_stalled` wakes every process of the run for its stacks, kills them and collects the stacks into stacks.txt.

The run's log folder (run_log_dir): DAPO_LOG_DIR where a launcher sets it (launch local and ray:
run_dir/logs/<launch>, a Ray restart its own attempt_N; Slurm: the attempt's log folder), else run_dir/logs/<the
torchrun run id, or this process's own id>. In it:

    progress/<label>-<host>-<pid>.json   each process's record, rewritten every few seconds
    stacks/<label>-<host>-<pid>.txt      each process's stacks (at a stall, on STACK_SIGNAL, by the backstop)
    stall.json                           the stall: who, where, for how long (the first finder's)
    stacks.txt                           every process's stacks, collected by the launcher at the end
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_dapo import progress
from megatron_dapo.launch.lifeline import RUN_TAG_ENV, kill_descendants, start_time

STALL_EXIT = 75
"""The exit status of a process (and a launcher) that ended a stalled run: EX_TEMPFAIL, try again."""
STACK_SIGNAL = signal.SIGURG
"""Asks a process of the run to write every thread's stack (its default action is to ignore it, so a process that
registered nothing is unharmed; SIGUSR1 and SIGUSR2 are the stop signals)."""
LOG_DIR_ENV = "DAPO_LOG_DIR"
STALL_FILE = "stall.json"
WAKE_GRACE_S = 20.0
"""The longest a process woken for its stacks is waited for (one stuck in the kernel never writes them; on a loaded
machine one is scheduled late: two fixed seconds cut a dump short); one that has written them is not waited for."""
WRITTEN_QUIET_S = 0.5
"""A woken process has written its stacks once its stack file grew and then stayed this long unchanged."""
HOST = socket.gethostname()


def run_log_dir(run_dir: str | Path, environ: Optional[dict[str, str]] = None) -> Path:
    """The log folder of this attempt of the run (module docstring)."""
    environ = os.environ if environ is None else environ
    if environ.get(LOG_DIR_ENV):
        return Path(environ[LOG_DIR_ENV])
    run_id = environ.get(RUN_TAG_ENV) or environ.get("TORCHELASTIC_RUN_ID") or f"{HOST}-{os.getpid()}"
    return Path(run_dir) / "logs" / run_id


def _name(label: str) -> str:
    return f"{label.replace(' ', '')}-{HOST}-{os.getpid()}"


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a reader sees the old record or the new one, never half of one


def read_records(log_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """Every process's last record refreshed at `since` or later (older ones are an earlier run's that used the same
    folder: a torchrun rendezvous id given twice); an unreadable one is skipped."""
    out = []
    for path in sorted((log_dir / "progress").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if record["beat"] >= since:
                out.append(record)
    return out


def read_stall(log_dir: Path, since: float = 0.0) -> Optional[dict[str, Any]]:
    """The stall claimed in log_dir at `since` or later (an older one is an earlier run's), or None."""
    with contextlib.suppress(OSError, ValueError):
        stall = json.loads((log_dir / STALL_FILE).read_text())
        return stall if stall["at"] >= since else None
    return None


def find_stall(records: list[dict[str, Any]], now: float) -> Optional[dict[str, Any]]:
    """The stall among records, or None: {"culprit": its record, "running": whether its process still runs, "seconds":
    since its last progress}. A process whose record was not refreshed within its deadline cannot run (first);
    else, when no process made progress within the deadline (one still starting counts as progressing), the one
    whose progress stopped first while it was not waiting on others (all waiting: the first to stop)."""
    live = [r for r in records if not r.get("exited")]
    stopped = [r for r in live if now - r["beat"] > r["deadline"]]
    if stopped:
        culprit, running = min(stopped, key=lambda r: r["beat"]), False
    elif live and not any(r["phase"] == progress.START_UP or now - r["progress_at"] <= r["deadline"] for r in live):
        culprit, running = min([r for r in live if not r["waiting"]] or live, key=lambda r: r["progress_at"]), True
    else:
        return None
    return {"culprit": culprit, "running": running, "seconds": now - culprit["progress_at"]}


def stall_line(stall: dict[str, Any], log_dir: Path) -> str:
    """The one line a stall is reported in: phase, rank, host, seconds, and where the stacks are."""
    r = stall["culprit"]
    where = f"phase {r['phase']}" + (f" of step {r['step']}" if r["step"] else "")
    last = f", last at {r['point']}" if r["point"] else ""
    state = "its process is not running (stopped, or stuck in the kernel)" if not stall["running"] else (
        f"waiting on {r['waiting']}" if r["waiting"] else "not waiting on other processes"
    )  # fmt: skip
    return (
        f"stall: {r['label']} (host {r['host']}, pid {r['pid']}) made no progress for {stall['seconds']:.0f} s in "
        f"{where}{last}; {state}; every process's stacks: {log_dir}/stacks"
    )


def claim_stall(log_dir: Path, stall: dict[str, Any], by: str, since: float = 0.0) -> dict[str, Any]:
    """Write stall.json unless another process of this run (one claimed at `since` or later) already did; the stall
    it holds (the first finder's)."""
    path = log_dir / STALL_FILE
    record = {**stall, "line": stall_line(stall, log_dir), "found_by": by, "at": time.time()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    try:
        if read_stall(log_dir) is not None and read_stall(log_dir, since) is None:
            os.replace(tmp, path)  # an earlier run's
        else:
            os.link(tmp, path)  # fails if it exists: of two finders one wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_stall(log_dir, since) or record


def _alive(record: dict[str, Any]) -> bool:
    return record["host"] == HOST and start_time(record["pid"]) == record.get("start")


def wake_for_stacks(log_dir: Path, pids: Iterable[int]) -> None:
    """STACK_SIGNAL, then SIGCONT: a stopped process has the first pending until it is continued, then writes its
    stacks (faulthandler, in C, before any Python code runs). Returns once every one of pids with a record in log_dir
    has written them (wait_written)."""
    pids = set(pids)
    files = {Path(r["stacks"]) for r in read_records(log_dir) if r["pid"] in pids and _alive(r) and "stacks" in r}
    seen = {f: _size(f) for f in files}
    for sig in (STACK_SIGNAL, signal.SIGCONT):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    wait_written(seen)


def wait_written(seen: dict[Path, int]) -> None:
    """Returns once each file has grown from its size in seen and then stayed unchanged WRITTEN_QUIET_S (a dump written
    whole), or after WAKE_GRACE_S (a process that never writes)."""
    pending, grew = dict(seen), {}  # file -> its last size; file -> when it last grew
    deadline = time.monotonic() + WAKE_GRACE_S
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        for f in list(pending):
            size = _size(f)
            if size != pending[f]:
                pending[f], grew[f] = size, now
            elif f in grew and now - grew[f] >= WRITTEN_QUIET_S:
                del pending[f]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


class Watchdog:
    """This process's watchdog thread (module docstring). label: 'rank R', 'train R' or 'rollout R'; deadline:
    trainer.stall_timeout_s; backstop_s: faulthandler's last resort (collective timeout + deadline)."""

    def __init__(
        self, log_dir: Path, label: str, deadline: float, backstop_s: float, fault_marker: Optional[Path] = None
    ) -> None:
        self.log_dir, self.label, self.deadline = log_dir, label, deadline
        self.publish_s = min(5.0, max(0.2, deadline / 10))
        self.check_s = min(30.0, max(0.5, deadline / 5))
        for sub in ("progress", "stacks"):
            (log_dir / sub).mkdir(parents=True, exist_ok=True)
        self.record_path = log_dir / "progress" / f"{_name(label)}.json"
        self.stack_path = log_dir / "stacks" / f"{_name(label)}.txt"
        self.stacks = open(self.stack_path, "a")  # noqa: SIM115 - faulthandler writes to it until the process ends
        faulthandler.register(STACK_SIGNAL, file=self.stacks, all_threads=True, chain=False)
        progress.STATE.label = label
        progress.STATE.fault_marker = fault_marker
        progress.arm_backstop(backstop_s, self.stacks)
        self.exited = False
        self.stacks_size = _size(self.stack_path)
        self.started = time.time()  # what the folder holds from before (an earlier run's) is not this run's
        self._publishing = threading.Lock()  # the thread and stop() both publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
        progress.STATE.on_change = self.publish

    def start(self) -> Watchdog:
        self.publish()
        self._thread.start()
        return self

    def record(self) -> dict[str, Any]:
        s = progress.STATE
        return {
            "label": self.label,
            "host": HOST,
            "pid": os.getpid(),
            "start": start_time(os.getpid()),
            "phase": s.phase,
            "step": s.step,
            "point": s.point,
            "counter": s.counter,
            "progress_at": s.progress_at,
            "waiting": s.waiting,
            "beat": time.time(),
            "deadline": self.deadline,
            "groups": dict(s.groups),
            "exited": self.exited,
            "stacks": str(self.stack_path),
        }

    def publish(self) -> None:
        with self._publishing, contextlib.suppress(OSError):
            _write_json(self.record_path, self.record())

    def stop(self) -> None:
        """This process is leaving (a clean exit or an error): no longer one to wait for."""
        self.exited = True
        self._stop.set()
        progress.disarm_backstop()
        progress.STATE.on_change = lambda: None
        self.publish()

    def _run(self) -> None:
        checked = 0.0
        while True:
            self.stacks_size = _size(self.stack_path)  # before a stop: what the dump written once woken grows from
            if self._stop.wait(self.publish_s):
                return
            self.publish()
            now = time.time()
            if now - checked < self.check_s:
                continue
            checked = now
            stall = read_stall(self.log_dir, self.started)
            if stall is None:
                found = find_stall(read_records(self.log_dir, self.started), now)
                if found is None:
                    continue
                stall = claim_stall(self.log_dir, found, self.label, self.started)
            self._end(stall)

    def _end(self, stall: dict[str, Any]) -> None:
        """This process's part in ending a stalled run: wake what cannot run on this host, write its stacks and
        one line, stop its children, exit STALL_EXIT."""
        culprit = stall["culprit"]
        me = culprit["host"] == HOST and culprit["pid"] == os.getpid()
        if me and not stall["running"]:  # woken: faulthandler writes its stacks in another thread, which exit would cut
            wait_written({self.stack_path: self.stacks_size})
        elif not self.exited:
            stopped = [
                r["pid"]
                for r in read_records(self.log_dir, self.started)
                if not r.get("exited")
                and _alive(r)
                and r["pid"] != os.getpid()
                and time.time() - r["beat"] > r["deadline"]
            ]
            wake_for_stacks(self.log_dir, stopped)
            self.stacks.write(f"--- {self.label}: the run stalled ({stall['line']}) ---\n")
            self.stacks.flush()
            faulthandler.dump_traceback(file=self.stacks, all_threads=True)
            self.stacks.flush()
        with contextlib.suppress(Exception):
            print(f"[{self.label}] error: {stall['line']}", file=sys.stderr, flush=True)
        kill_descendants()
        os._exit(STALL_EXIT)  # from a thread: the main thread is stuck where the stall left it


def start_watchdog(run_dir: str | Path, label: str, deadline: float, collective_timeout: float) -> Watchdog:
    """This process's watchdog over the run in run_dir (trainer.stall_timeout_s, trainer.collective_timeout_s); a
    DAPO_FAULT fires once per run directory (run_dir/logs/faults-fired)."""
    marker = Path(run_dir) / "logs" / "faults-fired"
    return Watchdog(run_log_dir(run_dir), label, deadline, collective_timeout + deadline, marker).start()


# ---------------------------------------------------------------- the launchers' side


def watch_run(log_dir: Path, since: float = 0.0) -> Optional[dict[str, Any]]:
    """What a launcher (started at `since`) looks for while its processes run: the stall.json a process wrote, or a
    process of this host whose record stopped being refreshed (it cannot run: it wrote nothing, so stall.json is
    written here)."""
    stall = read_stall(log_dir, since)
    if stall is not None:
        return stall
    now = time.time()
    found = find_stall([r for r in read_records(log_dir, since) if _alive(r)], now)
    if found is None or found["running"]:  # a process that runs finds its own stall
        return None
    return claim_stall(log_dir, found, "the launcher", since)


def end_stalled(log_dir: Path, pids: list[int], kill: Any) -> str:
    """Wake pids (the run's processes under this launcher) for their stacks and wait for them (wake_for_stacks), kill
    them with kill(), collect every stack file into stacks.txt; returns the report: the stall's line, then the
    stalled process's stacks if this host has them."""
    wake_for_stacks(log_dir, pids)
    kill()
    collected = collect_stacks(log_dir)
    stall = read_stall(log_dir) or {}
    report = [f"error: {stall.get('line', 'the run stalled')}; collected in {collected}"]
    culprit = stall.get("culprit", {})
    if culprit.get("host") == HOST and culprit.get("stacks") and Path(culprit["stacks"]).is_file():
        report.append(f"the stacks of {culprit['label']} (pid {culprit['pid']}):")
        report.append(Path(culprit["stacks"]).read_text().rstrip())
    return "\n".join(report)


def collect_stacks(log_dir: Path) -> Path:
    """Every non-empty stack file of the run, one after another under a header each, into log_dir/stacks.txt."""
    out = log_dir / "stacks.txt"
    parts = []
    for path in sorted((log_dir / "stacks").glob("*.txt")):
        with contextlib.suppress(OSError):
            text = path.read_text()
            if text.strip():
                parts.append(f"==== {path.stem} ====\n{text.rstrip()}\n")
    out.write_text("\n".join(parts))
    return out


def node_watch(log_dir: Path) -> int:
    """A Slurm node's launcher side (slurm/torchrun_node.sh runs it beside torchrun): until its parent (torchrun, which
    the script became) ends, look for a stall; then wake this node's processes of the run for their stacks, kill them
    and report. STALL_EXIT after a stall, else 0."""
    parent, since = os.getppid(), time.time()
    while os.getppid() == parent:
        if watch_run(log_dir, since) is not None:
            pids = [r["pid"] for r in read_records(log_dir, since) if _alive(r)]
            print(end_stalled(log_dir, pids, lambda pids=pids: _kill_trees(pids)), file=sys.stderr, flush=True)
            return STALL_EXIT
        time.sleep(1.0)
    return 0


def _kill_trees(pids: list[int]) -> None:
    """SIGKILL each pid and everything under it."""
    import psutil

    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()


def main(argv: list[str]) -> int:
    """`--node LOG_DIR`: node_watch; `--collect LOG_DIR`: collect the stacks and print the stall's line."""
    if len(argv) != 2 or argv[0] not in ("--node", "--collect"):
        print("usage: python -m megatron_dapo.launch.watchdog --node|--collect LOG_DIR", file=sys.stderr)
        return 2
    log_dir = Path(argv[1])
    if argv[0] == "--node":
        return node_watch(log_dir)
    collect_stacks(log_dir)
    print((read_stall(log_dir) or {}).get("line", "no stall.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
