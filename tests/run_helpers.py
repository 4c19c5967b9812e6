"""A training run's metrics as the tests compare them (tests/test_trainer.py, tests/test_slurm_cluster.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

DETERMINISTIC = ("reward/", "sampler/", "skip/", "actor/", "response/", "trainer/", "rollout/", "eval/", "step")


def metrics(run: Path) -> list[dict]:
    """run_dir/metrics.jsonl, one dict per line; [] before the first step has written one."""
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def comparable(m: dict) -> dict:
    """The metrics a rerun must reproduce: not times, and not bytes moved between ranks (they depend on the layout)."""
    return {k: v for k, v in m.items() if k.startswith(DETERMINISTIC) and "seconds" not in k and "bytes" not in k}


def python_path(*dirs: Path | str) -> str:
    """PYTHONPATH with dirs in front of the one this process has: a subprocess keeps whatever the test run put first
    (make mutants puts its mutated copy of the package there)."""
    return os.pathsep.join([*(str(d) for d in dirs), *filter(None, [os.environ.get("PYTHONPATH")])])
