"""Prompt memory (sampler.skip): the per-prompt record, the skip policy, and the loader running with it.

The record and the policy are checked against references written out here (lists, the formula
1 - e^z); the loader runs on the scripted engine (tests/scripted_engine.py), whose outcomes the test
knows, with the real reward pool.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scripted_engine import ScriptedEngine, make_dataset
from test_dynamic_sampling import G, loader, same_state, torch_round_trip

from megatron_dapo.config import ConfigError, SamplerConfig, load_config
from megatron_dapo.reward import RewardPool
from megatron_dapo.sampling.prompt_memory import HISTORY, PromptMemory, hash_uniform, persistence


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=1, timeout_s=5.0) as p:
        yield p


# ------------------------------------------------------------------ the record


def test_record_keeps_the_last_visits_and_the_streak(seed):
    rng = random.Random(seed)
    n = 7
    mem = PromptMemory(n, G)
    ref: dict[int, list[tuple[int, int, float]]] = {i: [] for i in range(n)}
    for step in range(200):
        p = rng.randrange(n)
        c = rng.choice([0, 0, 1, 2, G, G, G])
        length = rng.uniform(1, 5000)
        mem.record(p, step, c, length)
        ref[p].append((step, c, length))
    for p in range(n):
        visits = ref[p]
        assert mem.visits[p] == len(visits)
        kept = sorted(zip(mem.step[p], mem.correct[p], mem.length[p]))
        want = sorted(visits[-HISTORY:])
        want += [(-1, -1, 0.0)] * (HISTORY - len(want))
        assert [(s, c) for s, c, _ in kept] == sorted((s, c) for s, c, _ in want)
        assert np.allclose(sorted(x for *_, x in kept), sorted(x for *_, x in want), rtol=1e-6)  # float32
        streak = 0  # the reference: +z after z all-correct in a row, -z after z all-wrong, 0 after informative
        for _, c, _ in visits:
            streak = (
                (streak + 1 if streak > 0 else 1) if c == G else (streak - 1 if streak < 0 else -1) if c == 0 else 0
            )
        assert mem.streak[p] == streak
        assert mem.last(p) == (
            pytest.approx((visits[-1][0], visits[-1][1], visits[-1][2]), rel=1e-6) if visits else None
        )


def test_hash_uniform_is_deterministic_and_uniform(seed):
    u = np.sort([hash_uniform(seed, p, d) for p in range(200) for d in range(50)])
    assert u.min() >= 0 and u.max() < 1
    # Kolmogorov-Smirnov distance to U(0, 1); the DKW inequality P(D > eps) <= 2 exp(-2 n eps^2) makes eps the bound
    # at a false-alarm rate of 1e-6 for truly uniform values (0.027 here: 10,000 values)
    n = len(u)
    ecdf_hi, ecdf_lo = np.arange(1, n + 1) / n, np.arange(n) / n
    distance = max(np.max(ecdf_hi - u), np.max(u - ecdf_lo))
    assert distance < math.sqrt(math.log(2 / 1e-6) / (2 * n))
    assert hash_uniform(seed, 3, 4) == hash_uniform(seed, 3, 4) != hash_uniform(seed, 4, 3)
    assert hash_uniform(seed, 3, 4) != hash_uniform(seed + 1, 3, 4)


@pytest.mark.parametrize("explore, streak", [(0.5, 1), (0.5, 3), (0.9, 2), (0.2, 1)])
def test_skip_probability_is_one_minus_explore_to_the_streak(explore, streak, seed):
    n = 20_000
    mem = PromptMemory(n, G, SamplerConfig(skip=True, skip_max_consecutive=10**4), seed=seed)
    for p in range(n):
        for _ in range(streak):
            mem.record(p, 0, G if p % 2 else 0, 10.0)  # all correct (odd) or all wrong (even): the same streak length
    mem.explore = explore
    decisions = [mem.decide(p) for p in range(n)]
    p_skip = 1 - explore**streak
    rate = np.mean([d.skip for d in decisions])
    # 5.3 binomial standard deviations: a false alarm at a random seed has probability ~1e-7
    assert abs(rate - p_skip) < 5.3 * math.sqrt(p_skip * (1 - p_skip) / n) + 1e-9
    assert all(d.predicted and d.p_generate == pytest.approx(1 - p_skip) for d in decisions)
    assert all(d.tokens == G * 10.0 for d in decisions if d.skip)


def test_no_skipping_without_evidence_or_when_off():
    mem = PromptMemory(3, G, SamplerConfig(skip=True))
    mem.explore = 1e-9
    mem.record(1, 0, 2, 5.0)  # informative: streak 0
    assert not any(mem.decide(p).skip for p in (0, 1) for _ in range(20))
    off = PromptMemory(3, G, SamplerConfig(skip=False))
    off.record(0, 0, G, 5.0)
    off.explore = 1e-9
    assert not any(off.decide(0).skip for _ in range(20))
    assert off.visits[0] == 1  # the record is kept either way


def test_never_skipped_more_than_max_consecutive_times_in_a_row():
    k = 3
    mem = PromptMemory(1, G, SamplerConfig(skip=True, skip_min_explore=1e-6, skip_max_consecutive=k))
    mem.record(0, 0, G, 5.0)
    mem.explore = 1e-6  # every skip that is allowed happens
    skips = [mem.decide(0).skip for _ in range(4 * (k + 1))]
    assert skips == ([True] * k + [False]) * 4
    never = PromptMemory(1, G, SamplerConfig(skip=True, skip_max_consecutive=0))
    never.record(0, 0, 0, 5.0)
    never.explore = 1e-6
    assert not any(never.decide(0).skip for _ in range(10))


def test_exploration_adapts_toward_the_target_within_its_bounds():
    mem = PromptMemory(1, G, SamplerConfig(skip=True, skip_target=0.5, skip_adapt=0.3, skip_min_explore=0.2))
    assert mem.explore == 1.0
    for frac, want in [(0.4, 0.7), (0.1, 0.4), (0.1, 0.2), (0.0, 0.2), (0.6, 0.5), (0.9, 0.8), (0.9, 1.0)]:
        mem.adapt(frac)
        assert mem.explore == pytest.approx(want)


def test_state_round_trip_and_bad_state():
    mem = PromptMemory(5, G, SamplerConfig(skip=True), seed=3)
    for p, c in [(0, G), (1, 0), (0, G), (2, 1)]:
        mem.record(p, 1, c, 3.5)
    mem.explore = 0.35
    mem.decide(0)
    other = PromptMemory(5, G, SamplerConfig(skip=True), seed=3)
    other.load_state_dict(torch_round_trip(mem.state_dict()))
    assert same_state(other.state_dict(), mem.state_dict())
    assert [other.decide(p) for p in range(5)] == [mem.decide(p) for p in range(5)]
    small = PromptMemory(4, G)
    with pytest.raises(ValueError, match=r"prompt memory field 'step' has shape \(5, 4\).*expected \(4, 4\)"):
        small.load_state_dict(mem.state_dict())


def test_config_refuses_skip_where_it_cannot_predict():
    with pytest.raises(ConfigError, match="sampler.skip=True: expected algorithm.dynamic_sampling=true"):
        load_config(overrides=["sampler.skip=true", "algorithm.dynamic_sampling=false"])
    with pytest.raises(ConfigError, match="no sampler.filter"):
        load_config(overrides=["sampler.skip=true", "sampler.filter=my_filters:keep_all"])
    assert load_config(overrides=["sampler.skip=true"]).sampler.skip


# ------------------------------------------------------------------ the loader with skipping


def by_prompt(outcome):
    """A script whose #correct is outcome(prompt, group seed) (the group seed = the sample seed - sample index)."""
    return lambda p, j, seed: (5, j < outcome(p, seed - j))


