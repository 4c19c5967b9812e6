"""A run never destroys another run's data (docs/training.md, "What happens to an existing run directory").

A run started with trainer.resume=false in a run_dir that holds another run's checkpoints or metrics would write its
own step_N, latest, config.yaml and metrics over that run's, and leave the rest of it beside them. It is refused
before anything is written, with the ways on: resume it, start in another run_dir, or trainer.overwrite=true, which
moves the old run aside (run_dir.replaced-TIME) rather than deleting anything. The launchers check before they start
anything; each train process checks again (the one that moves is rank 0, or the launcher).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from megatron_dapo.cli import UserError

log = logging.getLogger("megatron_dapo.train")


class RunDirTaken(UserError):
    """trainer.resume=false in a run directory that holds another run."""


def another_run(run_dir: Path) -> str:
    """What of a run run_dir holds ('' for nothing): its checkpoints (complete or not) and metrics lines."""
    held = []
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if steps:
        held.append(f"{len(steps)} checkpoint(s), {steps[0]} to {steps[-1]}")
    metrics = run_dir / "metrics.jsonl"
    lines = len([x for x in metrics.read_text().splitlines() if x.strip()]) if metrics.is_file() else 0
    if lines:
        held.append(f"metrics.jsonl with {lines} step(s)")
    return " and ".join(held)


def check_run_dir(cfg: Any, mover: bool) -> None:
    """Before anything is written (trainer.resume=false): refuse a run_dir that holds another run (RunDirTaken, one
    line naming it and the ways on), or with trainer.overwrite=true move that run aside, where mover is the one
    process to do it (the others go on)."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    if t.resume or not run_dir.is_dir():
        return
    held = another_run(run_dir)
    if not held:
        return
    if not t.overwrite:
        raise RunDirTaken(
            f"trainer.run_dir={run_dir} holds another run ({held}), which trainer.resume=false would overwrite: "
            "continue it with trainer.resume=true, or start this run in another trainer.run_dir (trainer.overwrite="
            "true moves the old run aside first)"
        )
    if mover:
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(run_dir, aside)
        log.warning("trainer.overwrite=true: moved the run that was in %s (%s) to %s", run_dir, held, aside)
