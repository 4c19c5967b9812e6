"""A training run's metrics as the tests compare them, waiting for a run to get somewhere, and what a run left
running (tests/test_trainer.py, tests/test_slurm_cluster.py, tests/ray_helpers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from megatron_dapo.timing import comparable  # noqa: F401  (the tests import it from here, beside metrics())


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
    ended = "" if proc is None or proc.poll() is None else f": the run ended first (exit {proc.poll()})"
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
