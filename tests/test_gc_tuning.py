"""gc_tuning: the package's import holds off full collections, the trainer's start_up_done freezes what start-up built
and puts Python's default thresholds back, and the exit freezes the rest (each checked in a fresh interpreter: this
one's collector is pytest's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import atexit, gc, json, sys
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()})))  # runs after the package's
before = gc.get_threshold()
import megatron_dapo
from megatron_dapo import gc_tuning
held = gc.get_threshold()
kept = [object() for _ in range(1000)]  # what start-up built, still alive
gc_tuning.start_up_done()
print(json.dumps({"before": before, "held": held, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
later = [[] for _ in range(1000)]  # what the run built after start-up, alive at exit
"""


def test_start_up_holds_full_collections_then_freezes_and_restores_the_defaults():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got, end = map(json.loads, proc.stdout.splitlines())
    young, middle, _ = got["before"]
    assert got["held"] == [young, middle, 1000]  # the young generations as before, the oldest 100x less often
    assert got["after"] == got["before"]  # the training loop collects as Python does by default
    assert got["frozen"] >= 1000  # everything alive (the 1000 kept objects among it) out of the collector's walk
    # at exit the rest is frozen too: the interpreter's teardown walks none of it (2-3 s of CPU after torch, Megatron)
    assert end["frozen_at_exit"] > got["frozen"] + 900  # the 1000 lists built after (less a few freed since)


AGENT_PROBE = """
import atexit, gc, json, os, sys
def report():  # registered before anything else: runs after every other exit handler
    if sys.argv[0].endswith(os.path.join("launch", "torchrun.py")):
        print(json.dumps({"agent_frozen_at_exit": gc.get_freeze_count()}), flush=True)
atexit.register(report)
"""


def test_the_launchers_torchrun_agent_runs_the_ranks_and_exits_with_its_heap_frozen(tmp_path):
    from megatron_dapo.launch import torchrun

    (tmp_path / "sitecustomize.py").write_text(AGENT_PROBE)  # imported by every interpreter started below
    rank = tmp_path / "rank.py"  # each rank names itself in a file of its own (the ranks share one stdout)
    rank.write_text(f"import os\nopen(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write("
                    "os.environ['WORLD_SIZE'])\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([*torchrun.command(2), str(rank)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {f.name: f.read_text() for f in tmp_path.glob("rank?")} == {"rank0": "2", "rank1": "2"}
    (agent,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # torch's agent, imported after the package: all of torch's heap frozen, none of it walked at exit
    assert agent["agent_frozen_at_exit"] > 100_000
