"""Whole steps, generation and training, colocated against asynchronous (issue 27): seconds per step of a batch of
trained groups, on one pool of GPUs.

Colocated (today's trainer): every GPU generates, then the same GPUs compute old logprobs and train, then the
weights are refit into the engines: step = generation (driver.simulate) + train + refit.

Asynchronous (`simulate_async`): `rollout_gpus` run the engines, the other `train_gpus` train. The real
SamplingScheduler runs partial rollout with admission (`max_staleness` = eta) and `untrained_batches` set to the
batches handed out and not trained yet, so starts stay within (1 + eta) batches of what the trainer has consumed. A
group still generating at a batch boundary keeps generating (EnginePool.continuing: no stop, no re-prefill). The
trainer takes batch k when it is full and the trainer is free, trains it (training.py), and the engines stop for
the refit at their first tick after the training ends; the trainer waits for the refit too. When admission holds
every start back and nothing is generating, the engines idle until the next refit. Ticks keep the simulator's
barrier (engines.py), as in the colocated stream rows, unless barrier=False (an optimistic bound without one).

Seconds per step: the trainer's steady rate, (end of the last measured refit - end of the last warm-up refit) /
measured steps. Staleness of a trained group: the batch's index (the weight version that trains it) minus the
weight version the engines had when the group started (its oldest token's version).

Busy floor (`busy_floor_seconds`): the GPU-seconds of generating a batch of informative groups at the generation
floor (driver.floor_seconds: no tail, engines always full) plus those of training it, over all the GPUs: what no
split of the GPUs can beat, whatever the overlap.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_dapo.sampling.scheduler import SamplingScheduler
from megatron_dapo.sampling.sim.driver import Row, batch_tokens, end_step, floor_draws
from megatron_dapo.sampling.sim.engines import EngineModel, EnginePool
from megatron_dapo.sampling.sim.training import TrainModel
from megatron_dapo.sampling.sim.workload import Workload


@dataclass
class AsyncResult:
    """One asynchronous run: per step, when its batch was full, when training started and when its refit ended."""

    row: Row
    rollout_gpus: int
    train_gpus: int
    ready: list[float] = field(default_factory=list)
    train_start: list[float] = field(default_factory=list)
    refit_end: list[float] = field(default_factory=list)
    staleness: list[list[int]] = field(default_factory=list)
    """Per step, each trained group's staleness (weight versions between its start and its training)."""
    engine_idle_s: float = 0.0
    """Seconds the engines spent with nothing to generate (admission waiting for the trainer), over the run."""
    gen_busy_s: list[float] = field(default_factory=list)
    warmup: int = 2

    def step_seconds(self) -> float:
        """The steady rate: measured steps' refit ends over their count."""
        ends = self.refit_end
        return (ends[-1] - ends[self.warmup - 1]) / (len(ends) - self.warmup)

    def summary(self) -> dict[str, float]:
        w = self.warmup
        stale = [s for step in self.staleness[w:] for s in step]
        trainer_wait = [s - e for s, e in zip(self.train_start[w:], self.refit_end[w - 1 : -1])]
        return {
            "step_s": self.step_seconds(),
            "trainer_wait_s_mean": float(np.mean(trainer_wait)),
            "staleness_mean": float(np.mean(stale)) if stale else 0.0,
            "staleness_max": float(max(stale, default=0)),
            "staleness_p99": float(np.percentile(stale, 99)) if stale else 0.0,
            "engine_idle_s": self.engine_idle_s,
        }


