"""A stall is a failure with a name (megatron_dapo/progress.py, megatron_dapo/launch/watchdog.py): which process a
stall is blamed on, the fault places the tests name, and the watchdog itself in real processes that stop (SIGSTOP)
or hold the interpreter, without torch: the peer that names the stopped one and wakes it for its stacks, the
launcher's side for a lone stopped process, and faulthandler's backstop. The trainer's own stalls (a rank stopped
in its train step, its engine step, a checkpoint save, the rollout side in a weight update) are the end-to-end
tests' (tests/test_trainer.py, tests/test_sampler_runs.py, tests/test_launch.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import python_path, wait_until

from megatron_dapo import progress
from megatron_dapo.launch import watchdog
from megatron_dapo.launch.watchdog import STALL_EXIT, find_stall, read_stall

REPO = Path(__file__).resolve().parent.parent
NOW = 1_000_000.0


def _record(label: str, progress_at: float, beat: float = NOW, waiting=None, phase="step", exited=False) -> dict:
    return {
        "label": label,
        "host": "h",
        "pid": 1,
        "phase": phase,
        "step": 3,
        "point": "micro_batch",
        "progress_at": progress_at,
        "waiting": waiting,
        "beat": beat,
        "deadline": 10.0,
        "exited": exited,
    }


def test_a_process_that_cannot_run_is_named_first_else_the_first_to_stop_not_waiting():
    busy = _record("rank 0", NOW - 1)
    stopped = _record("rank 1", NOW - 30, beat=NOW - 11)  # its record is no longer refreshed
    stall = find_stall([busy, stopped], NOW)
    assert stall["culprit"]["label"] == "rank 1" and not stall["running"] and stall["seconds"] == 30
    # everyone alive, nobody progressing: the first that stopped while not waiting on others
    waited = _record("rank 0", NOW - 40, waiting="the other ranks (a sum)")
    stuck = _record("rank 1", NOW - 20)
    later = _record("rank 2", NOW - 12)
    stall = find_stall([waited, stuck, later], NOW)
    assert stall["culprit"]["label"] == "rank 1" and stall["running"]
    # all waiting (a deadlock between waits): the first that stopped
    assert find_stall([waited, _record("rank 1", NOW - 20, waiting="x")], NOW)["culprit"]["label"] == "rank 0"


def test_no_stall_while_one_progresses_or_starts_and_an_exited_process_is_not_waited_for():
    assert find_stall([_record("rank 0", NOW - 40), _record("rank 1", NOW - 9)], NOW) is None  # within 10 s
    assert find_stall([_record("rank 0", NOW - 40), _record("rank 1", NOW - 99, phase=progress.START_UP)], NOW) is None
    assert find_stall([_record("rank 0", NOW - 40, beat=NOW - 50, exited=True)], NOW) is None
    assert find_stall([], NOW) is None


def test_the_stall_line_names_phase_rank_host_seconds_and_the_stacks(tmp_path):
    stall = find_stall([_record("train 1", NOW - 31.6, beat=NOW - 12)], NOW)
    assert watchdog.stall_line(stall, tmp_path) == (
        "stall: train 1 (host h, pid 1) made no progress for 32 s in phase step of step 3, last at micro_batch; its "
        f"process is not running (stopped, or stuck in the kernel); every process's stacks: {tmp_path}/stacks"
    )


@pytest.mark.parametrize("text", ["stop:micro_batch", "halt:save:1:0", "stop:save:x", "stop:save:1:"])
def test_a_malformed_fault_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="DAPO_FAULT="):
        progress.parse_fault(text)


def test_a_fault_fires_at_its_place_for_its_process_once_per_run(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "STATE", progress.State(label="rank 1", fault_marker=tmp_path / "faults-fired"))
    monkeypatch.setenv(progress.FAULT_ENV, "corrupt:sync:2:1@rank1")
    assert not progress.fault("sync", 2, 0) and not progress.fault("sync", 1, 1) and not progress.fault("send", 2, 1)
    assert progress.fault("sync", 2, 1)
    assert not progress.fault("sync", 2, 1)  # fired once: a restart of the run does not fail there again
    assert (tmp_path / "faults-fired").read_text() == "corrupt:sync:2:1@rank1\n"
    progress.STATE.label, progress.STATE.fault_marker = "rank 0", None
    assert not progress.fault("sync", 2, 1)  # another process
    monkeypatch.setenv(progress.FAULT_ENV, "corrupt:micro_batch:3:1")
    progress.set_phase("step", step=3)
    assert progress.STATE.counts == {} and progress.STATE.step == 3
    progress.point("micro_batch")
    assert progress.STATE.counts == {"micro_batch": 1} and progress.STATE.point == "micro_batch"


# ---------------------------------------------------------------- real processes (no torch)

_SLOW_DUMP = """
def slow_dump(path):  # stacks that take 3 s to write, as a woken process scheduled late on a loaded machine writes them
    with open(path, "a") as f:
        for i in range(15):
            f.write(f"frame {i}\\n"); f.flush(); time.sleep(0.2)
        f.write("END\\n")
