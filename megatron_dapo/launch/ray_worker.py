"""The Ray actor of `launch ray` (ray_cluster.py): one per GPU, holding one trainer process. Light on purpose: an actor
imports this module and the standard library only (not torch, not the trainer), so it starts in a second."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.launch.lifeline import die_with_parent, launcher_env
from megatron_dapo.launch.procs import WORLD_ENV, free_port_pair, kill_tree, tree_pids
from megatron_dapo.launch.watchdog import LOG_DIR_ENV, STALL_EXIT, end_stalled, read_stall, watch_run


class Worker:
    """A Ray actor holding one trainer process: started by start(), its output lines collected by a thread and handed
    to the driver by poll(). Sync actor: calls run one at a time on the actor's main thread, which also owns the
    process (its parent-death signal follows that thread)."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.reader: Optional[threading.Thread] = None
        self.log_dir: Optional[Path] = None  # the attempt's log folder (DAPO_LOG_DIR): where a stall shows
        self.started = 0.0
        self.stalled = False

    def where(self, paths: list[str]) -> dict[str, Any]:
        """This actor's Ray node and devices, and which of paths this node does not have."""
        import ray

        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        missing = [p for p in paths if not os.path.exists(p)]
        return {"node_id": ctx.get_node_id(), "gpus": gpus, "missing": missing}

    def free_ports(self, ip: str, count: int) -> list[int]:
        """count distinct port pairs (p, p + 1) free on this node's address ip now."""
        ports: list[int] = []
        while len(ports) < count:
            p = free_port_pair(ip)
            if all(abs(p - q) > 1 for q in ports):
                ports.append(p)
        return ports

    def start(self, args: list[str], env: dict[str, str], cwd: str, banner: str) -> int:
        """Start `python -m megatron_dapo.train ARGS` with env over this actor's own (Ray's CUDA_VISIBLE_DEVICES and
        the rest); returns its pid. The process dies with this actor (PR_SET_PDEATHSIG) and gets a session of its own
        (the whole tree is killed together); it also watches this actor as its launcher (lifeline.py), which
        stops its own children first."""
        full = {k: v for k, v in os.environ.items() if k not in WORLD_ENV}
        full = launcher_env({**full, **env})
        full["PYTHONUNBUFFERED"] = "1"  # lines as they are written
        self.log_dir = Path(full[LOG_DIR_ENV]) if full.get(LOG_DIR_ENV) else None
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_dapo.train", *args],
            env=full,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.lines.append(f"{banner}, pid {self.proc.pid}")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append(line.rstrip("\n"))

    def poll(self) -> tuple[list[str], Optional[int]]:
        """(the lines since the last poll, the exit status or None while running). The status comes only after the
        process's last line has been read."""
        rc = None if self.proc is None else self.proc.poll()
        if rc is None and self.log_dir is not None and watch_run(self.log_dir, self.started) is not None:
            self.kill()  # the run stalled: its stacks, then the process
        if self.stalled:
            rc = STALL_EXIT
        if rc is not None and self.reader is not None:
            self.reader.join(timeout=5)
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, rc

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)

    def kill(self) -> str:
        """SIGKILL the trainer process and everything under it (its reward workers); in a stalled run, woken for
        their stacks first. Returns the stall's report (its line, the stalled process's stacks), or ''."""
        if self.proc is None:
            return ""
        if self.log_dir is None or read_stall(self.log_dir, self.started) is None:
            kill_tree(self.proc)
            return ""
        self.stalled = True
        pids = tree_pids(self.proc) if self.proc.poll() is None else []
        report = end_stalled(self.log_dir, pids, lambda: kill_tree(self.proc))
        with self.lock:
            self.lines.extend(report.splitlines())
        return report
