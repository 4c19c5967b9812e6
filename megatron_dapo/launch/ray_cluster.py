"""`python -m megatron_dapo.launch ray`: the trainer on an existing Ray cluster, one Ray actor per GPU (docs/ray.md).

This process (the driver) connects to the cluster, reserves `nodes` bundles of `gpus_per_node` GPUs on distinct nodes
(one placement group, STRICT_SPREAD: a node's ranks stay together, as under torchrun), and starts one actor per GPU.
Each actor starts one trainer process (`python -m megatron_dapo.train`) with the world torchrun would give it: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port on the rank-0 worker's node, not
the driver's). The driver prints every process's lines prefixed with its rank, and supervises:

- a trainer process that fails or an actor that dies (its node gone): every other worker is killed, the placement
  group released, and the job starts again from the newest checkpoint (trainer.resume), up to --max-restarts, with
  a line saying why; a stalled run (watchdog.py) likewise, after each actor has woken its process for its stacks
  (each attempt's log folder: run_dir/logs/<launch>/attempt_N);
- SIGTERM, SIGINT or SIGUSR1 to the driver: SIGTERM to the trainer processes (an asynchronous job's train side),
  which save and exit; exit status 0 if every one exited 0 (the save completed), else 1; no restart.

GPUs: Ray gives each actor its own device and sets CUDA_VISIBLE_DEVICES to it, but the trainer (and vLLM's
external-launcher engine) binds cuda:LOCAL_RANK, as under torchrun. So each trainer process gets the GPUs of its
world's workers on its node, in local-rank order (node_devices): cuda:LOCAL_RANK is then the one Ray gave it, and
NCCL sees its node's peers. With --gpu-resource other than GPU Ray assigns no devices and the node's own
CUDA_VISIBLE_DEVICES stands (cuda:LOCAL_RANK of those).

An asynchronous job (pipeline.mode=async) gives the first pipeline.rollout_gpus ranks the rollout side and the rest
the train side, each a torch.distributed world of its own, meeting at two free ports on the rollout side's first
node (DAPO_ROLE, DAPO_TRANSPORT, DAPO_TRAIN_PROCS: docs/async.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.cli import UserError, tool_log
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.launch.lifeline import LAUNCHER_PID_ENV, LAUNCHER_START_ENV, RUN_TAG_ENV, new_run_tag
from megatron_dapo.launch.local import ROLLOUT_EXIT_GRACE_S, STOP_SIGNALS
from megatron_dapo.launch.procs import WORLD_ENV
from megatron_dapo.launch.ray_worker import Worker
from megatron_dapo.launch.watchdog import LOG_DIR_ENV, STALL_EXIT, run_log_dir
from megatron_dapo.placement.transport import ROLE_ENV, TRAIN_PROCS_ENV, TRANSPORT_ENV

FORWARDED_PREFIXES = (
    "OMP_", "MKL_", "NCCL_", "GLOO_", "TORCH", "CUDA_", "NVIDIA_", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
    "WANDB_", "TRITON_", "PYTHON", "DAPO_",
)  # fmt: skip
"""The driver's variables every trainer process gets (a Ray worker has its raylet's environment, not the driver's):
the libraries' settings, credentials and PYTHONPATH, as srun --export=ALL passes them on Slurm."""
NOT_FORWARDED = (
    *WORLD_ENV, "CUDA_VISIBLE_DEVICES", ROLE_ENV, TRANSPORT_ENV, TRAIN_PROCS_ENV, LAUNCHER_PID_ENV, LAUNCHER_START_ENV
)  # fmt: skip
"""Set per worker by the launcher (the launcher a trainer dies with is its actor), never taken from the driver."""
POLL_S = 0.3
ACTOR_CALL_TIMEOUT_S = 60.0
"""How long an actor may take to answer one call before the driver counts it as lost."""
CONNECT_TIMEOUT_S = 10.0

log = tool_log("launch")


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) and k not in NOT_FORWARDED
    }  # fmt: skip


@dataclass
class Slot:
    """One GPU of the job and the trainer process on it. rank: the job-wide index (node-major: bundle b holds
    b * gpus_per_node ...); side: all | rollout | train; world_rank: its RANK in its side's world."""

    rank: int
    bundle: int
    side: str
    world_rank: int = 0
    node_id: str = ""
    ip: str = ""
    gpus: list[str] = field(default_factory=list)  # what Ray gave it ([] for a custom resource)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.side == "all" else f"{self.side} {self.world_rank}"