"""

_STAND_IN = (
    _SLOW_DUMP
    + """
import sys, time
from pathlib import Path
from megatron_dapo import progress
from megatron_dapo.launch.watchdog import Watchdog

log_dir, label, deadline = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
dog = Watchdog(log_dir, label, deadline, backstop_s=float(sys.argv[4])).start()
if sys.argv[5] == "slow-dump":  # woken, it writes its stacks as a thread scheduled late does
    import signal
    from megatron_dapo.launch.watchdog import STACK_SIGNAL

    signal.signal(STACK_SIGNAL, lambda *_: slow_dump(dog.stack_path))
if sys.argv[5] == "hold":
    time.sleep(2.5)  # start-up (a model loading) for longer than the backstop, which leaves start-up alone
progress.set_phase("work", step=1)
print("working", file=sys.stderr, flush=True)


def work():
    while True:
        progress.point("tick")
        if sys.argv[5] == "hold":  # catastrophic backtracking: the regular expression engine holds the GIL
            import re
            re.match(r"(a+)+$", "a" * 64 + "b")
        time.sleep(0.01)


work()
"""
)


def _stand_in(log_dir: Path, label: str, deadline: float, backstop: float = 60, how: str = "run", fault: str = ""):
    env = {**os.environ, "PYTHONPATH": python_path(REPO), progress.FAULT_ENV: fault}
    cmd = [sys.executable, "-c", _STAND_IN, str(log_dir), label, str(deadline), str(backstop), how]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _watching(log_dir: Path, proc: subprocess.Popen) -> None:
    """Until proc's watchdog has published: a peer that stopped before it started would be an earlier run's to it."""
    wait_until(
        lambda: any((log_dir / "progress").glob(f"*-{proc.pid}.json")), timeout=60, what="its watchdog", proc=proc
    )


def _reap(*procs: subprocess.Popen, timeout: float) -> list[str]:
    """Each process's stderr once it exits within timeout (killed, with everything else, if it does not)."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_a_peer_names_the_stopped_process_wakes_it_for_its_stacks_and_both_exit(tmp_path):
    """rank 1 stops itself (SIGSTOP) at its 20th progress point; rank 0 keeps making progress. rank 0's watchdog
    finds rank 1's record no longer refreshed, writes stall.json naming it, wakes it (STACK_SIGNAL, SIGCONT: it
    writes its stacks as stopped) and exits 75 with one line; rank 1, continued, sees the stall and exits 75."""
    deadline = 2.0
    a = _stand_in(tmp_path, "rank 0", deadline)
    _watching(tmp_path, a)
    b = _stand_in(tmp_path, "rank 1", deadline, fault="stop:tick:1:20@rank1")
    wait_until(lambda: b.poll() is None and _status(b.pid) == "T", timeout=60, what="rank 1 stopped")
    stopped_at = time.monotonic()
    err_a, err_b = _reap(a, b, timeout=deadline + 30)
    assert time.monotonic() - stopped_at < deadline + 30
    assert (a.returncode, b.returncode) == (STALL_EXIT, STALL_EXIT), err_a + err_b
    line = f"[rank 0] error: stall: rank 1 (host {watchdog.HOST}, pid {b.pid}) made no progress for "
    assert any(x.startswith(line) for x in err_a.splitlines()), err_a
    assert "in phase work of step 1, last at tick; its process is not running" in err_a
    assert read_stall(tmp_path)["culprit"]["label"] == "rank 1" and read_stall(tmp_path)["found_by"] == "rank 0"
    stacks = {p.name.split("-")[0]: p.read_text() for p in (tmp_path / "stacks").glob("*.txt")}
    assert " in fault\n" in stacks["rank1"] and " in work\n" in stacks["rank1"]  # where it stopped
    assert stacks["rank0"].startswith("--- rank 0: the run stalled (stall: rank 1 ")  # its own, at the stall
    records = {r["label"]: r for r in watchdog.read_records(tmp_path)}
    assert records["rank 1"]["phase"] == "work" and records["rank 0"]["counter"] > 20


