"""What the launchers share: free ports for a meeting point, the torch.distributed world variables a launcher sets,
and ending a process with everything under it."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess

WORLD_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
"""torch.distributed's world, as torchrun sets it: a launcher sets its own and never passes a parent's on."""


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free now (the controller's two transport stores), below the kernel's ephemeral range:
    a port the system hands out for bind(0) (torch.distributed's own stores, with MASTER_PORT=0) could take it
    between this choice and the controller's listening on it, which comes after its start-up."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low - 1)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind((host, p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no two consecutive free ports on {host} below {low}")


def tree_pids(proc: subprocess.Popen) -> list[int]:
    """proc's pid and every process's under it (torchrun's ranks run in sessions of their own, still under it)."""
    import psutil

    try:
        return [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a side and every process under it: torchrun starts each train rank in a session of its own, so
    killing the side's process group would leave the ranks running."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
