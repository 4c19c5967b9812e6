"""Whole steps in the simulator (megatron_dapo/sampling/sim/pipeline.py, training.py): the training and refit time
against their published sources worked by hand, and the asynchronous pipeline on tiny simulated engines: the trainer's
timeline, admission against untrained batches, groups that keep generating over a batch boundary, the busy floor."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.scheduler import SamplingScheduler
from megatron_dapo.sampling.sim.driver import Row, simulate
from megatron_dapo.sampling.sim.engines import EngineModel
from megatron_dapo.sampling.sim.hardware import QWEN25_32B
from megatron_dapo.sampling.sim.pipeline import async_row, busy_floor_seconds, colocated_step_seconds, simulate_async
from megatron_dapo.sampling.sim.training import TrainModel
from megatron_dapo.sampling.sim.workload import Workload

# 4 engines of 64 sequences (TP 4: 16 GPUs) beside 16 training GPUs; 16 groups of 16 a step, ~300-token responses
BATCH, SEQS, TP = 16, 64, 4
BASE = Row("base", SamplerConfig(train_batch_size=BATCH, gen_batch_size=3 * BATCH, engine_sequences=SEQS, tick_steps=8))


def workload() -> Workload:
    return Workload(p=0.5, mean_len=300.0, max_len=2048, overlong_buffer=512, num_prompts=600)


def engine() -> EngineModel:
    return EngineModel.calibrated(max_num_seqs=SEQS, tp=TP)


def run(eta: int, train: TrainModel, rollout_gpus: int = 16, train_gpus: int = 16, steps: int = 5):
    return simulate_async(
        async_row(BASE, eta), engine(), workload(), train, rollout_gpus=rollout_gpus, train_gpus=train_gpus, steps=steps
    )


def test_training_and_refit_are_their_sources_worked_by_hand():
    t = TrainModel()
    n = QWEN25_32B.params
    assert n == pytest.approx(32.76e9, rel=1e-3)
    # 8N (forward, backward, recomputed forward) + 2N (old logprobs) a token at NeMo AutoModel's 389 TFLOP/s a GPU
    tokens = 512 * 16 * (200 + 4000)
    assert t.train_seconds(tokens, 128) == pytest.approx(10 * n * tokens / (128 * 389e12), rel=1e-12)
    assert 220 < t.train_seconds(tokens, 128) < 232  # SAMPLER_CALIBRATION.md's worked example: 226 s
    # checkpoint-engine's four published updates: 61, 76, 59, 65 GB/s, the median 63 GB/s; 65.5 GB of bf16 weights
    rates = sorted([212e9 / 3.47, 470e9 / 6.22, 671e9 / 11.33, 1.04e12 / 16.04])
    assert (rates[1] + rates[2]) / 2 == pytest.approx(t.refit_bytes_per_s, rel=0.02)
    assert t.refit_seconds == pytest.approx(2 * n / 63e9, rel=1e-12) and 1.0 < t.refit_seconds < 1.1
    half = t.scaled(flops=0.5, refit=2.0)
    assert half.train_seconds(tokens, 128) == pytest.approx(2 * t.train_seconds(tokens, 128))
    assert half.refit_seconds == pytest.approx(t.refit_seconds / 2)


def test_admission_counts_batches_handed_out_and_not_trained():
    """untrained_batches: each one counts as a whole batch started, so at eta = 1 one untrained batch leaves room
    for one batch of starts and two leave none."""
    cfg = replace(BASE.sampler, mode="stream", partial_rollout=True, max_staleness=1, engine_sequences=4096)
    planned = []
    for untrained in (0, 1, 2):
        s = SamplingScheduler(cfg, 600, 4, group_size=16, seed=1)
        s.untrained_batches = untrained
        s.begin_step()
        planned.append(len(s.plan()))
    # (1 + eta) batches ahead at the first step's guessed informative fraction 0.5: 64, then 32 groups, then none
    assert planned == [2 * 2 * BATCH, 2 * BATCH, 0]


def test_the_trainer_timeline_and_what_bounds_the_step():
    t = TrainModel()
    fast = run(2, t.scaled(flops=100.0))  # training is nearly free: generation bounds the step
    for k in range(len(fast.ready)):
        assert fast.train_start[k] >= fast.ready[k]  # a batch is trained once it is full
        if k:
            assert fast.train_start[k] >= fast.refit_end[k - 1]  # and the trainer (and its refit) is free
        assert fast.refit_end[k] >= fast.train_start[k] + t.refit_seconds
    s = fast.summary()
    assert s["trainer_wait_s_mean"] > 0 and s["engine_idle_s"] == 0
    slow = run(1, t.scaled(flops=1e-3))  # training is slow: the engines wait for it at admission
    s = slow.summary()
    assert s["engine_idle_s"] > 0 and s["trainer_wait_s_mean"] == pytest.approx(0.0, abs=1e-9)
    # the step is the trainer's: its training and its refit, nothing hidden
    train_s = [slow.refit_end[k] - slow.train_start[k] for k in range(slow.warmup, len(slow.ready))]
    assert s["step_s"] == pytest.approx(sum(train_s) / len(train_s), rel=1e-9)
    # admission keeps starts within eta batches of training however slow it is: staleness stays small
    assert 1 <= s["staleness_max"] <= 3
    again = run(1, t.scaled(flops=1e-3))
    assert again.refit_end == slow.refit_end and again.staleness == slow.staleness  # deterministic


def test_groups_keep_generating_over_a_batch_boundary():
    """A group still generating when its batch is handed out goes on where it was: it is never re-prefilled, so the
    asynchronous engines prefill less than colocated partial rollout's, which pauses and resumes it."""
    t = TrainModel().scaled(flops=100.0)
    res = run(2, t, steps=4)
    colocated = simulate(async_row(BASE, 2), engine(), workload(), num_engines=4, steps=4)
    assert sum(s.resumed for s in colocated.measured) > 0  # colocated resumes paused groups (and re-prefills them)
    async_busy = sum(res.gen_busy_s)  # busy engine-seconds (prefill included) for the same batches
    colocated_busy = sum(s.busy_s for s in colocated.steps)
    assert async_busy < colocated_busy


