"""A real Ray cluster of two "nodes" on this machine for the Ray launcher's tests (tests/test_launch.py): a head and a
second raylet, each with one CPU, a small object store, ports of its own and a custom resource standing for its GPUs.
Stopped by the processes it started, never with `ray stop` (which ends every Ray process of the user)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from run_helpers import session_survivors

RESOURCE = "test_gpu"
"""The custom resource each node has one of: the launcher's --gpu-resource in the tests."""


@dataclass
class RayCluster:
    address: str  # the head's GCS, HOST:PORT
    procs: list[subprocess.Popen]  # `ray start --block` of each node: its session holds that node's processes
    temp: Path
    env: dict[str, str]  # what a launcher run beside it needs (PYTHONPATH and the rest of this process's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(env: dict[str, str], gpus_on_second: int = 2, timeout: float = 120) -> RayCluster:
    """Start the head, then the second raylet (which also declares gpus_on_second GPUs: Ray hands out their ids
    although the machine has none, which is how the device mapping is checked on CPU); wait until both are up."""
    ray = str(Path(sys.executable).parent / "ray")
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus=1", f"--resources={json.dumps({RESOURCE: 1})}", "--object-store-memory=80000000",
              "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}"]  # fmt: skip
    head = [ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-gpus=0",
            f"--temp-dir={temp}", "--include-dashboard=false", f"--dashboard-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}", *common]  # fmt: skip
    second = [ray, "start", f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-gpus={gpus_on_second}",
              *common]  # fmt: skip
    procs: list[subprocess.Popen] = []
    cluster = RayCluster(address, procs, temp, env)
    try:
        for i, cmd in enumerate((head, second)):
            log = open(temp / f"node{i}.log", "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            if i == 0:
                _wait_alive(cluster, 1, timeout)
        _wait_alive(cluster, 2, timeout)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def _wait_alive(cluster: RayCluster, nodes: int, timeout: float) -> None:
    """Until the cluster reports `nodes` alive nodes (asked from a separate driver process, which then leaves)."""
    probe = (
        "import ray, sys, time\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False, logging_level='ERROR')\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {nodes}: time.sleep(0.2)\n"
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        dead = [p.args[:3] for p in cluster.procs if p.poll() is not None]
        assert not dead, (
            dead,
            [(cluster.temp / f"node{i}.log").read_text()[-2000:] for i in range(len(cluster.procs))],
        )
        try:
            done = subprocess.run([sys.executable, "-c", probe], env=cluster.env, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the Ray cluster at {cluster.address} did not show {nodes} alive nodes in {timeout} s")


def stop_cluster(cluster: RayCluster, timeout: float = 30) -> list[str]:
    """SIGTERM each `ray start --block` (it stops the node's processes), SIGKILL what is left of their sessions
    after timeout; returns what had to be killed (nothing, when Ray stopped cleanly)."""
    for p in reversed(cluster.procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and any(session_survivors(p.pid) for p in cluster.procs):
        time.sleep(0.2)
    left = [c for p in cluster.procs for c in session_survivors(p.pid).values()]
    for p in cluster.procs:
        for pid in session_survivors(p.pid):
            os.kill(pid, signal.SIGKILL)
        p.wait(timeout=10)
    shutil.rmtree(cluster.temp, ignore_errors=True)
    return left
