"""Asynchronous against colocated DAPO at paper scale, simulated with training (python tools/bench_async.py --help).

    python tools/bench_async.py                          # the issue-27 table: ~30 min on 2 cores
    python tools/bench_async.py --quick                  # 32 GPUs, 32-group batches: a smoke test (seconds)
    python tools/bench_async.py --regimes late --p 0.5 --json runs/async.json
    python tools/bench_async.py --no-barrier --etas 2    # async rows without a tick barrier: an optimistic bound

One unit throughout: seconds per step of --batch trained groups of 16 (512: the paper's), on --gpus H100s. The
simulator (megatron_dapo/sampling/sim/: the real SamplingScheduler on simulated vLLM engines, engines.py and
calibration.py) generates; training and refit follow training.py (8N + 2N FLOPs a trained token at 389 TFLOP/s a
GPU, refit at 63 GB/s; sources in benchmarks/SAMPLER_CALIBRATION.md, committed before this table existed). Every
row's engines are TP --rollout-tp (8: the shipped 32B example) and run at most --engine-sequences sequences.

Rows, per length regime and informative fraction p:
- colocated (every GPU generates, then trains, then refits; pipeline.py): `fill drop` (verl's DAPO recipe: rounds of
  3 x batch prompts, surplus dropped), `stream` (on-policy, the shipped default), `stream+partial eta=1`;
- async eta=E R/T: R GPUs of engines, T = gpus - R training, partial rollout admitting E batches ahead
  (pipeline.simulate_async), at each --splits R;
- busy floor: all GPU-seconds of generation at the generation floor and of training, over the GPUs.
Columns: the calibration as written, then the training rate (flops) and the refit rate at x0.5 and x2. Goal lines
(issue 27): the best async row within 5% of the busy floor, at most 0.9 x colocated stream+partial; its ratio to
verl's recipe. Staleness (weight versions between a trained group's start and its training): max and p99 of the
best async row, with the calibration as written.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from megatron_dapo.cli import argument_parser, tool_log
from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.sim.calibration import fit_h100_calibration
from megatron_dapo.sampling.sim.driver import Row, simulate
from megatron_dapo.sampling.sim.engines import EngineModel
from megatron_dapo.sampling.sim.hardware import QWEN25_32B
from megatron_dapo.sampling.sim.pipeline import async_row, busy_floor_seconds, colocated_step_seconds, simulate_async
from megatron_dapo.sampling.sim.training import TrainModel
from megatron_dapo.sampling.sim.workload import LENGTH_REGIMES as REGIMES
from megatron_dapo.sampling.sim.workload import Workload

log = tool_log("bench_async")

VARIANTS = {"as written": (1.0, 1.0), "flops x0.5": (0.5, 1.0), "flops x2": (2.0, 1.0)}
VARIANTS |= {"refit x0.5": (1.0, 0.5), "refit x2": (1.0, 2.0)}
"""Column: (training-rate factor, refit-rate factor)."""


def colocated_rows(base: SamplerConfig) -> list[Row]:
    partial = replace(base, mode="stream", partial_rollout=True, max_staleness=1)
    return [
        Row("colocated fill drop (verl)", replace(base, mode="fill", carry_surplus=False)),
        Row("colocated stream", replace(base, mode="stream")),
        Row("colocated stream+partial eta=1", partial),
    ]


def run_cell(args, engine: EngineModel, regime: str, p: float) -> dict:
    """Every row of one (regime, p): {row: {variant: seconds per step}} plus staleness and the floor."""
    batch, gpus = args.batch, args.gpus
    base = SamplerConfig(
        train_batch_size=batch, gen_batch_size=3 * batch, engine_sequences=args.engine_sequences, tick_steps=args.tick
    )
    workload = Workload(p=p, mean_len=REGIMES[regime], seed=args.seed)
    trains = {name: TrainModel().scaled(flops=f, refit=r) for name, (f, r) in VARIANTS.items()}
    rows: dict[str, dict] = {}
    for row in colocated_rows(base):
        res = simulate(row, engine, workload, num_engines=gpus // engine.tp, steps=args.steps, warmup=args.warmup)
        ms = res.measured
        rows[row.name] = {
            name: float(np.mean([colocated_step_seconds(s.gen_s, s.train_tokens, t, gpus) for s in ms]))
            for name, t in trains.items()
        }
    for eta in args.etas:
        for r in args.splits:
            name = f"async eta={eta} {r}/{gpus - r}"
            rows[name] = {}
            for vname, t in trains.items():
                out = simulate_async(
                    async_row(Row("base", base), eta),
                    engine,
                    workload,
                    t,
                    rollout_gpus=r,
                    train_gpus=gpus - r,
                    steps=args.steps,
                    warmup=args.warmup,
                    seed=args.seed,
                    barrier=not args.no_barrier,
                )
                summary = out.summary()
                rows[name][vname] = summary["step_s"]
                if vname == "as written":
                    rows[name]["staleness"] = (summary["staleness_max"], summary["staleness_p99"])
    rows["busy floor"] = {
        name: busy_floor_seconds(engine, workload, t, batch=batch, gpus=gpus, steps=args.steps, seed=args.seed)
        for name, t in trains.items()
    }
    return rows


def table(regime: str, p: float, rows: dict) -> list[str]:
    head = f"| {regime} p={p} | " + " | ".join(VARIANTS) + " | staleness max / p99 |"
    out = [head, "|" + "---|" * (len(VARIANTS) + 2)]
    for name, cells in rows.items():
        stale = cells.get("staleness")
        tail = f"{stale[0]:.0f} / {stale[1]:.0f}" if stale else "-"
        out.append(f"| {name} | " + " | ".join(f"{cells[v]:.0f}" for v in VARIANTS) + f" | {tail} |")
    asyncs = [n for n in rows if n.startswith("async")]
    for goal, ref, limit in (
        ("best async / busy floor", "busy floor", 1.05),
        ("best async / colocated stream+partial", "colocated stream+partial eta=1", 0.9),
        ("best async / verl fill drop", "colocated fill drop (verl)", None),
    ):
        ratios = [min(rows[n][v] for n in asyncs) / rows[ref][v] for v in VARIANTS]
        verdict = "" if limit is None else (" goal met" if all(x <= limit for x in ratios) else " goal missed")
        out.append(f"| {goal} (goal {limit or '-'}){verdict} | " + " | ".join(f"{x:.3f}" for x in ratios) + " | |")
    best = {v: min(asyncs, key=lambda n: rows[n][v]) for v in VARIANTS}
    out.append("| best async row | " + " | ".join(best[v].removeprefix("async ") for v in VARIANTS) + " | |")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("--gpus", type=int, default=128, help="H100s in all (the paper's 16 nodes x 8)")
    ap.add_argument("--batch", type=int, default=512, help="trained groups a step")
    ap.add_argument("--rollout-tp", type=int, default=8, help="GPUs per engine (the shipped 32B example's 8)")
    ap.add_argument("--engine-sequences", type=int, default=256, help="sequences an engine runs at most (example: 256)")
    ap.add_argument("--tick", type=int, default=32, help="engine steps per scheduler tick")
    ap.add_argument("--splits", type=int, nargs="+", default=[64, 80, 96, 112], help="rollout GPUs of each split")
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2], help="sampler.max_staleness of the async rows")
    ap.add_argument("--p", type=float, nargs="+", default=[0.25, 0.5], help="informative fractions")
    ap.add_argument("--regimes", nargs="+", choices=sorted(REGIMES), default=list(REGIMES), help="length regimes")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--no-barrier",
        action="store_true",
        help="async rows without the tick barrier (a tick lasts the engines' mean time): an optimistic bound",
    )
    ap.add_argument("--quick", action="store_true", help="32 GPUs, 32-group batches, eta 1, 1 + 2 steps: a smoke test")
    ap.add_argument("--json", type=Path, help="write every cell here")
    args = ap.parse_args(argv)
    if args.quick:
        args.gpus, args.batch, args.splits, args.etas, args.steps, args.warmup = 32, 32, [16, 24], [1], 2, 1
        args.p, args.regimes = args.p[:1], args.regimes[:1]
    for r in args.splits:
        if not (0 < r < args.gpus and r % args.rollout_tp == 0):
            raise SystemExit(f"--splits {r}: expected a multiple of --rollout-tp {args.rollout_tp} below --gpus")
    engine = EngineModel.calibrated(
        fit_h100_calibration(), model=QWEN25_32B, tp=args.rollout_tp, max_num_seqs=args.engine_sequences
    )
    t0 = time.perf_counter()
    results: dict = {}
    for regime in args.regimes:
        for p in args.p:
            rows = run_cell(args, engine, regime, p)
            results[f"{regime} p={p}"] = rows
            log(f"{regime} p={p} done ({time.perf_counter() - t0:.0f} s)")
            print("\n".join(table(regime, p, rows)) + "\n", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"}, **results}))
    return results


if __name__ == "__main__":
    main()
