"""The paper-scale sampler simulator (megatron_dapo/sampling/sim/): its time model against formulas worked
by hand, its calibration against its sources, and tiny simulations driven by the real SamplingScheduler."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.sim.calibration import cpu_form_fit, fit_h100_calibration
from megatron_dapo.sampling.sim.driver import Row, floor_seconds, paper_rows, simulate
from megatron_dapo.sampling.sim.engines import EngineModel
from megatron_dapo.sampling.sim.hardware import QWEN25_32B
from megatron_dapo.sampling.sim.workload import Workload, _beta_informative, solve_beta

FATES = ("trained", "uninformative", "wasted", "carried", "paused")

# a tiny setup: 4 engines of 64 sequences, 16 groups of 16 per step, responses ~300 tokens (at most 2048)
ENGINES, BATCH, SEQS = 4, 16, 64


def tiny_workload(**kw) -> Workload:
    kw = {"p": 0.5, "mean_len": 300.0, "max_len": 2048, "overlong_buffer": 512, "num_prompts": 600} | kw
    return Workload(**kw)


def tiny_engine() -> EngineModel:
    return EngineModel.calibrated(max_num_seqs=SEQS)


TINY = SamplerConfig(train_batch_size=BATCH, gen_batch_size=3 * BATCH, engine_sequences=SEQS, tick_steps=8)


def tiny_rows() -> dict[str, Row]:
    return {r.name: r for r in paper_rows(TINY)}


def run(row: Row, workload: Workload, steps: int = 3, warmup: int = 1, **kw):
    return simulate(row, tiny_engine(), workload, num_engines=ENGINES, steps=steps, warmup=warmup, **kw)


def test_step_time_is_the_formula():
    m = EngineModel(overhead_per_layer_s=7e-5, bw_eff=0.8, decode_flop_eff=0.4, prefill_flop_eff=0.5)
    params = 64 * (5120 * 5120 + 2 * 5120 * 1024 + 5120 * 5120 + (5120 + 2 * 1024) + 3 * 5120 * 27648 + 2 * 5120)
    params += 2 * 152064 * 5120 + 5120
    assert QWEN25_32B.params == params and abs(params - 32.8e9) < 0.1e9
    kv = 2 * 64 * 8 * 128 * 2
    for n, ctx in [(1, 300), (37, 91_000), (256, 640_000)]:
        hand = (
            64 * 7e-5
            + 2 * params / (4 * 3.35e12 * 0.8)
            + ctx * kv / (4 * 3.35e12 * 0.8)
            + 2 * params * n / (4 * 989e12 * 0.4)
        )
        assert m.step_time(n, ctx) == pytest.approx(hand, rel=1e-12)
    assert m.step_time(0, 0) == 0.0
    assert m.prefill_s_per_token == pytest.approx(2 * params / (4 * 989e12 * 0.5), rel=1e-12)


def test_kv_capacity_and_concurrency_of_32b_on_h100_tp4():
    m = EngineModel.calibrated()
    weights = 2 * QWEN25_32B.params
    per_gpu = 0.80 * 80e9 - weights / 4 - 3e9  # gpu_memory_utilization 0.80 (verl's recipe), 3 GB reserve
    assert m.kv_capacity_tokens == int(4 * per_gpu // 262_144) == 680_817
    assert m.max_concurrency(20_480 + 300) == 680_817 // 20_780 == 32
    assert m.max_concurrency(2_000) == 256  # max_num_seqs binds


def test_calibration_reproduces_its_sources():
    cal = fit_h100_calibration()
    for p in cal.points:  # three points, three unknowns: an exact fit
        assert cal.predict(p) == pytest.approx(p.step_s, rel=1e-9)
    assert 0 < cal.bw_eff <= 1 and 0 < cal.decode_flop_eff <= 1 and 0 < cal.prefill_flop_eff <= 1
    m = EngineModel.calibrated(cal)
    assert 8e-3 < m.step_time(1, 300) < 12e-3  # one sequence: ~10 ms on a 32B TP=4 engine
    cpu = cpu_form_fit()
    assert cpu["r2"] > 0.999 and cpu["max_abs_residual_s"] < 1e-4


def test_workload_matches_its_targets_and_is_a_function_of_prompt_and_seed():
    for p in (0.1, 0.25, 0.5, 0.8):
        assert _beta_informative(solve_beta(p), 16) == pytest.approx(p, abs=1e-9)
        a = solve_beta(p)  # without truncation: 1 - 2 B(a, a + 16) / B(a, a)
        log_b = (
            math.lgamma(a) + math.lgamma(a + 16) - math.lgamma(2 * a + 16) - (2 * math.lgamma(a) - math.lgamma(2 * a))
        )
        assert 1 - 2 * math.exp(log_b) == pytest.approx(p, abs=1e-9)
    w = Workload(p=0.25, mean_len=4500.0)
    groups = [w.group(i, 1000 + i) for i in range(3000)]
    lengths = np.concatenate([g[0] for g in groups])
    assert lengths.mean() == pytest.approx(4500, rel=0.05) and lengths.max() == 20480
    informative = np.mean([0 < g[1].sum() < 16 for g in groups])
    assert informative == pytest.approx(0.25, abs=0.03)
    assert not any(g[1][g[2]].any() for g in groups)  # truncated responses are wrong
    a, b = w.group(7, 123), w.group(7, 123)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(w.group(7, 123)[0], w.group(7, 456)[0])  # resubmitted: new responses


@pytest.mark.parametrize(
    "name", ["fill drop", "fill carry", "stream", "stream+partial eta=1", "stream+partial drop S=1"]
)
def test_tiny_simulation_is_deterministic_and_its_tokens_add_up(name):
    row = tiny_rows()[name]
    a, b = run(row, tiny_workload()), run(row, tiny_workload())
    assert repr([dataclasses.asdict(s) for s in a.steps]) == repr([dataclasses.asdict(s) for s in b.steps])  # nan
    for s in a.steps:
        assert s.generated == sum(getattr(s, f) for f in FATES)  # every generated token has one fate
        assert s.batch_groups == BATCH and s.gen_s >= 0
    assert sum(s.generated for s in a.steps) > 0
    c = run(row, tiny_workload(), seed=7)
    assert [s.gen_s for s in c.steps] != [s.gen_s for s in a.steps]


def test_one_fill_round_lasts_at_least_its_longest_response():
    # every group informative and one round of exactly the batch: nothing wasted, nothing carried
    row = Row("one round", replace(TINY, mode="fill", carry_surplus=False, gen_batch_size=BATCH), oracle=True)
    res = run(row, tiny_workload(oracle=True), steps=1, warmup=0)
    (s,) = res.steps
    assert s.rounds == 1 and s.wasted == 0 and s.carried == 0 and s.batch_groups == BATCH
    m = tiny_engine()
    # the longest response needs that many decode steps, each at least the overhead and the weight read
    assert s.length_max > 0
    assert s.gen_s >= s.length_max * (m.overhead_s + m.weight_read_s)


def test_stream_with_partial_rollout_wastes_nothing_and_the_drop_rule_does():
    # 16-group steps are short next to the longest responses: admission continues them, the drop rule at 1 drops them
    rows = tiny_rows()
    res = run(rows["stream+partial eta=1"], tiny_workload(), steps=4)
    assert sum(s.wasted + s.wasted_earlier for s in res.measured) == 0  # a started group is never dropped
    assert sum(s.paused for s in res.measured) > 0 and sum(s.resumed for s in res.measured) > 0
    res = run(rows["stream+partial drop S=1"], tiny_workload(), steps=4)
    assert sum(s.wasted + s.wasted_earlier for s in res.measured) > 0


def test_informative_only_trains_a_full_batch_of_informative_groups_every_step():
    res = run(tiny_rows()["informative only"], tiny_workload(oracle=True), steps=3)
    for s in res.steps:
        assert s.batch_groups == BATCH and s.uninformative == 0 and s.informative_frac == 1.0
    with pytest.raises(ValueError, match="oracle=True"):
        run(tiny_rows()["informative only"], tiny_workload())


def test_the_floor_is_below_every_row_and_is_its_formula():
    """floor_seconds: no row on the same engines generates a batch faster, the informative-only row with partial
    rollout and a wide admission included (no tail to wait for); and it is the formula of sim/driver.py worked out
    from the groups it draws."""
    m, w = tiny_engine(), tiny_workload()
    floor = floor_seconds(m, w, batch=BATCH, num_engines=ENGINES, steps=6)
    rows = dict(tiny_rows())
    rows["informative only, partial eta=4"] = Row(
        "x", replace(TINY, mode="stream", partial_rollout=True, max_staleness=4), oracle=True
    )
    for name, row in rows.items():  # per step on average: fill carry serves some steps from earlier ones' surplus
        res = run(row, tiny_workload(oracle=row.oracle), steps=6, warmup=1)
        mean = sum(s.gen_s for s in res.measured) / len(res.measured)
        print(f"{name}: {mean / (sum(floor) / len(floor)):.2f} x the floor")
        assert mean > 1.1 * sum(floor) / len(floor), name
    # the formula, from the same draws (floor_seconds' generator, by its documented seed)
    rng = np.random.default_rng([42, 7])
    found, tokens, ctx, prefill = 0, 0.0, 0.0, 0.0
    while found < BATCH:
        prompt = int(rng.integers(w.num_prompts))
        lengths, correct, _ = w.group(prompt, int(rng.integers(2**31)))
        if correct.any() and not correct.all():
            found += 1
            p = float(w.prompts[prompt])
            tokens += sum(float(x) for x in lengths)
            ctx += sum(float(x) * p + float(x) * (float(x) - 1) / 2 for x in lengths)
            prefill += p
    hand = (tokens / SEQS) * (m.overhead_s + m.weight_read_s) + ctx * m.kv_read_s_per_token
    hand += tokens * m.compute_s_per_seq + prefill * m.prefill_s_per_token
    assert floor[0] == pytest.approx(hand / ENGINES, rel=1e-12)
    assert floor_seconds(m, w, batch=BATCH, num_engines=2 * ENGINES, steps=1)[0] == pytest.approx(floor[0] / 2)


@pytest.mark.slow  # the tool end to end: make test-fast leaves it out
def test_bench_tool_quick(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_sampler

    out = bench_sampler.main(
        ["--part", "sim", "--quick", "--regimes", "late", "--p", "0.5", "--json", str(tmp_path / "sim.json")]
    )
    saved = json.loads((tmp_path / "sim.json").read_text())
    assert saved["settings"]["engines"] == 4 and saved["calibration"]["engine"]["kv_capacity_tokens"] == 680_817
    rows = saved["results"]["late"]["0.5"]
    assert set(rows) == {
        "fill drop",
        "fill carry",
        "stream",
        "stream+partial eta=1",
        "stream+partial eta=2",
        "stream+partial drop S=1",
        "informative only",
        "floor",
    }
    floor = rows.pop("floor")["summary"]
    assert all(len(r["steps"]) == 3 for r in rows.values())  # 1 warm-up + 2 measured
    assert all(r["summary"]["gen_s_mean"] > floor["gen_s_mean"] for r in rows.values())
    assert {g["goal"] for g in out["goals"]} >= {"stream wasted %, late, p=0.5"}
    printed = capsys.readouterr().out
    assert "| fill drop | 0.5 |" in printed and "| floor | 0.5 |" in printed and "NOT paper scale" in printed
