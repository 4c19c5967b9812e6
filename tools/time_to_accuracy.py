"""Time to a held-out accuracy, from training runs' metrics: one Markdown table, the runs side by side.

    python -m megatron_dapo.train ... data.val_files=[runs/demo/val.jsonl] eval.every=20 trainer.run_dir=runs/a
    python -m megatron_dapo.train ... (the same) pipeline.mode=async sampler.max_staleness=1 trainer.run_dir=runs/b
    python tools/time_to_accuracy.py colocated=runs/a async=runs/b --target 0.7

Each argument is LABEL=RUN_DIR (its metrics.jsonl, written by one uninterrupted process: `timing/elapsed` counts
from that process's first step). Per run: the first evaluation at or above --target (its step and elapsed seconds,
evaluations included), the tokens generated per token trained up to that step, the largest staleness of a trained
token (max and p99 over the steps), the median step, and every evaluation as accuracy (step, seconds).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from megatron_dapo.cli import argument_parser


def summarize(lines: list[dict], target: float) -> dict:
    """One run's row: lines are its metrics.jsonl in step order; the eval metric is eval/avg_at_k."""
    if not lines:
        raise ValueError("no metrics lines")
    missing = [int(m["step"]) for m in lines if "timing/elapsed" not in m]
    if missing:
        raise ValueError(f"steps {missing[:5]} have no timing/elapsed (written by megatron_dapo.train since issue 27)")
    evals = [(int(m["step"]), m["eval/avg_at_k"], m["timing/elapsed"]) for m in lines if "eval/avg_at_k" in m]
    hit = next((e for e in evals if e[1] >= target), None)
    upto = [m for m in lines if hit is None or m["step"] <= hit[0]]
    generated = sum(m["tokens/generated"] for m in upto)
    trained = sum(m["tokens/trained"] for m in upto)
    return {
        "steps": len(lines),
        "hit_step": None if hit is None else hit[0],
        "hit_seconds": None if hit is None else hit[2],
        "generated_per_trained": generated / trained if trained else float("nan"),
        "staleness_max": max(m.get("staleness/max", 0.0) for m in lines),
        "staleness_p99": max(m.get("staleness/p99", 0.0) for m in lines),
        "step_median_s": statistics.median(m["timing/step"] for m in lines),
        "evals": evals,
    }


def main(argv: list[str]) -> list[dict]:
    ap = argument_parser(__doc__)
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    ap.add_argument("--target", type=float, default=0.7, help="held-out accuracy to reach (default 0.7)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    rows = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        metrics = Path(path) / "metrics.jsonl"
        if not sep or not metrics.is_file():
            ap.error(f"{item!r}: expected LABEL=RUN_DIR with RUN_DIR/metrics.jsonl")
        try:
            row = summarize([json.loads(x) for x in metrics.read_text().splitlines()], args.target)
        except (ValueError, KeyError) as e:
            ap.error(f"{metrics}: {e}")
        rows.append({"run": label, **row})
    print(
        f"| run | steps | first eval >= {args.target:.0%}: step | seconds | generated / trained tokens to it | "
        "staleness max / p99 | step (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hit = ("not reached", "-") if r["hit_step"] is None else (str(r["hit_step"]), f"{r['hit_seconds']:.0f}")
        print(
            f"| {r['run']} | {r['steps']} | {hit[0]} | {hit[1]} | {r['generated_per_trained']:.2f} | "
            f"{r['staleness_max']:.0f} / {r['staleness_p99']:.0f} | {r['step_median_s']:.3f} s |"
        )
    print()
    print("| run | held-out accuracy at (step, seconds) |")
    print("|---|---|")
    for r in rows:
        print(f"| {r['run']} | " + ", ".join(f"{a:.1%} ({s}, {t:.0f} s)" for s, a, t in r["evals"]) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
