"""The simulator's driver: simulate() runs the real SamplingScheduler on simulated engines, one table row at a time.

simulate() runs begin_step / plan / tick / observe (a group is observed at the end of the tick after
the one in which its last sample finished, as the loader's _collect_scored does: scoring lags one
tick) / close_step / settle with Stopped from the engines (a group finished but not yet observed is
stopped like one still generating: paused with its samples whole, or aborted), keeping paused groups'
tokens on their engine. Generation time of a step = the sum of its tick times (fill: of its rounds'
slowest-engine times), from begin_step (re-prefilling resumed groups included) to the full batch.
Between steps a weight sync of `sync_s` seconds happens with the engines asleep (colocated): nothing
generates, so it is reported apart and is the same for every mode. Rows use max_gen_batches = 10 and
gen_batch_size = 1536 (verl's recipe: fill's round size; for stream only the generation cap).
engine_sequences (stream, partial rollout, informative only) = 128 samples per engine, the config default: about
what the KV cache holds at the late run's lengths (~110 sequences of ~6k tokens per engine). The engines
report their unfinished samples every tick and new groups go where there is room; counting whole groups
instead (an engine finishing one group's straggler then looks full) was 10-40% slower here, and a budget
of 320 samples floods the queues (thousands of preemptions a step). stream_margin = 0 and tick_steps =
32 (~0.8 s of generation) are the config defaults, both chosen from this simulator's first runs: margin
0 wasted 4.5% of tokens at p = 0.25 and 0.5 against 6.1-6.6% at margin 1, in the same generation time;
ticks of 8 to 512 steps moved the stream rows by under 1%.

Every row's engines run at most max_num_seqs sequences at once (EngineModel; bench_sampler sets it to the stream
rows' engine_sequences), fill's included: fill queues its whole round in the engines, and vLLM runs max_num_seqs of
it at a time, so the rows differ in what they generate and when, not in how many sequences an engine may run.

floor_seconds() is a true floor: the generation time of a batch of informative groups alone, with no tail and no
engine ever below max_num_seqs sequences (the only batching-dependent cost, a step's overhead and weight read, spread
over the most sequences an engine may run), the rest (context reads, per-sequence compute, each prompt's prefill once)
paid exactly once per token: no schedule of these engines can generate those tokens faster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from megatron_dapo.choices import ROUND_SAMPLER_MODES
from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.records import GroupMeta, StepResult
from megatron_dapo.sampling.scheduler import SamplingScheduler
from megatron_dapo.sampling.sim.engines import EngineModel, EnginePool
from megatron_dapo.sampling.sim.workload import Workload


@dataclass(frozen=True)
class Row:
    """One table row: its name, the sampler config it runs (a dataclasses.replace of a base SamplerConfig, so every
    field not named keeps the shipped default), and whether its workload is only informative prompts (oracle)."""

    name: str
    sampler: SamplerConfig
    oracle: bool = False


def paper_rows(base: SamplerConfig) -> list[Row]:
    """The table's rows over `base` (its batch, generation round, engine budget and tick): fill dropping or carrying
    the surplus, stream, stream with partial rollout admitting eta = 1 and 2 batches ahead, partial rollout with the
    older drop rule at staleness 1 (sampler.drop_stale), and stream over informative prompts only (a workload no
    sampler can draw; it still waits for its longest responses: not a floor, see floor_seconds)."""
    partial = replace(base, mode="stream", partial_rollout=True)
    return [
        Row("fill drop", replace(base, mode="fill", carry_surplus=False)),
        Row("fill carry", replace(base, mode="fill", carry_surplus=True)),
        Row("stream", replace(base, mode="stream")),
        Row("stream+partial eta=1", replace(partial, max_staleness=1)),
        Row("stream+partial eta=2", replace(partial, max_staleness=2)),
        Row("stream+partial drop S=1", replace(partial, max_staleness=1, drop_stale=True)),
        Row("informative only", replace(base, mode="stream"), oracle=True),
    ]


def memory_rows(base: SamplerConfig) -> list[Row]:
    """The prompt-memory table's rows: on-policy stream without and with sampler.skip (base's skip settings)."""
    return [
        Row("stream", replace(base, mode="stream", skip=False)),
        Row("stream+skip", replace(base, mode="stream", skip=True)),
    ]


@dataclass
class StepRecord:
    """One simulated rollout step (tokens as the scheduler's stats count them: this step's version only)."""

    gen_s: float
    ticks: int
    generated: float
    trained: float
    wasted: float
    wasted_earlier: float
    uninformative: float
    carried: float
    paused: float
    busy_s: float
    """Engine-seconds busy (decoding or prefilling), summed over engines."""
    prefill_s: float
    """Mean over engines of the step's prefill seconds (resumed groups' re-prefill included)."""
    in_flight_max: float
    batch_groups: float
    groups_generated: float
    informative_frac: float
    rounds: float
    resumed: float
    stale_dropped: float
    preempted: int
    length_max: float
    """Longest response generated in the step (tokens)."""
    mean_running: float
    """Running sequences per engine, averaged over ticks weighted by tick time."""
    skipped: float = 0.0
    """Prompts deferred by the skip policy (sampler.skip)."""
    precision: float = float("nan")
    """Of the step's exploration visits (generated prompts the record predicted uninformative), the uninformative share."""
    informative_frac_before: float = float("nan")
    """The informative fraction had nothing been skipped (Horvitz-Thompson estimate; = informative_frac without skip)."""
    train_tokens: float = 0.0
    """Tokens the step's batch trains: every response, all versions, with its prompt (batch_tokens)."""


