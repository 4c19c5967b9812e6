"""How persistent are a run's prompt outcomes? The evidence for (or against) sampler.skip, from a checkpoint.

    python tools/prompt_persistence.py RUN_DIR/checkpoints/step_00000180 --since 120

Reads the loader's prompt memory (every run keeps it, skipping or not) from the checkpoint's rank-0 state and
prints, for visits at step >= --since that follow an earlier one, how often the group was uninformative given
the prompt's streak before it (z all-correct or all-wrong groups in a row; 3 = 3 or more), against the rate
after an informative visit. Skipping pays when a streak predicts an uninformative group far better than that.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from megatron_dapo.cli import argument_parser
from megatron_dapo.convert.resolve import read_rank_state
from megatron_dapo.sampling.prompt_memory import persistence


def main(argv: list[str]) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("checkpoint", type=Path, help="a step directory of a run's checkpoints")
    ap.add_argument("--since", type=int, default=0, help="only visits at this step or later")
    ap.add_argument("--group-size", type=int, help="algorithm.group_size (default: the run's config.yaml)")
    args = ap.parse_args(argv)
    rank0 = args.checkpoint / "state" / "rank00000.pt"
    if not rank0.is_file():
        ap.error(f"{rank0} does not exist: expected a checkpoint step directory (checkpoints/step_NNNNNNNN)")
    state = read_rank_state(rank0)
    try:
        memory = state["trainer"]["loader"]["scheduler"]["memory"]
    except KeyError:
        ap.error(f"{rank0}: no prompt memory in the loader's state (saved by a version before it existed)")
    group = args.group_size
    config = args.checkpoint.parent.parent / "config.yaml"  # run_dir/checkpoints/step_N -> run_dir/config.yaml
    if group is None and config.is_file():
        group = int(yaml.safe_load(config.read_text())["algorithm"]["group_size"])
    if group is None:
        ap.error(f"no {config} to read algorithm.group_size from: pass --group-size")
    table = persistence(memory, group, args.since)
    total = sum(n for n, _ in table.values())
    print(f"{total} visits after an earlier one (step >= {args.since}, G = {group})")
    print("| streak before | visits | uninformative |")
    print("|---|---:|---:|")
    for (kind, z), (n, u) in table.items():
        label = "informative last" if kind == "none" else f"{z}{'+' if z == 3 else ''} all {kind}"
        print(f"| {label} | {n} | {u / n:.3f} |")
    return {f"{k}_{z}": v for (k, z), v in table.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
