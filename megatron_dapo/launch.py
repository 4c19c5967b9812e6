"""Starting an asynchronous job's two sides on this machine (pipeline.mode=async; docs/async.md).

`python -m megatron_dapo.train pipeline.mode=async ...` comes here: it starts the rollout side (one process, or
torchrun with pipeline.rollout_gpus: the engines and the rollout controller) and the train side (one process, or
torchrun with the rest of --nproc), tells them where to meet (DAPO_TRANSPORT, DAPO_TRAIN_PROCS) and which side each is
(DAPO_ROLE), and waits. SIGTERM, SIGUSR1 and Ctrl-C go to the train side, which saves and stops the controller, as a
colocated run saves and exits. The train side's exit status is the job's; a rollout side that dies ends the train side
at once (its last complete checkpoint stays the one to resume from) with one error line. A Slurm job sets the same
variables per srun step instead (slurm/train_qwen32b.sh, ROLLOUT_NODES).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from megatron_dapo.config import Config, ConfigError
from megatron_dapo.sampling.controller import ROLE_ENV, TRAIN_PROCS_ENV, TRANSPORT_ENV

ROLLOUT_EXIT_GRACE_S = 60.0
"""After the train side has exited, how long the rollout side may take to stop before it is killed."""
FAILURE_GRACE_S = 5.0
"""After the train side has failed, how long the rollout side may take to exit on its own (its status may name the
cause: a rollout process that died first) before it is killed."""

_WORLD_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


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


def side_devices(visible: list[str], rollout_gpus: int, train_procs: int) -> tuple[str, str]:
    """CUDA_VISIBLE_DEVICES of the rollout side and of the train side: the first rollout_gpus of this machine's
    visible GPUs, then one for each train process (torchrun's LOCAL_RANK i takes the side's i-th)."""
    need = rollout_gpus + train_procs
    if len(visible) < need:
        raise ConfigError(
            f"--nproc {need}: expected as many GPUs, this machine shows {len(visible)} "
            f"(CUDA_VISIBLE_DEVICES={','.join(visible)!r}); each side needs GPUs of its own (one GPU: start the roles "
            "yourself with DAPO_ROLE and pipeline.weights_backend=gloo, docs/async.md)"
        )
    return ",".join(visible[:rollout_gpus]), ",".join(visible[rollout_gpus:need])


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES names them (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    return [d.strip() for d in listed.split(",") if d.strip()]


def run_async_local(config: Optional[str], overrides: list[str], cfg: Config, nproc: Optional[int]) -> int:
    """Start both sides, forward stop signals to the train side, return its exit status (1 if the rollout died)."""
    train_procs = (nproc or cfg.pipeline.rollout_gpus + 1) - cfg.pipeline.rollout_gpus
    if train_procs < 1:
        raise ConfigError(
            f"--nproc {nproc}: expected more than pipeline.rollout_gpus={cfg.pipeline.rollout_gpus} (the rest train)"
        )
    args = [*(["--config", config] if config else []), *overrides]
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
    env.update({TRANSPORT_ENV: f"127.0.0.1:{free_port_pair()}", TRAIN_PROCS_ENV: str(train_procs)})
    rollout_env, train_env = {**env, ROLE_ENV: "rollout"}, {**env, ROLE_ENV: "train"}
    visible = visible_gpus()
    if visible:  # each side on GPUs of its own; both would otherwise start on the first
        rollout_env["CUDA_VISIBLE_DEVICES"], train_env["CUDA_VISIBLE_DEVICES"] = side_devices(
            visible, cfg.pipeline.rollout_gpus, train_procs
        )
    rollout_cmd, train_cmd = _side_command(args, cfg.pipeline.rollout_gpus), _side_command(args, train_procs)
    # own sessions: a Ctrl-C at the terminal reaches this process only, which asks the train side to save
    rollout = subprocess.Popen(rollout_cmd, env=rollout_env, start_new_session=True)
    train = subprocess.Popen(train_cmd, env=train_env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        """To the train ranks themselves: torchrun answers a SIGTERM by stopping its ranks and failing, where each
        rank on its own saves and exits 0 (and torchrun with them)."""
        import psutil

        if train.poll() is not None:
            return
        sig = signal.SIGTERM if signum == signal.SIGINT else signum
        with contextlib.suppress(psutil.NoSuchProcess):
            ranks = psutil.Process(train.pid).children() if train_procs > 1 else [psutil.Process(train.pid)]
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.send_signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}

    def died(side: str, status: int, other: str) -> int:
        print(
            f"error: the {side} side exited with status {status}; the {other} side was stopped, "
            f"the last complete checkpoint (if any) is in {cfg.trainer.run_dir}/checkpoints",
            file=sys.stderr,
            flush=True,
        )
        return 1

    try:
        while True:
            if train.poll() is not None:
                if train.returncode == 0:  # it asked the controller to stop: let it finish
                    try:
                        rollout.wait(timeout=ROLLOUT_EXIT_GRACE_S)
                    except subprocess.TimeoutExpired:
                        _kill_tree(rollout)
                        return 0
                    return 0 if rollout.returncode == 0 else died("rollout", rollout.returncode, "train")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rollout.wait(timeout=FAILURE_GRACE_S)
                # a train side that failed because its peer was gone (a lost connection) exits first at times
                if rollout.returncode is not None and rollout.returncode < 0 <= train.returncode:
                    return died("rollout", rollout.returncode, "train")
                _kill_tree(rollout)  # it holds nothing the checkpoints need: the controller's state is in them
                return died("train", train.returncode, "rollout")
            if rollout.poll() is not None and rollout.returncode != 0:
                _kill_tree(train)  # its checkpoints are complete or absent, never half written
                return died("rollout", rollout.returncode, "train")
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in (train, rollout):
            if proc.poll() is None:
                _kill_tree(proc)


def _side_command(args: list[str], procs: int) -> list[str]:
    """The command that starts one side's `procs` processes: the trainer's module, under torchrun for several
    (--standalone: a local rendezvous on a free port, each side a torch.distributed world of its own)."""
    if procs == 1:
        return [sys.executable, "-m", "megatron_dapo.train", *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    return [*torchrun, "-m", "megatron_dapo.train", *args]


def _kill_tree(proc: subprocess.Popen) -> None:
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