def test_the_busy_floor_is_below_every_row():
    """busy_floor_seconds is a floor: no split, eta or colocated sampler beats it on the same 32 GPUs."""
    t = TrainModel()
    floor = busy_floor_seconds(engine(), workload(), t, batch=BATCH, gpus=32, steps=5)
    for eta in (1, 2):
        for r in (8, 16, 24):
            assert run(eta, t, rollout_gpus=r, train_gpus=32 - r).step_seconds() > floor
    for row in (async_row(BASE, 1), Row("fill", replace(BASE.sampler, mode="fill"))):
        res = simulate(row, engine(), workload(), num_engines=32 // TP, steps=5)
        steps = [colocated_step_seconds(s.gen_s, s.train_tokens, t, 32) for s in res.measured]
        assert sum(steps) / len(steps) > floor


def test_bad_async_rows_are_refused():
    with pytest.raises(ValueError, match="stream \\+ partial_rollout"):
        simulate_async(BASE, engine(), workload(), TrainModel(), rollout_gpus=16, train_gpus=16)
    with pytest.raises(ValueError, match="multiple of the engines' tp=4"):
        run(1, TrainModel(), rollout_gpus=10, train_gpus=22)


@pytest.mark.slow  # the tool end to end: make test-fast leaves it out
def test_bench_async_quick(capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_async

    out = bench_async.main(["--quick"])
    (cell,) = out.values()
    assert {"colocated fill drop (verl)", "colocated stream+partial eta=1", "busy floor"} <= set(cell)
    assert all(cell[n]["as written"] > cell["busy floor"]["as written"] for n in cell if n != "busy floor")
    text = capsys.readouterr().out
    assert "best async / busy floor (goal 1.05)" in text and "best async / verl fill drop" in text


def test_without_the_tick_barrier_a_step_is_no_slower():
    """barrier=False (a tick lasts the engines' mean time) bounds a controller without a barrier from below: never
    slower, and faster where generation bounds the step (engines finish their ticks at different times)."""
    t = TrainModel().scaled(flops=100.0)
    with_barrier = run(2, t).step_seconds()
    without = simulate_async(
        async_row(BASE, 2), engine(), workload(), t, rollout_gpus=16, train_gpus=16, steps=5, barrier=False
    ).step_seconds()
    assert without < with_barrier