def test_a_woken_process_ends_itself_only_once_its_stacks_are_written(tmp_path):
    """The stopped rank, continued, finds the stall that names it and exits 75, but not before the stacks it was
    woken for are written whole: they are written in another thread (faulthandler's, on a real process), and an exit
    while they are being written cuts them short (the end-to-end tests' flake: 117 bytes of a dump)."""
    deadline = 1.0
    a = _stand_in(tmp_path, "rank 0", deadline)
    _watching(tmp_path, a)
    b = _stand_in(tmp_path, "rank 1", deadline, how="slow-dump", fault="stop:tick:1:10@rank1")
    err_a, err_b = _reap(a, b, timeout=deadline + 30)
    assert (a.returncode, b.returncode) == (STALL_EXIT, STALL_EXIT), err_a + err_b
    [stacks] = [p.read_text() for p in (tmp_path / "stacks").glob("rank1-*.txt")]
    assert stacks.endswith("frame 14\nEND\n"), stacks


def test_the_launcher_wakes_a_lone_stopped_process_kills_it_and_collects_its_stacks(tmp_path, capsys):
    """A process alone (nobody else to notice): the launcher's watch finds its record no longer refreshed, then wakes
    it for its stacks, kills it and reports the stall's line and those stacks (launch local's `stalled`)."""
    from megatron_dapo.launch.local import stalled

    proc = _stand_in(tmp_path, "rank 0", 1.5, fault="stop:tick:1:5")
    try:
        wait_until(lambda: watchdog.watch_run(tmp_path) is not None, timeout=60, what="the stall", proc=proc)
        assert stalled(tmp_path, [proc]) == STALL_EXIT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode in (-signal.SIGKILL, STALL_EXIT)  # killed, or it saw the stall first once continued
    report = capsys.readouterr().err
    assert report.startswith(f"error: stall: rank 0 (host {watchdog.HOST}, pid {proc.pid}) made no progress")
    assert f"collected in {tmp_path / 'stacks.txt'}" in report and " in fault\n" in report
    collected = (tmp_path / "stacks.txt").read_text()
    assert collected.startswith(f"==== rank0-{watchdog.HOST}-{proc.pid} ====\n") and " in work\n" in collected
    assert json.loads((tmp_path / "stall.json").read_text())["found_by"] == "the launcher"


SLOW_WRITER = (
    _SLOW_DUMP
    + """
import signal, sys, time
signal.signal(signal.SIGURG, lambda *_: slow_dump(sys.argv[1]))
print("ready", flush=True)
time.sleep(60)
"""
)


