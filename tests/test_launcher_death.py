"""Nothing of a run outlives its launcher, and a run directory has one live writer (megatron_dapo/launch/lifeline.py,
megatron_dapo/launch/writer_lock.py): the lock's rules in this process and in racing processes, the launcher watch and
torchrun's parent-death signal with stand-in processes, and which side the local launcher blames. A real run's
launcher killed -9 (the asynchronous sides at eta = 1, the train side under torchrun), after which nothing of the run
is left within 10 s and the next launch takes the lock over and resumes, is one stage of
tests/test_sampler_runs.py's asynchronous end-to-end test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import python_path, wait_until

from megatron_dapo.launch import writer_lock
from megatron_dapo.launch.lifeline import RUN_TAG_ENV, launcher_alive, start_time
from megatron_dapo.launch.writer_lock import LOCK_NAME, RunDirLocked, WriterLock

HOST = socket.gethostname()


def _write_lock(run_dir: Path, age_s: float = 0.0, **owner) -> Path:
    """A lock as another writer left it, its heartbeat age_s old."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": HOST, "tag": "", "nonce": "theirs", **owner}) + "\n")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.fixture
def other_writer():
    """A live process on this host that is not this one: (pid, its start time)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc.pid, start_time(proc.pid)
    proc.kill()
    proc.wait()


def _acquire(run_dir: Path, tag: str = "mine") -> tuple[WriterLock, list[str]]:
    said: list[str] = []
    return WriterLock.acquire(run_dir, tag=tag, log=said.append, heartbeat=False), said


def test_a_live_writer_with_a_fresh_heartbeat_is_refused_in_one_line(tmp_path, other_writer):
    pid, start = other_writer
    path = _write_lock(tmp_path, age_s=writer_lock.STALE_S - 5, pid=pid, start=start, tag="job-a")
    before = path.read_text()
    with pytest.raises(RunDirLocked) as e:
        _acquire(tmp_path, tag="job-b")
    text = str(e.value)
    assert "\n" not in text and str(tmp_path) in text and f"pid {pid} on {HOST}" in text
    assert "heartbeat is 55 s old" in text
    assert path.read_text() == before  # untouched
    # another host's writer is not judged by its pid: only by its heartbeat
    _write_lock(tmp_path, age_s=writer_lock.STALE_S - 5, host="elsewhere", pid=os.getpid() + 10**6)
    with pytest.raises(RunDirLocked, match="on elsewhere"):
        _acquire(tmp_path)


def test_a_stale_heartbeat_is_taken_over_saying_so(tmp_path):
    _write_lock(tmp_path, age_s=writer_lock.STALE_S + 5, host="elsewhere", pid=1234)
    lock, said = _acquire(tmp_path)
    assert lock.held() and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert said == [
        f"{tmp_path}: took over the writer lock of pid 1234 on elsewhere (its heartbeat is 65 s old, over 60 s)"
    ]
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists() and sorted(os.listdir(tmp_path)) == []  # nothing left aside


def test_a_dead_owner_on_this_host_is_taken_over_and_a_reused_pid_too(tmp_path, other_writer):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path, pid=gone.pid, start="1", tag="job-a")
    lock, said = _acquire(tmp_path, tag="job-b")
    assert said[0].endswith("(it is not running on this host)")
    lock.release()
    pid, start = other_writer  # running, but started at another time than the lock's owner: a reused pid
    _write_lock(tmp_path, pid=pid, start=str(int(start) - 1), tag="job-a")
    lock, said = _acquire(tmp_path, tag="job-b")
    assert said[0].endswith("(it is not running on this host)")
    lock.release()


def test_the_same_job_takes_over_a_live_owner(tmp_path, other_writer):
    """A Slurm requeue (SLURM_JOB_ID) or a Ray restart (the driver's run tag) of the same job."""
    pid, start = other_writer
    _write_lock(tmp_path, pid=pid, start=start, tag="slurm:4242")
    assert writer_lock.job_tag({"SLURM_JOB_ID": "4242", RUN_TAG_ENV: "x"}) == "slurm:4242"
    assert writer_lock.job_tag({RUN_TAG_ENV: "x"}) == "x" and writer_lock.job_tag({}) == ""
    lock, said = _acquire(tmp_path, tag="slurm:4242")
    assert said[0].endswith("(the same job, slurm:4242)")
    lock.release()
    _write_lock(tmp_path, pid=pid, start=start, tag="")  # no tag on either side: never the same job
    with pytest.raises(RunDirLocked):
        _acquire(tmp_path, tag="")


def test_a_takeover_replaces_only_the_owner_it_judged_and_one_at_a_time(tmp_path):
    """Two starters judged the same dead owner; the first replaced it with its own lock before the second came: the
    second must leave the first's lock alone. A taker holding the guard makes the others wait; a guard left by a
    taker that died is cleared once stale."""
    path = _write_lock(tmp_path, pid=1, start="1", nonce="first-taker")
    lock = WriterLock(tmp_path, {"nonce": "second-taker"})
    assert lock._replace({"nonce": "dead-owner"}) is False
    assert json.loads(path.read_text())["nonce"] == "first-taker" and sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    guard = tmp_path / f"{LOCK_NAME}.takeover"
    guard.write_text("another taker")
    assert lock._replace({"nonce": "first-taker"}) is False and guard.exists()  # not while another holds the guard
    os.utime(guard, (time.time() - 60, time.time() - 60))
    assert lock._replace({"nonce": "first-taker"}) is False and not guard.exists()  # a dead taker's guard: cleared
    assert lock._replace({"nonce": "first-taker"}) is True
    assert json.loads(path.read_text())["nonce"] == "second-taker" and os.listdir(tmp_path) == [LOCK_NAME]


def test_the_trainer_refuses_a_run_directory_another_writer_holds(tmp_path, other_writer, run_main):
    """Rank 0 takes the lock before it builds anything: one error line, nothing written, the lock untouched."""
    from megatron_dapo.train import main

    pid, start = other_writer
    path = _write_lock(tmp_path, pid=pid, start=start, tag="theirs")
    code, lines = run_main(main, [f"trainer.run_dir={tmp_path}", "trainer.total_steps=1"])
    assert code == 1 and lines[-1].startswith(f"error: {tmp_path} is being written by pid {pid} on {HOST}"), lines
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME] and json.loads(path.read_text())["pid"] == pid