def run_steps(ds, steps):
    return [ds.next_batch() for _ in range(steps)]


def test_every_prompt_is_generated_within_the_floor_when_everything_is_predicted_uninformative(pool):
    n, k = 24, 2
    informative = set(range(0, n, 4))  # a quarter of the prompts are informative, the rest always all correct
    engine = ScriptedEngine(by_prompt(lambda p, s: 2 if p in informative else G))
    # adapt=1: after the first step the exploration probability sits at its floor: every candidate is skipped
    policy = SamplerConfig(skip=True, skip_target=1.0, skip_adapt=1.0, skip_min_explore=1e-9, skip_max_consecutive=k)
    ds = loader(make_dataset(n), engine, pool, mode="stream", train_batch_size=3, gen_batch_size=4, sampler=policy)
    sched = ds.scheduler
    batches = run_steps(ds, 30)
    epochs = sched.epoch
    assert epochs >= 4 * (k + 1)
    assert sum(b.stats["skip/skipped"] for b in batches) > 0
    assert int(sched.memory.skipped.max()) <= k
    generated = [p for _, p in engine.submitted]
    # each prompt comes up once an epoch (plus requeues): skipped at most k times in a row, so generated at
    # least once in every k + 1 epochs
    for p in range(n):
        assert generated.count(p) >= epochs // (k + 1) - 1, (p, generated.count(p), epochs)
    for b in batches:  # only informative prompts are trained, skipping or not
        assert all(g.index in informative for g in b.groups)


