"""Compare demo runs: held-out accuracy against the demo clock and generated tokens per trained token, one PNG.

    python -m megatron_dapo.demo --out /tmp/demo_stream
    python -m megatron_dapo.demo --out /tmp/demo_skip sampler.skip=true
    python tools/compare_demos.py stream=/tmp/demo_stream skip=/tmp/demo_skip --png docs/demo_skip.png

Each argument is LABEL=DIR, DIR a demo's --out directory (its summary.json and run/metrics.jsonl). Prints one
Markdown row per run (steps, seconds, accuracy before and after, generated and trained tokens and their ratio),
then the held-out accuracy at each evaluation with its demo-clock time; --json writes the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_dapo.cli import argument_parser
from megatron_dapo.demo import compare


def main(argv: list[str]) -> list[dict]:
    ap = argument_parser(__doc__)
    ap.add_argument("runs", nargs="+", help="LABEL=DIR, a demo's --out directory")
    ap.add_argument("--png", type=Path, required=True, help="write the two-panel plot here")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not (Path(path) / "summary.json").is_file():
            ap.error(f"{item!r}: expected LABEL=DIR with DIR a demo's --out directory (DIR/summary.json)")
        runs[label] = Path(path)
    rows = compare(runs, args.png)
    print(
        "| run | steps | seconds | accuracy before | after | generated tokens | trained tokens | generated / trained |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['run']} | {r['steps']} | {r['seconds']:.0f} | {r['before']:.1%} | {r['after']:.1%} | "
            f"{r['generated_tokens']:,.0f} | {r['trained_tokens']:,.0f} | {r['generated_per_trained']:.2f} |"
        )
    print()
    print("| run | held-out accuracy at (step, demo seconds) |")
    print("|---|---|")
    for r in rows:
        points = ", ".join(f"{a:.1%} ({s}, {t:.0f} s)" for (s, a), t in zip(r["evals"], r["eval_seconds"]))
        print(f"| {r['run']} | {points} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
