"""Does the demo give the same numbers under other CPU kernels and thread counts? One demo run per setting, one table.

    python tools/demo_determinism.py --steps 60 --out runs/determinism

Runs `python -m megatron_dapo.demo --steps N` (no time limit, so a loaded machine takes as many steps) once for each
ATEN_CPU_CAPABILITY x OMP_NUM_THREADS setting (`--settings default/1,default/2,avx2/1,avx2/2`; `default` leaves
the variable unset: this CPU's best), one at a time, then compares each run with the first: the warm start's
weights (sha256 of model.safetensors), the held-out accuracy at each evaluation, and every metric of every DAPO
step but the timings. Prints one Markdown row per setting: where it first differs from the first, and by how much.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_dapo.cli import argument_parser
from megatron_dapo.timing import comparable


def run_demo(out: Path, capability: str, threads: int, steps: int, seed: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != "default":
        env["ATEN_CPU_CAPABILITY"] = capability
    cmd = [sys.executable, "-m", "megatron_dapo.demo", "--out", str(out), "--steps", str(steps), "--minutes", "600"]
    cmd += ["--seed", str(seed)]
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"error: the demo under {capability}/{threads} exited {proc.returncode}: {out}.log")


def read_run(out: Path) -> dict:
    steps = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    weights = (out / "warm_start" / "model.safetensors").read_bytes()
    return {
        "weights": hashlib.sha256(weights).hexdigest()[:12],
        "summary": json.loads((out / "summary.json").read_text()),
        "steps": [comparable(m) for m in steps],
    }


def first_difference(a: dict, b: dict) -> tuple[str, float]:
    """(the first DAPO step whose metrics differ, with the largest absolute difference there) or ('none', 0)."""
    for ma, mb in zip(a["steps"], b["steps"], strict=False):
        keys = sorted(set(ma) | set(mb))
        diffs = [abs(ma.get(k, float("nan")) - mb.get(k, float("nan"))) for k in keys if ma.get(k) != mb.get(k)]
        if diffs:
            return f"step {int(ma['step'])}", max(diffs)
    if len(a["steps"]) != len(b["steps"]):
        return f"steps {len(a['steps'])} / {len(b['steps'])}", float("nan")
    return "none", 0.0


def main(argv: list[str]) -> list[dict]:
    ap = argument_parser(__doc__)
    ap.add_argument("--steps", type=int, default=60, help="DAPO steps per run")
    ap.add_argument("--seed", type=int, default=0, help="the demo's --seed")
    ap.add_argument("--out", type=Path, default=Path("runs/determinism"), help="one demo directory per setting here")
    ap.add_argument("--settings", default="default/1,default/2,avx2/1,avx2/2", help="CAPABILITY/THREADS,...")
    ap.add_argument("--reuse", action="store_true", help="compare runs already in --out instead of running them")
    args = ap.parse_args(argv)
    settings = []
    for item in args.settings.split(","):
        cap, sep, threads = item.partition("/")
        if not sep or not threads.isdigit() or int(threads) < 1:
            ap.error(f"--settings {item!r}: expected CAPABILITY/THREADS, e.g. avx2/1")
        settings.append((cap, int(threads)))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cap, threads in settings:
        out = args.out / f"{cap}_{threads}"
        if not args.reuse:
            run_demo(out, cap, threads, args.steps, args.seed)
        rows.append({"setting": f"{cap}/{threads}", **read_run(out)})
    print(
        "| ATEN_CPU_CAPABILITY / OMP_NUM_THREADS | warm-start weights | held-out accuracy at evaluations | first step differing from the first row | largest difference there |"
    )
    print("|---|---|---|---|---:|")
    for r in rows:
        where, size = first_difference(rows[0], r)
        evals = " ".join(f"{int(s)}:{acc:.3f}" for s, acc in r["summary"]["evals"])
        print(f"| {r['setting']} | {r['weights']} | {evals} | {where} | {size:.3g} |")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
