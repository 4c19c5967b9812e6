"""Starting a training run, its metrics as the tests compare them, waiting for a run to get somewhere, and what a run
left running (the end-to-end tests: tests/test_trainer.py, test_sampler_runs.py, test_launch.py, test_slurm_cluster.py,
tests/ray_helpers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.launch import torchrun
from megatron_dapo.timing import comparable  # noqa: F401  (the tests import it from here, beside metrics())


def run_train(
    overrides: list[str], nproc: int = 1, launcher: str | None = None, **env_vars: str
) -> subprocess.CompletedProcess:
    """python -m megatron_dapo.train, under torchrun when nproc > 1 (launcher="local": python -m megatron_dapo.launch
    local, whose options are among the overrides), with env_vars set; asserts it succeeded."""
    launch = [sys.executable, "-m", "megatron_dapo.train"]
    if launcher is not None:
        launch = [sys.executable, "-m", "megatron_dapo.launch", launcher]
    elif nproc > 1:  # --standalone: a local rendezvous on a free port
        launch[:1] = torchrun.command(nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.run([*launch, *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def wandb_env(root: Path) -> dict[str, str]:
    """W&B offline, its settings, cache and staging folders under root (not the user's home)."""
    return {
        "WANDB_MODE": "offline",
        **{f"WANDB_{k}_DIR": str(root / "wandb" / k.lower()) for k in ("CONFIG", "CACHE", "DATA")},
    }


def same_up_to_fp32_sums(want: list[dict], got: list[dict]) -> None:
    """Two runs' comparable metrics, step for step: the same keys, every data metric equal, the losses and logprob
    statistics (actor/, rollout/) within fp32 rounding (sums associated differently: DP ranks, engine batches)."""
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g.keys() == w.keys()
        for k, v in w.items():
            if k.startswith(("actor/", "rollout/")):
                assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
            else:
                assert g[k] == v, k


def newest_complete(run: Path) -> int:
    """The step of run's newest complete checkpoint (0 when none is)."""
    return max((int(p.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*/COMPLETE")), default=0)


def metrics(run: Path) -> list[dict]:
    """run_dir/metrics.jsonl, one dict per line; [] before the first step has written one."""
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def python_path(*dirs: Path | str) -> str:
    """PYTHONPATH with dirs in front of the one this process has: a subprocess keeps whatever the test run put first
    (make mutants puts its mutated copy of the package there)."""
    return os.pathsep.join([*(str(d) for d in dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


def wait_until(predicate, timeout: float = 300, what: str = "", proc: subprocess.Popen | None = None) -> None:
    """Poll predicate until it holds; fails after timeout, or at once when proc (the run it waits on) has ended."""
    deadline = time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        if predicate():
            return
        time.sleep(0.05)
    if predicate():
        return
    ended = ""
    if proc is not None and proc.poll() is not None:
        said = proc.stderr.read()[-4000:] if proc.stderr is not None else ""  # why it ended, where the test kept it
        ended = f": the run ended first (exit {proc.poll()})" + (f"; its stderr ends:\n{said}" if said else "")
    raise AssertionError(f"timed out waiting for {what}{ended}")


def session_survivors(sid: int) -> dict[int, str]:
    """{pid: command line} of the processes still in session sid (one started with start_new_session=True)."""
    import psutil

    left = {}
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.info["pid"]) == sid:
                left[p.info["pid"]] = " ".join(p.info["cmdline"] or [])[:200]
        except (ProcessLookupError, PermissionError):
            continue
    return left


def tagged(tag: str) -> dict[int, str]:
    """{pid: command line} of every running process (not a zombie) that carries the run's tag (DAPO_RUN_TAG: every
    process of a launch, orphans adopted by init included)."""
    from megatron_dapo.launch.lifeline import RUN_TAG_ENV, start_time

    entry = f"{RUN_TAG_ENV}={tag}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if entry in (d / "environ").read_bytes().split(b"\0") and start_time(int(d.name)) is not None:
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
    return found


def stopped(tag: str) -> list[int]:
    """The processes of the run tagged `tag` that are stopped (SIGSTOP: /proc/<pid>/stat's state T)."""
    out = []
    for pid in tagged(tag):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "T":
            out.append(pid)
    return out


def stalled_and_gone(proc: subprocess.Popen, tag: str, timeout: float) -> tuple[str, str, float]:
    """Once a process of the run tagged `tag` is stopped: proc's (stdout, stderr) when it has exited, the seconds from
    the stop to its exit; nothing of the run left running 10 s after (whatever fails, nothing is left)."""
    try:
        wait_until(lambda: stopped(tag), timeout=timeout, what="a process of the run stopped", proc=proc)
        at = time.monotonic()
        out, err = proc.communicate(timeout=timeout)
        took = time.monotonic() - at
        wait_until(lambda: not tagged(tag), timeout=10, what="nothing of the run left")
        return out, err, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class RunsCode:
    """What a crafted pickle or checkpoint does: name a function to call on load (here, one that leaves a mark, the
    file `mark`, which the tests check was never made)."""

    def __init__(self, mark: Path | str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))