def simulate_async(
    row: Row,
    engine: EngineModel,
    workload: Workload,
    train: TrainModel,
    *,
    rollout_gpus: int,
    train_gpus: int,
    steps: int = 12,
    warmup: int = 2,
    seed: int = 42,
    barrier: bool = True,
) -> AsyncResult:
    """`warmup + steps` batches through the asynchronous pipeline (module docstring). row.sampler must be stream
    with partial rollout and admission (drop_stale off): a group is never stopped at a batch boundary.

    barrier=False: a tick lasts the engines' mean time, not the slowest one's, as if no engine ever waited for
    another: an optimistic bound for a controller without a tick barrier (the issue's design)."""
    s = row.sampler
    if not (s.mode == "stream" and s.partial_rollout and not s.drop_stale):
        raise ValueError(f"row {row.name!r}: the asynchronous pipeline runs stream + partial_rollout with admission")
    if rollout_gpus % engine.tp:
        raise ValueError(f"rollout_gpus={rollout_gpus}: expected a multiple of the engines' tp={engine.tp}")
    num_engines = rollout_gpus // engine.tp
    sched = SamplingScheduler(s, workload.num_prompts, num_engines, group_size=workload.group_size, seed=seed)
    pool = EnginePool(engine, num_engines, workload, s.tick_steps)
    pool.continuing = True
    out = AsyncResult(row, rollout_gpus, train_gpus, warmup=warmup)
    clock = trainer_free = 0.0
    trained_at: list[float] = []  # batch j's training ends here; the engines refit at their next tick after it
    applied: list[float] = []  # when the engines took weight version j + 1 (refit done)
    started: dict[int, float] = {}  # group key -> when it was first submitted
    for k in range(warmup + steps):
        pool.begin_version(k)
        for sub in sched.begin_step():
            pool.submit(sub)
        pending: list[int] = []
        busy = 0.0
        while not sched.step_done:
            while len(applied) < len(trained_at) and trained_at[len(applied)] <= clock:
                clock += train.refit_seconds  # the engines stop while their weights are overwritten
                applied.append(clock)
            sched.untrained_batches = k - len(applied)
            for sub in sched.plan():
                started.setdefault(sub.key, clock)
                pool.submit(sub)
            t = pool.tick(k)
            if t.time_s == 0.0 and not (t.finished or t.running or pending):
                if len(applied) == len(trained_at):
                    raise RuntimeError(f"{row.name}: nothing generates, nothing trains (a scheduler stall)")
                out.engine_idle_s += max(0.0, trained_at[len(applied)] - clock)
                clock = max(clock, trained_at[len(applied)])  # admission waits for the trainer
            clock += t.time_s if barrier else float(t.engine_s.mean())
            busy += float(t.engine_s.sum())
            sched.observe(pool.collect(pending), pool.unfinished())
            pending = t.finished
        result = end_step(sched, pool)
        start = max(clock, trainer_free)
        end = start + train.train_seconds(batch_tokens(result.batch, workload), train_gpus)
        trained_at.append(end)
        trainer_free = end + train.refit_seconds
        out.ready.append(clock)
        out.train_start.append(start)
        out.refit_end.append(trainer_free)
        out.gen_busy_s.append(busy)
        # the weight version the engines had when each trained group started; batch k trains at version k
        out.staleness.append([k - bisect.bisect_right(applied, started[g.key]) for g in result.batch])
    return out


def colocated_step_seconds(gen_s: float, tokens: float, train: TrainModel, gpus: int) -> float:
    """A colocated step: generation, then training on every GPU, then the refit."""
    return gen_s + train.train_seconds(tokens, gpus) + train.refit_seconds


def busy_floor_seconds(
    engine: EngineModel, workload: Workload, train: TrainModel, *, batch: int, gpus: int, steps: int, seed: int = 42
) -> float:
    """Mean over steps of (generation GPU-seconds at the floor + training GPU-seconds) / gpus (module docstring)."""
    out = []
    for engine_s, tokens in floor_draws(engine, workload, batch=batch, steps=steps, seed=seed):
        out.append((engine_s * engine.tp + train.train_seconds(tokens, 1)) / gpus)
    return float(np.mean(out))


def async_row(base: Row, eta: int) -> Row:
    """The asynchronous row of a base sampler config: stream + partial rollout admitting eta batches ahead."""
    return Row(f"async eta={eta}", replace(base.sampler, mode="stream", partial_rollout=True, max_staleness=eta))
