"""Python's garbage collector around a process's start-up.

A process of a run imports torch, Megatron, vLLM and transformers and builds its model: millions of objects that live
as long as the process. With Python's default thresholds (700, 10, 10) the oldest generation is walked again each time
it has grown by a quarter, which is a fifth to a third of a CPU process's start-up (a 2-step tiny run: 31 s of CPU, of
it 9-11 s in the collector; benchmarks/RESULTS.md). `hold_full_collections` (called when the package is imported)
keeps the young generations' thresholds and collects the oldest one a hundred times less often; `start_up_done` (the
trainer, once built) collects once, freezes what start-up left (the collector never walks it again, as vLLM does with
its own heap) and puts the default back for the training loop. At exit (an exit handler) the heap is frozen too: the
interpreter's last collections would walk all of it (2-3 s of CPU in a process that imported torch and
Megatron) for memory the exit hands back anyway.
"""

from __future__ import annotations

import atexit
import gc

OLDEST_EVERY = 1000
"""Young-generation collections between two collections of the oldest generation during start-up (default 10)."""

_DEFAULT = gc.get_threshold()


def hold_full_collections() -> None:
    """Collect the oldest generation OLDEST_EVERY times less often than after every 10 young collections."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, OLDEST_EVERY)
    atexit.register(gc.freeze)  # the interpreter's teardown then collects none of it


def start_up_done() -> None:
    """What start-up built stays for the process's life: collect once, freeze the survivors, default thresholds on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_DEFAULT)
