"""Launching on this machine: `python -m megatron_dapo.launch local` and the asynchronous job's two sides.

`launch local --nproc-per-node N` runs the trainer in one process (N = 1) or under torchrun (N > 1, a local
rendezvous), forwarding SIGTERM, SIGUSR1 and Ctrl-C to the ranks themselves, which save and exit 0 (torchrun would
stop them and fail). `launch local pipeline.mode=async ...`, the one way to start an asynchronous job on one
machine, comes to run_async_local: it starts the rollout side (one process, or torchrun with pipeline.rollout_gpus: the
engines and the rollout controller) and the train side (one process, or torchrun with the rest of
--nproc-per-node), tells them where to meet (DAPO_TRANSPORT, DAPO_TRAIN_PROCS) and which side each is (DAPO_ROLE),
and waits. Stop signals go to the train
side, which saves and stops the controller, as a colocated run saves and exits. The train side's exit status is the
job's; a rollout side that dies ends the train side at once (its last complete checkpoint stays the one to resume
from) with one error line. A Slurm job sets the same variables per srun step instead (slurm/train_qwen32b.sh,
ROLLOUT_NODES), a Ray job per actor (launch/ray_cluster.py). Nothing outlives this launcher, even killed -9
(lifeline.py): every process carries the run's tag, torchrun's agent has the parent-death signal and each trainer
process watches this one. A stalled run (watchdog.py) ends with every process's stacks in the launch's log folder,
run_dir/logs/<its tag>, the stall's line and the stalled process's stacks on stderr, and status 75 (STALL_EXIT).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_dapo.config import Config, ConfigError
from megatron_dapo.launch import torchrun
from megatron_dapo.launch.lifeline import die_with_parent, launcher_env
from megatron_dapo.launch.procs import WORLD_ENV, free_port_pair, kill_tree, tree_pids
from megatron_dapo.launch.watchdog import LOG_DIR_ENV, STALL_EXIT, end_stalled, read_stall, run_log_dir, watch_run
from megatron_dapo.placement.transport import ROLE_ENV, TRAIN_PROCS_ENV, TRANSPORT_ENV

ROLLOUT_EXIT_GRACE_S = 60.0
"""After the train side has exited, how long the rollout side may take to stop before it is killed."""
FAILURE_GRACE_S = 5.0
"""After the train side has failed, how long the rollout side may take to exit on its own (its status may name the
cause: a rollout process that died first) before it is killed."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""What a launcher passes on to the trainer's ranks: each saves and exits 0 (a second Ctrl-C: each leaves at once)."""
WATCH_S = 1.0
"""How often the launcher looks at the run's progress records for a stall."""


def side_devices(visible: list[str], rollout_gpus: int, train_procs: int) -> tuple[str, str]:
    """CUDA_VISIBLE_DEVICES of the rollout side and of the train side: the first rollout_gpus of this machine's
    visible GPUs, then one for each train process (torchrun's LOCAL_RANK i takes the side's i-th)."""
    need = rollout_gpus + train_procs
    if len(visible) < need:
        raise ConfigError(
            f"--nproc-per-node {need}: expected as many GPUs, this machine shows {len(visible)} "
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


def train_command(args: list[str], procs: int) -> list[str]:
    """The command that starts `procs` trainer processes on this machine: the trainer's module, under torchrun for
    several (--standalone: a local rendezvous on a free port, a torch.distributed world of its own)."""
    if procs == 1:
        return [sys.executable, "-m", "megatron_dapo.train", *args]
    return [*torchrun.command(procs), "-m", "megatron_dapo.train", *args]


def start_side(cmd: list[str], env: dict[str, str], procs: int) -> subprocess.Popen:
    """Start one side (or the whole run) in a session of its own: a Ctrl-C at the terminal reaches the launcher
    only, which asks the ranks to save. Nothing outlives the launcher (lifeline.py): torchrun's agent gets the
    parent-death signal; each trainer process watches the launcher named in env."""
    preexec = die_with_parent if procs > 1 else None
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=preexec)


def signal_ranks(proc: subprocess.Popen, procs: int, signum: int) -> None:
    """A stop signal to the trainer's ranks themselves: torchrun answers a SIGTERM by stopping its ranks and failing,
    where each rank on its own saves and exits 0 (and torchrun with them)."""
    import psutil

    if proc.poll() is not None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        ranks = psutil.Process(proc.pid).children() if procs > 1 else [psutil.Process(proc.pid)]
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.send_signal(signum)


def run_local(config: Optional[str], overrides: list[str], cfg: Config, nproc: Optional[int]) -> int:
    """`launch local`: the trainer on this machine in nproc processes (None: 1); its exit status (0 after a stop
    signal's save). An asynchronous job splits nproc into its two sides (run_async_local)."""
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc}: expected at least 1")
    if cfg.pipeline.mode == "async":
        return run_async_local(config, overrides, cfg, nproc)
    nproc = nproc or 1
    args = [*(["--config", config] if config else []), *overrides]
    env = run_env(cfg)
    log_dir, since = Path(env[LOG_DIR_ENV]), time.time()
    proc = start_side(train_command(args, nproc), env, nproc)
    previous = {s: signal.signal(s, lambda n, frame: signal_ranks(proc, nproc, n)) for s in STOP_SIGNALS}
    try:
        while proc.poll() is None:
            if watch_run(log_dir, since) is not None:
                return stalled(log_dir, [proc])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=WATCH_S)
        return stalled(log_dir, [proc]) if read_stall(log_dir, since) is not None else proc.returncode
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            kill_tree(proc)