@dataclass
class SimResult:
    row: Row
    workload: dict
    steps: list[StepRecord]
    warmup: int
    sync_s: float
    num_engines: int

    @property
    def measured(self) -> list[StepRecord]:
        return self.steps[self.warmup :]

    def summary(self) -> dict[str, float]:
        ms = self.measured
        gen = sum(s.generated for s in ms)
        total_s = sum(s.gen_s for s in ms)
        return {
            "gen_s_mean": float(np.mean([s.gen_s for s in ms])),
            "gen_s_max": float(np.max([s.gen_s for s in ms])),
            "wasted_pct": 100.0 * sum(s.wasted + s.wasted_earlier for s in ms) / gen if gen else 0.0,
            "busy_pct": 100.0 * sum(s.busy_s for s in ms) / (self.num_engines * total_s) if total_s else 0.0,
            "prefill_s_mean": float(np.mean([s.prefill_s for s in ms])),
            "generated_tokens_mean": gen / len(ms),
            "trained_tokens_mean": float(np.mean([s.trained for s in ms])),
            "uninformative_pct": 100.0 * sum(s.uninformative for s in ms) / gen if gen else 0.0,
            "informative_frac": float(np.nanmean([s.informative_frac for s in ms])),
            "in_flight_max": float(np.max([s.in_flight_max for s in ms])),
            "preempted_mean": float(np.mean([s.preempted for s in ms])),
            "wall_s_mean": float(np.mean([s.gen_s for s in ms])) + self.sync_s,
            "groups_generated_mean": float(np.mean([s.groups_generated for s in ms])),
            "skipped_mean": float(np.mean([s.skipped for s in ms])),
            "precision": _nanmean([s.precision for s in ms]),
            "informative_frac_before": _nanmean([s.informative_frac_before for s in ms]),
            "trained_groups": float(sum(s.batch_groups for s in ms)),
        }

    def to_dict(self) -> dict:
        return {
            "row": asdict(self.row),
            "workload": self.workload,
            "warmup": self.warmup,
            "sync_s": self.sync_s,
            "num_engines": self.num_engines,
            "steps": [asdict(s) for s in self.steps],
            "summary": self.summary(),
        }


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not np.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


SYNC_S = 10.0
"""Weight sync between steps (s): 65.5 GB of bf16 weights gathered over NVLink and loaded into each engine,
a few seconds at tens of GB/s; engines are asleep meanwhile, so it only adds to the wall clock."""


def end_step(sched: SamplingScheduler, pool: EnginePool) -> StepResult:
    """Close the scheduler's step: the engines stop (or, continuing, keep) its groups still in flight, the scheduler
    settles them, and the engines keep the paused groups' tokens."""
    stopped = pool.stop(sched.close_step())
    result = sched.settle(stopped)
    pool.settle(stopped, {p.key for p in sched.paused})
    return result


def batch_tokens(batch: list[GroupMeta], workload: Workload) -> float:
    """Tokens a batch trains: every response (all versions) with its prompt."""
    return float(sum(g.tokens + len(g.lengths) * int(workload.prompts[g.index]) for g in batch))


def floor_draws(engine: EngineModel, workload: Workload, *, batch: int, steps: int, seed: int = 42):
    """Per step, `batch` informative groups drawn from `workload`: (engine-seconds of generating them at the floor,
    their tokens with prompts). Engine-seconds: T / max_num_seqs decode steps' overhead and weight read for T tokens
    (not rounded up), every token's context read and compute, each group's prompt prefilled once (the prefix cache
    serves the other samples)."""
    m = engine
    rng = np.random.default_rng([seed, 7])
    for _ in range(steps):
        tokens = ctx_read = prefill = prompts = 0.0
        found = 0
        while found < batch:
            prompt = int(rng.integers(workload.num_prompts))
            lengths, correct, _ = workload.group(prompt, int(rng.integers(2**31)))
            if not 0 < correct.sum() < len(correct):
                continue  # a floor generates informative groups only
            found += 1
            p = float(workload.prompts[prompt])
            tokens += float(lengths.sum())
            ctx_read += float((lengths * p + lengths * (lengths - 1) / 2).sum())
            prefill += p
            prompts += p * len(lengths)
        engine_s = (
            tokens / m.max_num_seqs * (m.overhead_s + m.weight_read_s)
            + ctx_read * m.kv_read_s_per_token
            + tokens * m.compute_s_per_seq
            + prefill * m.prefill_s_per_token
        )
        yield engine_s, tokens + prompts


