"""Where the two sides of an asynchronous job meet: the environment a launcher sets and the two transport groups.

A launcher (launch/local.py, launch/ray_cluster.py, slurm/train_qwen32b.sh) sets, per process, ROLE_ENV (which side
it runs: rollout or train), TRANSPORT_ENV (the controller's host:port) and TRAIN_PROCS_ENV (the train side's size).
The groups (rollout/weight_transport.py), both hosted by the controller:

    batches  (gloo, port):        rank 0 the controller, ranks 1.. the train ranks; its TCP store holds the keys
    weights  (gloo|nccl, port+1): ranks 0..R-1 the rollout ranks, rank R train rank 0, which sends every update
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megatron_dapo.config import Config, ConfigError

ROLE_ENV, TRANSPORT_ENV, TRAIN_PROCS_ENV = "DAPO_ROLE", "DAPO_TRANSPORT", "DAPO_TRAIN_PROCS"
"""How a process of an asynchronous job learns its side, the controller's host:port and the train side's size."""
ROLES = ("rollout", "train")


@dataclass(frozen=True)
class Transport:
    """Where the two sides meet (from the environment the launcher sets)."""

    host: str
    port: int
    train_procs: int

    @staticmethod
    def from_env() -> Transport:
        where, procs = os.environ.get(TRANSPORT_ENV, ""), os.environ.get(TRAIN_PROCS_ENV, "")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit() or not procs.isdigit() or int(procs) < 1:
            raise ConfigError(
                f"pipeline.mode=async: {TRANSPORT_ENV}={where!r} and {TRAIN_PROCS_ENV}={procs!r}: expected host:port "
                "and the number of train processes (python -m megatron_dapo.launch sets them when it starts both sides)"
            )
        return Transport(host, int(port), int(procs))

    def connect(self, role: str, rank: int, rollout_procs: int, backend: str, timeout_s: float) -> tuple[Any, Any]:
        """(batches group, weights group) for rank `rank` of side `role` (rollout or train), None where it is not a
        member: batches = the controller (rollout rank 0) and every train rank; weights = every rollout rank (each
        drives an engine) and train rank 0, the sender. timeout_s: trainer.collective_timeout_s, for both."""
        from megatron_dapo.rollout.weight_transport import TransportGroup

        if role == "rollout":
            in_batches, in_weights = (0 if rank == 0 else None), rank
        else:
            in_batches, in_weights = rank + 1, (rollout_procs if rank == 0 else None)
        batches = weights = None
        if in_batches is not None:
            batches = TransportGroup.connect(
                self.host, self.port, in_batches, 1 + self.train_procs, "gloo", timeout_s, "batches"
            )
        if in_weights is not None:
            weights = TransportGroup.connect(
                self.host, self.port + 1, in_weights, rollout_procs + 1, backend, timeout_s, "weights"
            )
        return batches, weights


def transport_backend(cfg: Config) -> str:
    """The weights group's backend: pipeline.weights_backend, auto resolved by whether CUDA is available."""
    import torch

    backend = cfg.pipeline.weights_backend
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("config field pipeline.weights_backend='nccl': expected CUDA in this process (none found)")
    return backend


def process_role(cfg: Config) -> str:
    """What this process runs: 'colocated', or its side of an asynchronous job (ROLE_ENV, set by the launchers);
    an asynchronous job's transport is checked here, before either side builds anything."""
    if cfg.pipeline.mode != "async":
        return "colocated"
    role = os.environ.get(ROLE_ENV)
    if role is None:
        raise ConfigError(
            f"pipeline.mode=async and {ROLE_ENV} is not set: start both sides with python -m megatron_dapo.launch "
            "local [--nproc-per-node N] (or slurm, ray), which sets it per process"
        )
    if role not in ROLES:
        raise ConfigError(f"{ROLE_ENV}={role!r}: expected rollout or train (pipeline.mode=async)")
    Transport.from_env()
    transport_backend(cfg)
    return role