def run_env(cfg: Config) -> dict[str, str]:
    """The environment of a launch's processes: this one's without a torch.distributed world, the launcher and the
    run's tag (lifeline.py) and its log folder, run_dir/logs/<tag> (watchdog.py)."""
    env = launcher_env({k: v for k, v in os.environ.items() if k not in WORLD_ENV})
    env[LOG_DIR_ENV] = str(run_log_dir(cfg.trainer.run_dir, env).resolve())
    return env


def stalled(log_dir: Path, procs: list[subprocess.Popen]) -> int:
    """End a stalled run: every process under procs woken for its stacks, then killed; the report on stderr;
    STALL_EXIT."""
    pids = [pid for p in procs for pid in tree_pids(p)]
    print(end_stalled(log_dir, pids, lambda: [kill_tree(p) for p in procs]), file=sys.stderr, flush=True)
    return STALL_EXIT


def run_async_local(config: Optional[str], overrides: list[str], cfg: Config, nproc: Optional[int]) -> int:
    """Start both sides (nproc processes in all, None: pipeline.rollout_gpus + 1), forward stop signals to the train
    side, return its exit status (1 if the rollout died)."""
    train_procs = (nproc or cfg.pipeline.rollout_gpus + 1) - cfg.pipeline.rollout_gpus
    if train_procs < 1:
        raise ConfigError(
            f"--nproc-per-node {nproc}: expected more than pipeline.rollout_gpus={cfg.pipeline.rollout_gpus} (the rest train)"
        )
    args = [*(["--config", config] if config else []), *overrides]
    env = run_env(cfg)
    log_dir, since = Path(env[LOG_DIR_ENV]), time.time()
    env.update({TRANSPORT_ENV: f"127.0.0.1:{free_port_pair()}", TRAIN_PROCS_ENV: str(train_procs)})
    rollout_env, train_env = {**env, ROLE_ENV: "rollout"}, {**env, ROLE_ENV: "train"}
    visible = visible_gpus()
    if visible:  # each side on GPUs of its own; both would otherwise start on the first
        rollout_env["CUDA_VISIBLE_DEVICES"], train_env["CUDA_VISIBLE_DEVICES"] = side_devices(
            visible, cfg.pipeline.rollout_gpus, train_procs
        )
    rollout_cmd, train_cmd = train_command(args, cfg.pipeline.rollout_gpus), train_command(args, train_procs)
    rollout = start_side(rollout_cmd, rollout_env, cfg.pipeline.rollout_gpus)
    train = start_side(train_cmd, train_env, train_procs)

    previous = {s: signal.signal(s, lambda n, frame: signal_ranks(train, train_procs, n)) for s in STOP_SIGNALS}

    try:
        blamed = watch_sides(train, rollout, lambda: watch_run(log_dir, since) is not None)
        if blamed is not None and read_stall(log_dir, since) is not None:
            return stalled(log_dir, [train, rollout])
        if blamed is None:
            return 0
        side, status = blamed
        other = "rollout" if side == "train" else "train"
        print(
            f"error: the {side} side exited with status {status}; the {other} side was stopped, "
            f"the last complete checkpoint (if any) is in {cfg.trainer.run_dir}/checkpoints",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in (train, rollout):
            if proc.poll() is None:
                kill_tree(proc)


def watch_sides(
    train: subprocess.Popen, rollout: subprocess.Popen, stalled: Callable[[], bool] = lambda: False
) -> Optional[tuple[str, int]]:
    """Wait for the asynchronous run's end. None: the train side exited 0 and the rollout side too (or was stopped
    after ROLLOUT_EXIT_GRACE_S); else (the side to blame, its exit status), the other side stopped; ("stall", -1)
    as soon as stalled() (the run's processes are left to the caller)."""
    checked = 0.0
    while True:
        if time.monotonic() - checked > WATCH_S:
            checked = time.monotonic()
            if stalled():
                return "stall", -1
        if train.poll() is not None:
            if train.returncode == 0:  # it asked the controller to stop: let it finish
                try:
                    rollout.wait(timeout=ROLLOUT_EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    kill_tree(rollout)
                    return None
                return None if rollout.returncode == 0 else ("rollout", rollout.returncode)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rollout.wait(timeout=FAILURE_GRACE_S)
            # a train side that failed because its peer was gone (a lost connection) exits first at times
            if rollout.returncode is not None and rollout.returncode < 0 <= train.returncode:
                return "rollout", rollout.returncode
            kill_tree(rollout)  # it holds nothing the checkpoints need: the controller's state is in them
            return "train", train.returncode
        if rollout.poll() is not None and rollout.returncode != 0:
            kill_tree(train)  # its checkpoints are complete or absent, never half written
            return "rollout", rollout.returncode
        time.sleep(0.2)
