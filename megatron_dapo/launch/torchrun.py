"""torchrun (torch.distributed.run's elastic agent) as the project starts it on one machine: `command(procs)`.

The agent imports torch, starts the ranks and waits for them. Run as `python -m torch.distributed.run`, its exit walks
torch's whole heap in the interpreter's last collections (about a second of CPU per launch; benchmarks/RESULTS.md).
Run as this module it imports the package first, whose exit handler freezes the heap (gc_tuning.py), and then is
torch's own agent: the same options, the same behaviour.
"""

from __future__ import annotations

import sys


def command(procs: int) -> list[str]:
    """The agent for procs ranks on this machine, the ranks' program to follow: --standalone, a rendezvous of its own
    whose store binds a free port itself (no race for a port between launches side by side)."""
    return [sys.executable, "-m", "megatron_dapo.launch.torchrun", "--standalone", f"--nproc-per-node={procs}"]


if __name__ == "__main__":
    from torch.distributed.run import main

    main()
