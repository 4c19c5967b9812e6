"""gc_tuning: the package's import holds off full collections, the trainer's start_up_done freezes what start-up built
and puts Python's default thresholds back, and the exit freezes the rest (each checked in a fresh interpreter: this
one's collector is pytest's)."""

from __future__ import annotations

import json
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