def test_the_heartbeat_refreshes_the_lock_and_a_clean_exit_releases_it(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_lock, "HEARTBEAT_S", 0.05)
    lock = WriterLock.acquire(tmp_path, tag="t")
    path = tmp_path / LOCK_NAME
    then = time.time() - 30
    os.utime(path, (then, then))
    wait_until(lambda: path.stat().st_mtime > then + 20, timeout=10, what="a heartbeat")
    lock.release()
    assert not path.exists() and not lock._beat.is_alive()


_RACER = """
import sys, time
from pathlib import Path
from megatron_dapo.launch.writer_lock import RunDirLocked, WriterLock
run, go, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
try:
    WriterLock.acquire(run, tag=me, log=lambda line: None, heartbeat=False)
    print("won", flush=True)
except RunDirLocked:
    print("refused", flush=True)
sys.stdin.read()  # alive (the lock's owner) until the test closes stdin
"""


@pytest.mark.parametrize("stale", [False, True], ids=["fresh-directory", "dead-owner"])
def test_of_racing_starters_one_wins(tmp_path, stale):
    """Six processes let go at once on a new run directory, or on one whose owner is dead: exactly one takes it."""
    run, go = tmp_path / "run", tmp_path / "go"
    if stale:
        _write_lock(run, pid=2**22 + 7, start="1")  # no such process
    env = {**os.environ, "PYTHONPATH": python_path(Path(__file__).resolve().parent.parent)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(run), str(go), f"racer{i}"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    try:
        assert [r.stdout.readline().strip() for r in racers] == ["ready"] * 6  # each imported, polling for go
        go.touch()
        said = [r.stdout.readline().strip() for r in racers]
    finally:
        for r in racers:
            r.communicate("")
    assert sorted(said) == ["refused"] * 5 + ["won"], said
    winner = json.loads((run / LOCK_NAME).read_text())
    assert winner["tag"] == f"racer{said.index('won')}"
    assert sorted(os.listdir(run)) == [LOCK_NAME]  # nothing left aside


def test_a_trainer_process_stops_with_its_launcher_and_its_children(tmp_path):
    """The watch itself, without a run: a process watching a launcher that is killed kills its own child and exits
    1 with one line; a launcher that is gone before the watch starts (or a reused pid) ends it at once."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = """
import subprocess, sys, time
from megatron_dapo.launch.lifeline import watch_launcher
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
watch_launcher()
time.sleep(600)
"""
    env = {
        **os.environ,
        "DAPO_LAUNCHER_PID": str(launcher.pid),
        "DAPO_LAUNCHER_START": start_time(launcher.pid),
        "PYTHONPATH": python_path(Path(__file__).resolve().parent.parent),
    }
    proc = subprocess.Popen([sys.executable, "-c", watcher], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    child = int(proc.stdout.readline())
    try:
        assert proc.poll() is None and launcher_alive(launcher.pid, env["DAPO_LAUNCHER_START"])
        launcher.kill()  # not reaped until the watcher has stopped: a zombie is not a running launcher
        _, err = proc.communicate(timeout=30)
        launcher.wait()
        assert proc.returncode == 1
        assert err.strip() == f"error: the launcher (pid {launcher.pid}) is gone; this process and its children stop"
        wait_until(lambda: start_time(child) is None, timeout=10, what="the watcher's child killed")
    finally:  # nothing left running whatever failed
        for pid in (launcher.pid, proc.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
        proc.wait()
    # a pid now running something else (another start time) is not the launcher: the watch ends at once
    reused = {**env, "DAPO_LAUNCHER_PID": str(os.getpid()), "DAPO_LAUNCHER_START": "1"}
    done = subprocess.run([sys.executable, "-c", watcher], env=reused, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "is gone" in done.stderr
    assert not launcher_alive(os.getpid(), "1") and launcher_alive(os.getpid(), "")


def test_torchrun_s_agent_dies_with_the_launcher():
    """A side of several processes (torchrun's agent, which watches no launcher) gets the parent-death signal: it is
    killed once the launcher's thread that started it is gone (here a thread of this process, which then ends); a
    one-process side is a trainer and watches the launcher itself (tested above)."""
    import threading

    from megatron_dapo.launch.local import start_side

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    sides = []
    starter = threading.Thread(target=lambda: sides.extend(start_side(sleeper, dict(os.environ), n) for n in (2, 1)))
    starter.start()
    starter.join()
    agent, single = sides
    try:
        assert agent.wait(timeout=10) == -signal.SIGKILL
        assert single.poll() is None
    finally:
        for side in sides:
            side.kill()
            side.wait()


@pytest.mark.parametrize(
    "train_exit, rollout_exit, blamed",
    [
        ("os.kill(os.getpid(), 9)", "time.sleep(1); sys.exit(1)", ("train", -9)),  # the rollout side saw it go
        ("time.sleep(0.5); sys.exit(1)", "os.kill(os.getpid(), 9)", ("rollout", -9)),  # the rollout side died first
        ("time.sleep(1); sys.exit(1)", "time.sleep(0.2); os.kill(os.getpid(), 9)", ("rollout", -9)),
        ("sys.exit(0)", "time.sleep(0.3); sys.exit(0)", None),
    ],
)
def test_the_local_launcher_blames_the_side_that_failed_first(train_exit, rollout_exit, blamed):
    """`launch local`'s asynchronous sides as two stand-in processes: a train side killed -9 is blamed even when the
    rollout side, losing its peer, exits 1 a second later (within the failure grace); a rollout side killed first is
    blamed whichever exits next; both exiting 0 is a clean end."""
    from megatron_dapo.launch.local import watch_sides

    def side(code: str) -> subprocess.Popen:  # a session of its own, as the launcher starts each side
        return subprocess.Popen([sys.executable, "-c", f"import os, sys, time; {code}"], start_new_session=True)

    train, rollout = side(train_exit), side(rollout_exit)
    try:
        assert watch_sides(train, rollout) == blamed
    finally:
        for proc in (train, rollout):
            proc.kill()
            proc.wait()