def floor_seconds(
    engine: EngineModel, workload: Workload, *, batch: int, num_engines: int, steps: int, seed: int = 42
) -> list[float]:
    """Per step, the floor of generating `batch` informative groups drawn from `workload` on num_engines engines
    (module docstring; floor_draws)."""
    return [e / num_engines for e, _ in floor_draws(engine, workload, batch=batch, steps=steps, seed=seed)]


def simulate(
    row: Row,
    engine: EngineModel,
    workload: Workload,
    *,
    num_engines: int = 32,
    steps: int = 12,
    warmup: int = 2,
    seed: int = 42,
    sync_s: float = SYNC_S,
) -> SimResult:
    """Run `warmup + steps` rollout steps of one row with the real SamplingScheduler, as next_batch drives it."""
    if row.oracle != workload.oracle:
        raise ValueError(f"row {row.name!r} needs a workload with oracle={row.oracle}")
    sched = SamplingScheduler(row.sampler, workload.num_prompts, num_engines, group_size=workload.group_size, seed=seed)
    pool = EnginePool(engine, num_engines, workload, row.sampler.tick_steps)
    round_based = row.sampler.mode in ROUND_SAMPLER_MODES
    records = []
    for _ in range(warmup + steps):
        version = sched.version
        pool.begin_version(version)
        for sub in sched.begin_step():
            pool.submit(sub)
        gen_s = busy_s = prefill_s = run_s = 0.0
        ticks = preempted = 0
        pending: list[int] = []  # finished in the previous tick: observed at the end of this one (the loader's lag)
        clock = np.zeros(num_engines)  # fill: each engine's own time in the round (no tick barrier)
        while not sched.step_done:
            for sub in sched.plan():
                pool.submit(sub)
            t = pool.tick(version)
            if t.time_s == 0.0 and not (t.finished or t.running or pending):
                raise RuntimeError(f"{row.name}: the engines are idle but the step is not done (a scheduler stall)")
            if round_based:  # engines run their share of a round without waiting for each other (as the loader)
                clock += t.engine_s
                done = set(pending) | set(t.finished)
                if all(key in done for key in sched.flight):  # the round is over: it took its slowest engine
                    gen_s += float(clock.max())
                    clock[:] = 0.0
            else:  # stream: every tick ends at a barrier, the slowest engine's time
                gen_s += t.time_s
            busy_s += float(t.engine_s.sum())
            prefill_s += float(t.prefill_s.sum())
            run_s += t.running * t.time_s
            ticks += 1
            preempted += t.preempted
            sched.observe(pool.collect(pending), pool.unfinished())
            pending = t.finished
        result = end_step(sched, pool)
        s = result.stats
        records.append(
            StepRecord(
                gen_s=gen_s,
                ticks=ticks,
                generated=s["tokens/generated"],
                trained=s["tokens/trained"],
                wasted=s["tokens/wasted"],
                wasted_earlier=s["tokens/wasted_earlier"],
                uninformative=s["tokens/uninformative"],
                carried=s["tokens/carried"],
                paused=s["tokens/paused"],
                busy_s=busy_s,
                prefill_s=prefill_s / num_engines,
                in_flight_max=s["sampler/in_flight_max"],
                batch_groups=s["sampler/batch_groups"],
                groups_generated=s["sampler/groups_generated"],
                informative_frac=s.get("sampler/informative_frac", float("nan")),
                rounds=s["sampler/gen_rounds"],
                resumed=s["sampler/resumed"],
                stale_dropped=s["sampler/stale_dropped"],
                preempted=preempted,
                length_max=s.get("response/length_max", 0.0),
                mean_running=run_s / (num_engines * gen_s) if gen_s else 0.0,
                skipped=s.get("skip/skipped", 0.0),
                precision=s.get("skip/precision", float("nan")),
                informative_frac_before=s.get(
                    "skip/informative_frac_before", s.get("sampler/informative_frac", float("nan"))
                ),
                train_tokens=batch_tokens(result.batch, workload),
            )
        )
    wl = asdict(workload) | {"beta_a": workload.beta_a, "mu": workload.mu}
    return SimResult(row=row, workload=wl, steps=records, warmup=warmup, sync_s=sync_s, num_engines=num_engines)