@pytest.mark.parametrize("mode", ["stream", "fill"])
def test_skipping_never_changes_which_groups_count_as_informative(pool, mode, seed):
    rng = random.Random(seed)
    n = 40
    kind = {p: rng.choice(["correct", "wrong", "informative", "flaky"]) for p in range(n)}

    def outcome(p, seed):
        k = kind[p]
        if k == "flaky":
            return G if hash_uniform(7, p, seed) < 0.5 else 1
        return {"correct": G, "wrong": 0, "informative": 2}[k]

    def trained(skip: bool):
        engine = ScriptedEngine(by_prompt(outcome))
        policy = SamplerConfig(skip=skip, skip_target=1.0, skip_adapt=0.5, skip_min_explore=0.05)
        ds = loader(make_dataset(n), engine, pool, mode=mode, train_batch_size=4, gen_batch_size=6, sampler=policy)
        batches = run_steps(ds, 15)
        for b in batches:
            for g in b.groups:  # judged on its own samples, exactly as without skipping
                assert g.informative and 0 < g.num_correct < G
                assert g.num_correct == outcome(g.index, ds.scheduler.group_seed(g.key))
        return ds, batches

    plain, plain_batches = trained(False)
    skipping, skip_batches = trained(True)
    assert sum(b.stats["skip/skipped"] for b in skip_batches) > 0
    assert "skip/skipped" not in plain_batches[-1].stats  # off: no skip metrics
    # the memory's record (kept with or without skipping) saw every observed group
    assert plain.scheduler.memory.visits.sum() == sum(b.stats["sampler/groups_generated"] for b in plain_batches)
    assert skipping.scheduler.memory.visits.sum() == sum(b.stats["sampler/groups_generated"] for b in skip_batches)
    # generation goes to informative prompts: a higher informative fraction of what is generated
    frac = [
        sum(b.stats.get("sampler/informative", 0) for b in bs) / sum(b.stats["sampler/groups_generated"] for b in bs)
        for bs in (plain_batches, skip_batches)
    ]
    assert frac[1] > frac[0]


def test_precision_and_the_horvitz_thompson_estimate_against_references(pool, seed):
    """fill generates every drawn group to its end, so every submission is a visit; the reference walks each prompt's
    visits in order: a visit is an exploration visit when the one before it was uninformative. The before-skipping
    estimate is recomputed from the probabilities the policy gave each generated prompt when it came up."""
    rng = random.Random(seed)
    n = 30
    kind = {p: rng.choice(["correct", "wrong", "informative", "flaky", "flaky"]) for p in range(n)}

    def outcome(p, group_seed):
        k = kind[p]
        if k == "flaky":  # all correct half the time: a prediction from its last visit is often wrong
            return G if hash_uniform(11, p, group_seed) < 0.5 else 1
        return {"correct": G, "wrong": 0, "informative": 2}[k]

    engine = ScriptedEngine(by_prompt(outcome))
    policy = SamplerConfig(skip=True, skip_target=1.0, skip_adapt=0.3, skip_min_explore=0.3, skip_max_consecutive=2)
    ds = loader(make_dataset(n), engine, pool, mode="fill", train_batch_size=3, gen_batch_size=5, sampler=policy)
    memory = ds.scheduler.memory
    decisions = []  # (prompt, Decision) in the order the scheduler asked: the real policy, observed
    decide = memory.decide
    memory.decide = lambda p: decisions.append((p, decide(p))) or decisions[-1][1]
    batches, weighted_apart = [], 0
    for _ in range(25):
        asked, submitted = len(decisions), len(engine.submitted)
        batches.append(b := ds.next_batch())
        generated = [(p, d) for p, d in decisions[asked:] if not d.skip]
        # fill submits each prompt it decided to generate, in order, and observes all of them within the step
        assert [p for p, _ in generated] == [p for _, p in engine.submitted[submitted:]]
        if not generated:
            continue
        outcomes = [outcome(p, ds.scheduler.group_seed(key)) for key, p in engine.submitted[submitted:]]
        informative = [0 < c < G for c in outcomes]
        ht = sum(i / d.p_generate for i, (_, d) in zip(informative, generated)) / sum(
            1 / d.p_generate for _, d in generated
        )
        assert b.stats["skip/informative_frac_before"] == pytest.approx(ht, rel=1e-12)
        assert b.stats["skip/informative_frac_after"] == b.stats["sampler/informative_frac"]
        assert b.stats["sampler/informative_frac"] == pytest.approx(sum(informative) / len(informative), rel=1e-12)
        weighted_apart += abs(ht - sum(informative) / len(informative)) > 1e-3
    assert weighted_apart >= 3  # steps where weighting by 1 / p changes the estimate: the test can tell them apart

    visits = sum(b.stats["skip/explore_visits"] for b in batches)
    uninformative = sum(b.stats.get("skip/precision", 0.0) * b.stats["skip/explore_visits"] for b in batches)
    last: dict[int, bool] = {}  # prompt -> its last visit was uninformative
    want_visits = want_right = 0
    for key, p in engine.submitted:
        c = outcome(p, ds.scheduler.group_seed(key))
        uninf = c in (0, G)
        if last.get(p, False):
            want_visits += 1
            want_right += uninf
        last[p] = uninf
    assert visits == want_visits > 10
    assert uninformative == pytest.approx(want_right)
    assert 0 < want_right < want_visits  # flaky prompts make some predictions wrong: the metric can tell
    assert sum(b.stats["skip/tokens_saved"] for b in batches) == pytest.approx(
        sum(b.stats["skip/skipped"] for b in batches) * G * 5
    )  # every response is 5 tokens here