def slots_for(nodes: int, gpus_per_node: int, rollout_gpus: int) -> list[Slot]:
    """Every GPU of the job in rank order; with rollout_gpus > 0 (asynchronous) the first ones are the rollout
    side's, each side numbering its ranks from 0."""
    out = []
    for rank in range(nodes * gpus_per_node):
        side = "all" if rollout_gpus == 0 else ("rollout" if rank < rollout_gpus else "train")
        world_rank = rank - rollout_gpus if side == "train" else rank
        out.append(Slot(rank=rank, bundle=rank // gpus_per_node, side=side, world_rank=world_rank))
    return out


def world_env(slots: list[Slot], ports: dict[str, int]) -> None:
    """Each slot's torch.distributed world (and devices), as torchrun would set them per side: LOCAL_RANK is the
    index among its side's slots on the same Ray node; MASTER_ADDR/PORT the side's rank-0 node and ports[side]."""
    for side in dict.fromkeys(s.side for s in slots):
        world = [s for s in slots if s.side == side]
        master = world[0]
        for s in world:
            local = [o for o in world if o.node_id == s.node_id]
            s.env.update(
                RANK=str(s.world_rank),
                WORLD_SIZE=str(len(world)),
                LOCAL_RANK=str(local.index(s)),
                LOCAL_WORLD_SIZE=str(len(local)),
                MASTER_ADDR=master.ip,
                MASTER_PORT=str(ports[side]),
            )
            devices = node_devices(local)
            if devices is not None:
                s.env["CUDA_VISIBLE_DEVICES"] = devices


def node_devices(local: list[Slot]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for the slots of one world on one node, in local-rank order: LOCAL_RANK i's cuda:i is the
    GPU Ray gave slot i. None where Ray assigned no GPUs (a custom --gpu-resource): the node's own setting stands."""
    if not all(s.gpus for s in local):
        return None
    return ",".join(s.gpus[0] for s in local)


@dataclass
class Options:
    """`launch ray`'s options (docs/ray.md)."""

    address: str = "auto"
    nodes: int = 1
    gpus_per_node: int = 1
    gpu_resource: str = "GPU"
    max_restarts: int = 3
    wait_s: float = 600.0
    print_only: bool = False


class Stop:
    """The stop signals the driver got: the first asks the trainers to save; a second one ends everything now."""

    def __init__(self) -> None:
        self.count = 0
        self.name = ""

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        self.name = self.name or signal.Signals(signum).name


def attempt_args(args: list[str], attempt: int) -> list[str]:
    """The trainers' arguments on attempt `attempt` (0 the first): a restart continues this run from its newest
    checkpoint (trainer.resume=true, last so it wins), whatever the config asked."""
    return [*args, "trainer.resume=true"] if attempt else list(args)


def run_ray(config: Optional[str], overrides: list[str], cfg: Config, opts: Options) -> int:
    """Run the job on the cluster at opts.address; the exit status (0: finished, or stopped by a signal after every
    trainer saved)."""
    try:
        import ray
    except ImportError:
        raise UserError("ray is not installed: pip install -e '.[ray]' (make install does)") from None
    if opts.nodes < 1 or opts.gpus_per_node < 1:
        raise ConfigError(f"--nodes {opts.nodes} --gpus-per-node {opts.gpus_per_node}: expected both at least 1")
    world = opts.nodes * opts.gpus_per_node
    rollout_gpus = cfg.pipeline.rollout_gpus if cfg.pipeline.mode == "async" else 0
    if rollout_gpus and not 0 < rollout_gpus < world:
        raise ConfigError(
            f"pipeline.rollout_gpus={rollout_gpus}: expected fewer than the job's {world} GPUs (--nodes x "
            "--gpus-per-node; the rest train)"
        )
    config_path = str(Path(config).resolve()) if config else None
    args = [*(["--config", config_path] if config_path else []), *overrides]
    paths = [os.getcwd(), *([config_path] if config_path else [])]  # every node must see them
    connect(ray, opts.address)
    stop = Stop()
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        check_resources(ray, opts)
        run_tag = os.environ.get(RUN_TAG_ENV) or new_run_tag()  # every attempt's processes carry it
        for attempt in range(opts.max_restarts + 1):
            job = Job(
                ray,
                opts,
                slots_for(opts.nodes, opts.gpus_per_node, rollout_gpus),
                cfg.trainer.run_dir,
                run_tag,
                attempt,
            )
            try:
                job.place(paths, stop)
                if stop.count:
                    raise UserError(f"{stop.name} before the trainers started: nothing ran")
                if opts.print_only:
                    job.describe(attempt_args(args, attempt))
                    return 0
                outcome = job.run(attempt_args(args, attempt), stop)
            finally:
                job.release()
            if outcome is None:
                return 0
            if stop.count:  # stopped by a signal: no restart, whatever happened
                print(f"error: {outcome}; the workers were stopped after {stop.name}", file=sys.stderr, flush=True)
                return 1
            if attempt == opts.max_restarts:
                print(
                    f"error: {outcome}; every worker was stopped and no restart is left (--max-restarts "
                    f"{opts.max_restarts}); the newest checkpoint is in {cfg.trainer.run_dir}/checkpoints",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            log(
                f"restart {attempt + 1} of {opts.max_restarts}: {outcome}; every worker was stopped, starting again "
                f"from the newest checkpoint in {cfg.trainer.run_dir}/checkpoints"
            )
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        ray.shutdown()


def connect(ray: Any, address: str) -> None:
    """ray.init on an existing cluster (never a new local one), or one error line saying there is none."""
    import logging

    if address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--address {address!r}: expected HOST:PORT of the Ray head's GCS (e.g. 10.0.0.1:6379)")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise UserError(f"--address {address}: no Ray cluster answers there ({e.strerror or e})") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    except ConnectionError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--address {address}: no Ray cluster to connect to ({first})") from None


def check_resources(ray: Any, opts: Options) -> None:
    """One error line now, not a wait, when the cluster's alive nodes can never hold the placement group."""
    have = {
        n["NodeID"]: n["Resources"].get(opts.gpu_resource, 0.0) for n in ray.nodes() if n.get("Alive", n.get("alive"))
    }
    fit = sum(1 for v in have.values() if v >= opts.gpus_per_node)
    if fit < opts.nodes:
        listed = ", ".join(f"{k[:12]}: {v:g}" for k, v in have.items()) or "no alive nodes"
        raise UserError(
            f"--nodes {opts.nodes} --gpus-per-node {opts.gpus_per_node}: the Ray cluster has {fit} node(s) with "
            f"{opts.gpus_per_node} {opts.gpu_resource} (per node: {listed}); ask for fewer, or for another "
            "--gpu-resource"
        )


class Job:
    """One attempt: the placement group, its actors and their trainer processes."""

    def __init__(
        self, ray: Any, opts: Options, slots: list[Slot], run_dir: str, run_tag: str = "", attempt: int = 0
    ) -> None:
        """run_dir: trainer.run_dir, under which each attempt keeps its progress records and stacks."""
        self.ray, self.opts, self.slots = ray, opts, slots
        self.group: Any = None
        self.actors: list[Any] = []
        self.run_tag = run_tag or new_run_tag()
        # each attempt's progress records and stacks apart: a restart must not read the failed attempt's
        run = run_log_dir(run_dir, {RUN_TAG_ENV: self.run_tag})
        self.log_dir = str(run.resolve() / f"attempt_{attempt}")

    def place(self, paths: list[str], stop: Stop) -> None:
        """Reserve the bundles, start an actor on each slot, and give every slot its world."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, opts = self.ray, self.opts
        bundle = {opts.gpu_resource: float(opts.gpus_per_node)}
        self.group = placement_group([dict(bundle) for _ in range(opts.nodes)], strategy="STRICT_SPREAD")
        deadline = time.monotonic() + opts.wait_s
        while not self.group.wait(timeout_seconds=1):  # short waits: a stop signal is not kept waiting
            if stop.count:
                raise UserError(f"{stop.name} while waiting for the cluster's resources: nothing was started")
            if time.monotonic() > deadline:
                raise UserError(
                    f"{opts.nodes} node(s) with {opts.gpus_per_node} free {opts.gpu_resource} each did not become "
                    f"free within --wait-s {opts.wait_s:g} (other jobs hold them)"
                )
        one = {"num_gpus": 1} if opts.gpu_resource == "GPU" else {"resources": {opts.gpu_resource: 1}}
        remote = ray.remote(Worker)  # its own module: an actor imports neither torch nor the trainer
        for s in self.slots:
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=s.bundle)
            self.actors.append(remote.options(num_cpus=0, scheduling_strategy=strategy, max_restarts=0, **one).remote())
        # a node's address as its raylet registered it (--node-ip-address): where the other nodes reach it
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        for s, info in zip(self.slots, self.call("where", [[paths]] * len(self.slots))):
            s.node_id, s.ip, s.gpus = info["node_id"], addresses[info["node_id"]], info["gpus"]
            if info["missing"]:
                raise UserError(
                    f"{s.label} on Ray node {s.node_id[:12]} ({s.ip}) has no {', '.join(info['missing'])}: the working "
                    "directory, config, model, data and trainer.run_dir must be at the same paths on every node "
                    "(a shared filesystem, as on Slurm)"
                )
        sides = list(dict.fromkeys(s.side for s in self.slots))
        firsts = {side: next(i for i, s in enumerate(self.slots) if s.side == side) for side in sides}
        ports = {
            side: ray.get(self.actors[i].free_ports.remote(self.slots[i].ip, 2), timeout=ACTOR_CALL_TIMEOUT_S)
            for side, i in firsts.items()
        }
        world_env(self.slots, {side: p[0] for side, p in ports.items()})
        if "rollout" in ports:  # the controller listens on the rollout side's first node
            rollout0 = self.slots[firsts["rollout"]]
            meet = {
                TRANSPORT_ENV: f"{rollout0.ip}:{ports['rollout'][1]}",
                TRAIN_PROCS_ENV: str(sum(s.side == "train" for s in self.slots)),
            }
            for s in self.slots:
                s.env.update({**meet, ROLE_ENV: s.side})

    def call(self, method: str, per_slot: list[list[Any]]) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_slot)]
        return self.ray.get(refs, timeout=ACTOR_CALL_TIMEOUT_S)

    def banner(self, s: Slot) -> str:
        devices = s.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(the node's)"))
        return (
            f"worker {s.label}: Ray node {s.node_id} ({s.ip}), RANK {s.env['RANK']} of {s.env['WORLD_SIZE']}, "
            f"LOCAL_RANK {s.env['LOCAL_RANK']} of {s.env['LOCAL_WORLD_SIZE']}, MASTER {s.env['MASTER_ADDR']}:"
            f"{s.env['MASTER_PORT']}, Ray GPU ids {s.gpus or '-'}, CUDA_VISIBLE_DEVICES {devices}"
        )

    def describe(self, args: list[str]) -> None:
        """--print-only: each worker's place, world and command; nothing runs."""
        for s in self.slots:
            print(f"[{s.label}] {self.banner(s)}", flush=True)
        print(f"[launch] every worker runs: python -m megatron_dapo.train {' '.join(args)}", flush=True)

    def run(self, args: list[str], stop: Stop) -> Optional[str]:
        """Start every trainer and supervise them: None when all exited 0 (finished, or saved after a stop
        signal), else why the attempt failed."""
        # every attempt of this launch carries its tag: a restart takes over the run directory's writer lock
        env = {RUN_TAG_ENV: self.run_tag, **forwarded_env(dict(os.environ)), LOG_DIR_ENV: self.log_dir}
        cwd = os.getcwd()
        self.call("start", [[args, {**env, **s.env}, cwd, self.banner(s)] for s in self.slots])
        done: dict[int, int] = {}
        signalled, train_done_at = 0, None
        while True:
            if stop.count and stop.count != signalled:
                if stop.count > 1:
                    return f"a second {stop.name}: stopped without waiting for the save"
                log(f"{stop.name}: asking the trainers to save and exit")
                for s, a in zip(self.slots, self.actors):
                    if s.side != "rollout":  # the train side stops the controller, which stops the engines
                        a.signal.remote(signal.SIGTERM)
                signalled = stop.count
            refs = [a.poll.remote() for i, a in enumerate(self.actors) if i not in done]
            live = [i for i in range(len(self.slots)) if i not in done]
            for i, ref in zip(live, refs):
                s = self.slots[i]
                try:
                    lines, rc = self.ray.get(ref, timeout=ACTOR_CALL_TIMEOUT_S)
                except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
                    return f"{s.label}'s Ray actor on node {s.node_id[:12]} ({s.ip}) is gone ({_first_line(e)})"
                for line in lines:
                    print(f"[{s.label}] {line}", flush=True)
                if rc is not None:
                    done[i] = rc
                    if rc != 0:
                        return f"{s.label} on Ray node {s.node_id[:12]} ({s.ip}) {_status(rc)}"
            if len(done) == len(self.slots):
                if stop.count:
                    log(f"{stop.name}: every trainer saved and exited; launch again to resume")
                return None
            train_left = [i for i, s in enumerate(self.slots) if s.side != "rollout" and i not in done]
            if not train_left:  # the train side finished and stopped the controller: the engines follow
                train_done_at = train_done_at or time.monotonic()
                if time.monotonic() - train_done_at > ROLLOUT_EXIT_GRACE_S:
                    log(f"the rollout side did not exit within {ROLLOUT_EXIT_GRACE_S:g} s of the train side: killed")
                    return None
            time.sleep(POLL_S)

    def release(self) -> None:
        """Kill every trainer process (a stalled run's woken for their stacks first, each by its actor), then the
        actors, then the placement group: nothing of this attempt stays."""
        ray = self.ray
        with contextlib.suppress(Exception):
            reports = ray.get([a.kill.remote() for a in self.actors], timeout=ACTOR_CALL_TIMEOUT_S)
            report = next((r for r in reports if r), "")
            if report:
                print(f"[launch] {report}", flush=True)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        if self.group is not None:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        self.actors, self.group = [], None


def _status(rc: int) -> str:
    if rc == STALL_EXIT:
        return "stalled (the stall's line and stacks follow)"
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with status {rc}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
