"""The reward pool's parent-side handle on one scoring process: started with spawn, fed chunks, stopped."""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import time
from collections import deque

from megatron_dapo.reward.tickets import Key
from megatron_dapo.reward.worker import worker_main

_WORKER_NAME_PREFIX = "megatron-dapo-reward-"


def install_spawn_hook() -> None:
    """Stop spawn from re-running the parent's __main__ in our workers.

    By default a spawn child re-imports the launching script, which for the trainer means
    importing torch (seconds and GBs of address space) in every scoring process.
    """
    original = multiprocessing.spawn.get_preparation_data
    if getattr(original, "_megatron_dapo_reward", False):
        return

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        if name.startswith(_WORKER_NAME_PREFIX):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data._megatron_dapo_reward = True  # type: ignore[attr-defined]
    multiprocessing.spawn.get_preparation_data = get_preparation_data


class WorkerProcess:
    """The parent's handle on one scoring process and the items it holds."""

    def __init__(self, slot: int, args: tuple) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child_conn, *args), name=f"{_WORKER_NAME_PREFIX}{slot}", daemon=True
        )
        self.proc.start()
        child_conn.close()
        self.ready = False
        self.fatal = ""
        self.started_at = time.monotonic()
        self.inflight: deque[Key] = deque()
        """Keys sent and not yet reported, in the order the worker scores them."""
        self.item_since = 0.0
        """When the parent last heard from the worker: the running item started no earlier."""

    def stop(self, kill: bool) -> None:
        """Close the pipe (the worker exits at EOF); SIGKILL it when kill or when it lingers."""
        try:
            self.conn.close()
        except OSError:
            pass
        if kill:
            self.proc.kill()
        self.proc.join(timeout=0.5 if not kill else 5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5.0)
        try:
            self.proc.close()
        except ValueError:
            pass