def test_state_save_restore_continues_exactly(pool):
    def fresh():
        rng_kind = {p: p % 4 for p in range(23)}
        engine = ScriptedEngine(by_prompt(lambda p, s: [G, 0, 2, G if s % 3 else 1][rng_kind[p]]), capacity=8)
        policy = SamplerConfig(skip=True, skip_adapt=0.25)
        return loader(make_dataset(23), engine, pool, mode="stream", train_batch_size=3, gen_batch_size=3, seed=5,
                      sampler=policy)  # fmt: skip

    a = fresh()
    run_steps(a, 8)
    state = torch_round_trip(a.state_dict())
    assert state["scheduler"]["memory"]["visits"].sum() > 0 and state["scheduler"]["memory"]["explore"] < 1

    def rest(ds):
        return [([(g.index, g.acc) for g in b.groups], b.stats) for b in run_steps(ds, 6)]

    want = rest(a)
    assert sum(s["skip/skipped"] for _, s in want) > 0
    b = fresh()
    b.load_state_dict(state)
    got = rest(b)
    assert [x for x, _ in got] == [x for x, _ in want]
    strip = lambda s: {k: v for k, v in s.items() if not k.startswith("timing/")}  # noqa: E731
    assert [strip(s) for _, s in got] == [strip(s) for _, s in want]
    assert same_state(a.state_dict(), b.state_dict())
    assert a.scheduler.digest() == b.scheduler.digest()


def test_persistence_counts_what_followed_each_streak():
    mem = PromptMemory(3, G)
    # prompt 0: correct, correct, informative, correct; prompt 1: wrong, wrong, wrong, wrong, wrong (ring keeps 4)
    for step, c in enumerate([G, G, 2, G]):
        mem.record(0, step, c, 5.0)
    for step, c in enumerate([0, 0, 0, 0, 0]):
        mem.record(1, 10 + step, c, 5.0)
    mem.record(2, 3, 1, 5.0)  # one visit: nothing follows
    table = persistence(mem.state_dict(), G)
    # prompt 0: after (c,1) came c [uninformative]; after (c,2) came informative; after none came c
    # prompt 1 (visits 11..14 kept): after (w,1) w, after (w,2) w, after (w,3) w
    assert table == {
        ("correct", 1): (1, 1),
        ("correct", 2): (1, 0),
        ("none", 0): (1, 1),
        ("wrong", 1): (1, 1),
        ("wrong", 2): (1, 1),
        ("wrong", 3): (1, 1),
    }
    assert persistence(mem.state_dict(), G, since_step=13) == {("wrong", 2): (1, 1), ("wrong", 3): (1, 1)}