def test_the_woken_are_waited_for_until_their_stacks_are_written_and_no_longer(tmp_path, monkeypatch):
    """wake_for_stacks returns once a woken process's stack file grew and then stayed unchanged: a dump written over
    3 s is there whole (a fixed 2 s cut it short), and one that never comes is waited for WAKE_GRACE_S, no longer."""
    from megatron_dapo.launch.lifeline import start_time

    (tmp_path / "progress").mkdir()
    procs = {}
    for label, code in (("slow", SLOW_WRITER), ("mute", "import time; print('ready', flush=True); time.sleep(60)")):
        stacks = tmp_path / f"{label}.txt"
        proc = subprocess.Popen([sys.executable, "-c", code, str(stacks)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        record = {"label": label, "host": watchdog.HOST, "pid": proc.pid, "start": start_time(proc.pid),
                  "beat": time.time(), "stacks": str(stacks)}  # fmt: skip
        (tmp_path / "progress" / f"{label}.json").write_text(json.dumps(record))
        procs[label] = proc
    try:
        monkeypatch.setattr(watchdog, "WAKE_GRACE_S", 6.0)
        t0 = time.monotonic()
        watchdog.wake_for_stacks(tmp_path, [procs["slow"].pid])
        took = time.monotonic() - t0
        assert (tmp_path / "slow.txt").read_text().endswith("frame 14\nEND\n") and 3.0 < took < 5.0, took
        monkeypatch.setattr(watchdog, "WAKE_GRACE_S", 1.0)
        t0 = time.monotonic()
        watchdog.wake_for_stacks(tmp_path, [procs["mute"].pid])
        assert 1.0 <= time.monotonic() - t0 < 3.0 and not (tmp_path / "mute.txt").exists()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_backstop_dumps_and_ends_a_process_whose_watchdog_cannot_run(tmp_path):
    """The interpreter held by one C call (its watchdog thread never runs): faulthandler's backstop, re-armed at each
    progress point, writes every thread's stack and exits 1; the start-up before it, longer than the backstop and
    without a progress point, is not a stall."""
    proc = _stand_in(tmp_path, "rank 0", 30.0, backstop=1.0, how="hold")
    [err] = _reap(proc, timeout=60)
    assert proc.returncode == 1 and "working" in err
    [stacks] = list((tmp_path / "stacks").glob("*.txt"))
    text = stacks.read_text()
    assert text.startswith("Timeout (0:00:01)!") and " in work\n" in text


def _status(pid: int) -> str:
    """/proc/<pid>/stat's state letter (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_an_earlier_run_s_records_and_stall_in_the_same_folder_are_not_this_run_s(tmp_path):
    """A folder used twice (a torchrun rendezvous id given again): records not refreshed since this run started and
    a stall.json claimed before it are ignored, and this run's own stall replaces the old one."""
    (tmp_path / "progress").mkdir()
    old = {**_record("rank 0", NOW - 500, beat=NOW - 400), "label": "rank 0"}
    (tmp_path / "progress" / "rank0-h-1.json").write_text(json.dumps(old))
    (tmp_path / watchdog.STALL_FILE).write_text(json.dumps({"line": "an old stall", "at": NOW - 300}))
    since = NOW - 100
    assert watchdog.read_records(tmp_path, since) == [] and watchdog.read_records(tmp_path)[0]["label"] == "rank 0"
    assert read_stall(tmp_path, since) is None and read_stall(tmp_path)["line"] == "an old stall"
    stall = find_stall([_record("rank 1", NOW - 60, beat=NOW - 30)], NOW)
    claimed = watchdog.claim_stall(tmp_path, stall, "rank 0", since)
    assert claimed["culprit"]["label"] == "rank 1" and read_stall(tmp_path, since)["found_by"] == "rank 0"


def test_the_waits_between_the_asynchronous_sides_end_at_the_collective_timeout():
    """The train side's wait for a batch (or an evaluation) and the controller's wait for the train side: at most
    trainer.collective_timeout_s, then a TimeoutError naming what did not come (their own code, on a bare state)."""
    from types import SimpleNamespace

    from megatron_dapo.placement.controller import RolloutController
    from megatron_dapo.placement.remote import RemoteRollout

    train = SimpleNamespace(timeout_s=0.3, POLL_S=0.01)
    error, took = _ends(lambda: RemoteRollout._poll(train, lambda: False, "batch 7"))
    assert isinstance(error, TimeoutError) and 0.3 <= took < 5
    assert "did not hand over batch 7 within trainer.collective_timeout_s=0.3 s" in str(error)
    served = []  # the train side asks for something once, then nothing: the deadline counts from its last ask
    rollout = SimpleNamespace(
        timeout_s=0.3,
        POLL_S=0.01,
        served=4,
        weights_version=3,
        _service=lambda boundary: not served and not served.append(1),
    )
    error, took = _ends(lambda: RolloutController._wait(rollout, lambda: False))
    assert isinstance(error, TimeoutError) and 0.3 <= took < 5 and served == [1]
    assert "the train side asked for nothing within trainer.collective_timeout_s=0.3 s" in str(error)


def _ends(wait, limit: float = 10.0) -> tuple[BaseException | None, float]:
    """(what wait() raised, the seconds it took), run in a thread: a wait without its deadline fails the test in
    `limit` seconds instead of hanging it."""
    import threading

    box: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            box["error"] = e
        box["took"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting after {limit} s: the wait has no deadline"
    return box.get("error"), box["took"]
