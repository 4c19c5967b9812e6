"""The sampling scheduler's state between steps: what a checkpoint holds of it, and the fingerprint by which the ranks
check that they took the same decisions (SamplingScheduler inherits these)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from megatron_dapo.sampling.records import GroupMeta, Paused


class SchedulerState:
    """state_dict / digest / load_state_dict of SamplingScheduler (its attributes: scheduler.py)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (plain containers); only between steps."""
        if self._step is not None:
            raise RuntimeError("state_dict() during a step: a checkpoint is taken between steps")
        return {
            "version": 3,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "policy_version": self.version,
            "epoch": self.epoch,
            "next_key": self.next_key,
            "queue": list(self.queue),
            "carry": [g.to_dict() for g in self.carry],
            "paused": [asdict(p) for p in self.paused],
            "informative_frac": self.informative_frac,
            "memory": self.memory.state_dict(),
        }

    def digest(self) -> int:
        """A 52-bit fingerprint of the state (exact in a float64): ranks that took the same decisions share it."""
        import hashlib

        state = self.state_dict()
        del state["memory"]  # numpy arrays: hashed as bytes
        h = hashlib.blake2b(json.dumps(state, sort_keys=True).encode(), digest_size=8)
        self.memory.update_digest(h)
        return int.from_bytes(h.digest(), "little") >> 12

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in (2, 3):
            raise ValueError(f"sampler state: unknown version {state.get('version')!r}, expected 3 (or 2)")
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state was saved with a dataset of {state['num_prompts']} prompts, but this dataset has "
                f"{self.num_prompts}: resuming would repeat or skip prompts"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state was saved with seed {state['seed']}, this run has {self.seed}")
        if "memory" in state:  # version 2 had no prompt memory: the record starts empty
            self.memory.load_state_dict(state["memory"])
        self.version = int(state["policy_version"])
        self.epoch = int(state["epoch"])
        self.next_key = int(state["next_key"])
        self.queue = [int(i) for i in state["queue"]]
        self.carry = [GroupMeta.from_dict(g) for g in state["carry"]]
        self.paused = [Paused(**p) for p in state["paused"]]
        self.informative_frac = float(state["informative_frac"])
