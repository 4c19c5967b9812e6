"""The dynamic-sampling loader and its scheduler, driven by a scripted engine whose responses the test sets.

The engine (tests/scripted_engine.py) times responses like continuous batching: one token per step,
so long responses finish late. Responses are real "Answer: N" text scored by the real reward pool.
"""

from __future__ import annotations

import io
import math
import random
import statistics
from collections import Counter

import numpy as np
import pytest
import torch
from scripted_engine import ScriptedEngine, loader_config, make_dataset, make_loader

from megatron_dapo.config import ConfigError, SamplerConfig, load_config
from megatron_dapo.reward import RewardPool
from megatron_dapo.sampling.group_summary import load_group_filter
from megatron_dapo.sampling.loader import DynamicSamplingError, DynamicSamplingLoader
from megatron_dapo.sampling.scheduler import SamplingScheduler

G = 4


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=1, timeout_s=5.0) as p:
        yield p


def loader(dataset, engine, pool, **kw):
    """A loader over `engine` (or {id: engine}) with the config's fields named in kw (scripted_engine.loader_config):
    groups of G, responses up to 100 tokens with a 20-token overlong buffer, ticks of 2 steps, fill by default."""
    kw = {"group_size": G, "max_response_length": 100, "overlong_buffer_len": 20, "tick_steps": 2, "mode": "fill"} | kw
    engines = engine if isinstance(engine, dict) else {0: engine}
    return make_loader(loader_config(**kw), dataset, engines, pool, num_engines=len(engines))


def correct_first(num_correct, length=lambda p, j: 5):
    """A script: prompt p's first num_correct(p) samples are right, the rest wrong; lengths from `length`."""
    return lambda p, j, seed: (length(p, j), j < num_correct(p))


def torch_round_trip(state):
    """Through torch.save and the restricted reader, as checkpoint.py writes and reads a rank's state (plain
    containers, numpy arrays)."""
    from megatron_dapo.convert.resolve import read_rank_state

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return read_rank_state(buf)


def same_state(x, y) -> bool:
    """Equal nested containers, numpy arrays compared by dtype and value."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same_state(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_state(a, b) for a, b in zip(x, y))
    return x == y


def drawn(engine) -> list[int]:
    return [p for _, p in engine.submitted]


# ------------------------------------------------------------------ fill (verl's recipe, with carry-over)


def test_exact_batch_and_statistics(pool, seed):
    rng = random.Random(seed)
    correct = {i: rng.choice([0, 0, 1, 2, 3, G, G]) for i in range(60)}
    engine = ScriptedEngine(correct_first(lambda i: correct[i]))
    ds = loader(
        make_dataset(60),
        engine,
        pool,
        train_batch_size=5,
        gen_batch_size=8,
        max_gen_batches=0,
        seed=rng.randrange(1000),
    )
    batch = ds.next_batch()
    order = drawn(engine)
    informative = [i for i in order if 0 < correct[i] < G]
    assert len(batch.groups) == 5
    assert [g.index for g in batch.groups] == informative[:5]
    assert [g.index for g in ds.scheduler.carry] == informative[5:]
    for g in batch.groups:
        assert g.num_correct == correct[g.index]
        assert g.scores == [1.0] * g.num_correct + [-1.0] * (G - g.num_correct)
        assert batch.local[g.key][0].text.endswith(f"Answer: {g.index * 7}")  # this rank's own responses
    s = batch.stats
    assert s["sampler/gen_rounds"] == len(order) // 8
    assert s["sampler/groups_generated"] == len(order)
    assert s["sampler/informative"] == len(informative)
    assert s["sampler/informative_frac"] == pytest.approx(len(informative) / len(order))
    assert s["sampler/all_correct"] == sum(correct[i] == G for i in order)
    assert s["sampler/all_wrong"] == sum(correct[i] == 0 for i in order)
    assert s["reward/acc"] == pytest.approx(sum(correct[i] for i in order) / (G * len(order)))
    assert s["sampler/carried_out"] == len(informative) - 5
    # every generated token has one fate
    fates = ("trained", "uninformative", "wasted", "carried", "paused")
    assert s["tokens/generated"] == sum(s[f"tokens/{f}"] for f in fates) == 5 * G * len(order)


def test_surplus_is_carried_over_and_nothing_is_lost(pool):
    engine = ScriptedEngine(correct_first(lambda i: 1 + i % 3))  # every group informative
    ds = loader(make_dataset(100), engine, pool, train_batch_size=5, gen_batch_size=3)
    first = ds.next_batch()  # rounds of 3: 6 collected, 1 carried
    assert len(first.groups) == 5 and len(ds.scheduler.carry) == 1
    carried = ds.scheduler.carry[0]
    second = ds.next_batch()
    assert second.groups[0].key == carried.key and second.stats["sampler/carried_in"] == 1
    assert second.local[carried.key] and second.stats["staleness/tokens_1"] == carried.tokens  # trained 1 version on
    trained = [g.index for b in (first, second) for g in b.groups] + [g.index for g in ds.scheduler.carry]
    assert trained == drawn(engine)  # every informative group, once, in order


def test_fill_can_drop_the_surplus_as_verl_does(pool):
    engine = ScriptedEngine(correct_first(lambda i: 1 + i % 3))
    ds = loader(make_dataset(100), engine, pool, train_batch_size=5, gen_batch_size=3, carry_surplus=False)
    first = ds.next_batch()
    assert len(first.groups) == 5 and ds.scheduler.carry == [] and first.stats["tokens/wasted"] == 5 * G
    second = ds.next_batch()
    assert drawn(engine)[6:8] == [g.index for g in second.groups[:2]]  # the dropped prompt is not tried again


def test_step_served_from_the_carry_reports_no_rollout_rates(pool):
    engine = ScriptedEngine(correct_first(lambda i: 1 + i % 3))  # every group informative
    ds = loader(make_dataset(100), engine, pool, train_batch_size=2, gen_batch_size=4)
    ds.next_batch()  # 4 generated, 2 trained, 2 carried
    submitted = len(engine.submitted)
    second = ds.next_batch()
    assert len(engine.submitted) == submitted and len(second.groups) == 2
    s = second.stats
    assert s["sampler/gen_rounds"] == 0 and s["sampler/carried_in"] == 2 and s["sampler/batch_groups"] == 2
    # no fresh responses: rates are absent, never a 0 that reads as a collapse
    for key in ("reward/mean", "reward/acc", "sampler/informative_frac", "response/length_mean"):
        assert key not in s


def test_cap_error_reports_what_was_found(pool):
    engine = ScriptedEngine(correct_first(lambda i: 2 if i in (3, 11) else 0))
    ds = loader(make_dataset(50), engine, pool, train_batch_size=4, gen_batch_size=5, max_gen_batches=3, shuffle=False)
    with pytest.raises(DynamicSamplingError) as e:
        ds.next_batch()
    msg = str(e.value)
    assert len(engine.submitted) == 15
    assert "after 3 generation rounds (sampler.max_gen_batches=3)" in msg
    assert "only 2 of sampler.train_batch_size=4 informative groups were found" in msg
    assert "2 of 15 groups generated this step were informative, fraction 0.133" in msg
    assert "13 all wrong" in msg
    assert [g.index for g in ds.scheduler.carry] == [3, 11]  # kept, not thrown away
    assert set(ds.finished) == {g.key for g in ds.scheduler.carry}  # and so are their responses


def test_all_wrong_group_with_different_shaped_rewards_is_not_informative(pool):
    # L_max 100, buffer 20: lengths 80 (no penalty), 85, 90, 100 (full penalty) shape the -1 scores apart
    lengths = [80, 85, 90, 100]
    engine = ScriptedEngine(correct_first(lambda i: 0 if i == 0 else 1, length=lambda i, j: lengths[j]))
    ds = loader(make_dataset(2), engine, pool, train_batch_size=1, gen_batch_size=2, shuffle=False)
    batch = ds.next_batch()
    assert [g.index for g in batch.groups] == [1]
    assert batch.stats["sampler/all_wrong"] == 1 and batch.stats["sampler/informative"] == 1
    # the shaped rewards of the accepted group: score + ((L_max - L_cache) - |o|) / L_cache, floored at -1
    assert batch.groups[0].rewards == pytest.approx([1.0, -1.25, -1.5, -2.0])
    assert batch.groups[0].scores == [1.0, -1.0, -1.0, -1.0]
    assert batch.groups[0].truncated == [False, False, False, True]


def test_epoch_wrap_reshuffles_without_repeats_or_skips(pool):
    n = 10
    engine = ScriptedEngine(correct_first(lambda i: 2))
    ds = loader(make_dataset(n), engine, pool, train_batch_size=4, gen_batch_size=4)
    for _ in range(5):
        ds.next_batch()
    order = drawn(engine)
    assert len(order) == 20
    assert sorted(order[:10]) == list(range(n)) and sorted(order[10:]) == list(range(n))
    assert order[:10] != order[10:]  # a new permutation per epoch
    assert ds.scheduler.epoch == 2


@pytest.mark.parametrize("mode", ["fill", "stream", "partial"])
def test_no_prompt_twice_in_a_step_and_none_skipped_or_repeated(pool, mode):
    n = 7  # 4 groups a step: the epoch ends mid-step, every other step
    engine = ScriptedEngine(correct_first(lambda i: 2, length=lambda i, j: 1 + (i * 5 + j) % 9), capacity=6)
    kw = {"partial_rollout": True, "mode": "stream"} if mode == "partial" else {"mode": mode}
    ds = loader(make_dataset(n), engine, pool, train_batch_size=4, gen_batch_size=3, shuffle=False, **kw)
    trained = []
    for _ in range(8):
        batch = ds.next_batch()
        assert len({g.index for g in batch.groups}) == len(batch.groups) == 4
        in_flight = [f.index for f in ds.scheduler.flight.values()] + [p.index for p in ds.scheduler.paused]
        carried = [g.index for g in ds.scheduler.carry]
        assert len(set(in_flight + carried)) == len(in_flight) + len(carried)
        trained += [g.index for g in batch.groups]
    if mode == "partial":  # accepted as they complete: in any order, but each prompt as often as any other
        later = [p.index for p in ds.scheduler.paused] + [g.index for g in ds.scheduler.carry]
        counts = Counter(trained + later)
        assert max(counts.values()) - min(counts.values()) <= 1
    else:  # every prompt once per epoch, in queue order, aborted ones tried again first
        assert trained == [i % n for i in range(32)]


def test_dataset_smaller_than_a_step_is_a_clear_error(pool):
    ds = loader(make_dataset(3), ScriptedEngine(correct_first(lambda i: 2)), pool, train_batch_size=4, gen_batch_size=2)
    with pytest.raises(
        DynamicSamplingError, match="after every one of the 3 prompts was tried in this step, only 3 of"
    ):
        ds.next_batch()


@pytest.mark.parametrize("mode", ["fill", "stream", "partial"])
def test_state_save_restore_mid_epoch(pool, mode):
    kw = {"partial_rollout": True, "mode": "stream"} if mode == "partial" else {"mode": mode}

    def fresh():
        script = correct_first(lambda i: [0, 1, 2, 4][i % 4], length=lambda i, j: 1 + (i * 7 + j * 3) % 13)
        engine = ScriptedEngine(script, capacity=8)
        return loader(make_dataset(23), engine, pool, train_batch_size=4, gen_batch_size=3, seed=7, **kw), engine

    a, _ = fresh()
    for _ in range(3):
        a.next_batch()
    state = torch_round_trip(a.state_dict())  # as a checkpoint stores it
    sched = state["scheduler"]
    assert 0 < len(sched["queue"]) < 23 * 2
    if mode == "partial":
        assert sched["paused"] and state["partial"]  # groups in flight at the step's end continue later
    elif mode == "fill":
        assert sched["carry"] and state["finished"]

    def run(ld):
        return [
            [(g.index, g.lengths, g.acc, g.version_tokens, [r.token_ids for r in b.local[g.key]]) for g in b.groups]
            for b in (ld.next_batch() for _ in range(4))
        ]

    rest_a = run(a)
    b, _ = fresh()
    b.load_state_dict(state)
    assert run(b) == rest_a
    assert same_state(a.state_dict(), b.state_dict())

    other = loader(make_dataset(24), ScriptedEngine(lambda p, j, s: (3, True)), pool, seed=7, **kw)
    with pytest.raises(ValueError, match="dataset of 23 prompts, but this dataset has 24"):
        other.load_state_dict(state)
    mismatched = fresh()[0]
    state["finished"], state["partial"] = {}, {}
    if sched["carry"] or sched["paused"]:
        with pytest.raises(ValueError, match="do not belong together"):
            mismatched.load_state_dict(state)


def test_a_state_merged_over_ranks_loads_as_each_rank_s_share(pool):
    """The asynchronous rollout side's ranks each hold their own engine's groups; the state the controller hands the
    train side is their merge (the shape of one rank's), and each rank loading it keeps exactly its own share: the shares
    merge back into the whole, and resumed they take the steps the uninterrupted loader takes."""
    script = correct_first(lambda i: [0, 1, 2, 4][i % 4], length=lambda i, j: 1 + (i * 7 + j * 3) % 13)
    kw = dict(partial_rollout=True, mode="stream", train_batch_size=4, gen_batch_size=3, seed=7)

    def two_engines(owned=None):
        engines = {0: ScriptedEngine(script, capacity=4), 1: ScriptedEngine(script, capacity=4)}
        cfg = loader_config(group_size=G, max_response_length=100, overlong_buffer_len=20, tick_steps=2, **kw)
        return make_loader(cfg, make_dataset(23), engines, pool, num_engines=2, owned=owned)

    whole = two_engines()
    for _ in range(3):
        whole.next_batch()
    state = torch_round_trip(whole.state_dict())
    held = {e: {p["key"] for p in state["scheduler"]["paused"] if p["engine"] == e} for e in (0, 1)}
    assert held[0] and held[1]  # each engine has groups in flight at the step's end
    shares = []
    for e in (0, 1):
        rank = two_engines(owned={e})
        rank.load_state_dict(state)
        assert set(rank.partial) == held[e]  # its own groups, not the other rank's
        shares.append(rank.state_dict())
    assert same_state(DynamicSamplingLoader.merge_states(shares), state)
    resumed = two_engines()
    resumed.load_state_dict(DynamicSamplingLoader.merge_states(shares))
    a, b = whole.next_batch(), resumed.next_batch()
    assert [(g.index, g.lengths, g.version_tokens) for g in a.groups] == [
        (g.index, g.lengths, g.version_tokens) for g in b.groups
    ]


def test_dynamic_bs_trains_on_one_round(pool):
    correct = {i: [0, 2, G][i % 3] for i in range(30)}
    engine = ScriptedEngine(correct_first(lambda i: correct[i]))
    ds = loader(make_dataset(30), engine, pool, mode="dynamic_bs", train_batch_size=7, gen_batch_size=100)
    batch = ds.next_batch()
    assert len(engine.submitted) == 7
    assert [g.index for g in batch.groups] == [i for i in drawn(engine) if correct[i] == 2]
    assert ds.scheduler.carry == []


def test_user_filter_and_no_dynamic_sampling(pool, tmp_path, monkeypatch):
    correct = {i: [0, 2, G][i % 3] for i in range(30)}
    engine = ScriptedEngine(correct_first(lambda i: correct[i]))
    # a user's filter (sampler.filter): keep every group with a right answer, all-correct ones included
    (tmp_path / "solved_filter.py").write_text(
        "seen = []\n\n\ndef solved(group):\n"
        "    seen.append((group.prompt.index, list(group.scores), list(group.rewards)))\n"
        "    return group.num_correct > 0 and group.rewards[0] == 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import solved_filter

    seen = solved_filter.seen
    ds = loader(make_dataset(30), engine, pool, train_batch_size=6, gen_batch_size=6, filter="solved_filter:solved")
    batch = ds.next_batch()
    # exactly the filter's choice, in draw order: the default informative test (0 < correct < G) would drop the
    # all-correct groups and keep fewer of these
    assert [g.index for g in batch.groups] == [i for i in drawn(engine) if correct[i] > 0][:6]
    assert any(g.num_correct == G for g in batch.groups)
    # the filter judged every generated group once, after scoring and shaping
    assert sorted(i for i, _, _ in seen) == sorted(drawn(engine))
    assert all(scores == [1.0] * correct[i] + [-1.0] * (G - correct[i]) == rewards for i, scores, rewards in seen)
    ds = loader(
        make_dataset(30),
        ScriptedEngine(correct_first(lambda i: correct[i])),
        pool,
        train_batch_size=6,
        gen_batch_size=6,
        dynamic_sampling=False,
    )
    batch = ds.next_batch()
    assert len(batch.groups) == 6 and batch.stats["sampler/gen_rounds"] == 1


def test_the_config_reaches_the_loader_and_bad_engines(pool, tmp_path, monkeypatch):
    cfg = load_config(
        overrides=[
            "algorithm.group_size=4",
            "sampler.train_batch_size=2",
            "sampler.gen_batch_size=2",
            "optim.mini_batch_size=8",
        ]
    )
    ds = make_loader(cfg, make_dataset(4), {0: ScriptedEngine(lambda p, j, s: (3, j < 2))}, pool)
    assert (ds.group_size, ds.scheduler.cfg.train_batch_size, ds.max_response_length) == (4, 2, 20480)
    assert ds.scheduler.cfg.mode == "stream"  # the default
    assert len(ds.next_batch().groups) == 2

    class Short(ScriptedEngine):
        def step(self):
            return [(key, responses[:-1]) for key, responses in super().step()]

    with pytest.raises(RuntimeError, match="returned 3 responses for group .*, expected algorithm.group_size=4"):
        loader(make_dataset(4), Short(lambda p, j, s: (2, True)), pool).next_batch()
    with pytest.raises(ValueError, match="empty"):
        loader([], ScriptedEngine(lambda p, j, s: (2, True)), pool)

    # sampler.filter: checked when the loader is built from the config, naming the field
    (tmp_path / "my_filters.py").write_text("def keep_all(group):\n    return True\nnot_callable = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_group_filter("my_filters:keep_all")(None) is True
    # the config's filter reaches the loader: every group all wrong, so only keep_all can fill the batch
    kept = make_loader(
        load_config(overrides=[*cfg_overrides(), "sampler.filter=my_filters:keep_all", "sampler.max_gen_batches=1"]),
        make_dataset(4),
        {0: ScriptedEngine(lambda p, j, s: (3, False))},
        pool,
    ).next_batch()
    assert len(kept.groups) == 2 and all(g.num_correct == 0 for g in kept.groups)
    for spec, why in [
        ("my_filters", "expected 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("my_filters:missing", "has no function 'missing'"),
        ("my_filters:not_callable", "has no function 'not_callable'"),
    ]:
        bad = load_config(overrides=[*cfg_overrides(), f"sampler.filter={spec}"])
        with pytest.raises(ConfigError, match=f"sampler.filter=.*{why}"):
            make_loader(bad, make_dataset(4), {0: ScriptedEngine(lambda p, j, s: (3, True))}, pool)


def cfg_overrides():
    return ["algorithm.group_size=4", "sampler.train_batch_size=2", "optim.mini_batch_size=8"]


# ------------------------------------------------------------------ stream


def test_stream_takes_the_groups_fill_takes_and_measures_the_same_fraction(pool):
    rng = random.Random(1126)  # fixed: the fractions below are estimates from ~180 groups, checked at this seed
    correct = {i: rng.choice([0, 1, 2, 3, G]) for i in range(400)}
    lengths = {(i, j): rng.randint(1, 40) for i in range(400) for j in range(G)}
    script = correct_first(lambda i: correct[i], length=lambda i, j: lengths[(i, j)])
    truth = sum(0 < c < G for c in correct.values()) / len(correct)
    seed = rng.randrange(1000)
    runs = {}
    for mode in ("fill", "stream"):
        engine = ScriptedEngine(script, capacity=24)
        ds = loader(make_dataset(400), engine, pool, mode=mode, train_batch_size=8, gen_batch_size=16, seed=seed)
        runs[mode] = [ds.next_batch() for _ in range(12)]
    fill, stream = runs["fill"], runs["stream"]
    # the first step: the same prompts, in the same order, with the same responses (the first 8 informative ones)
    assert [(g.index, g.lengths, g.rewards) for g in stream[0].groups] == [
        (g.index, g.lengths, g.rewards) for g in fill[0].groups
    ]
    for b in stream:
        assert len(b.groups) == 8 and b.stats["sampler/gen_rounds"] == 0
        assert b.stats["tokens/generated"] == sum(
            b.stats[f"tokens/{f}"] for f in ("trained", "uninformative", "wasted", "carried", "paused")
        )
    measured = {
        m: sum(b.stats.get("sampler/informative", 0) for b in r) / sum(b.stats["sampler/groups_generated"] for b in r)
        for m, r in runs.items()
    }
    assert measured["stream"] == pytest.approx(truth, abs=0.1) and measured["fill"] == pytest.approx(truth, abs=0.1)
    # the running estimate the in-flight count is sized by tracks what those steps measured (one step's is noisy at
    # 8 groups: averaged; against the population's fraction it would also carry the steps' sampling noise)
    est = statistics.mean(b.stats["sampler/informative_frac_estimate"] for b in stream[4:])
    seen = sum(b.stats.get("sampler/informative", 0) for b in stream[3:]) / sum(
        b.stats["sampler/groups_generated"] for b in stream[3:]
    )
    assert est == pytest.approx(seen, abs=0.07)


def test_aborted_groups_return_to_the_head_of_the_queue(pool):
    # long responses, few engine slots: when the batch is full several groups are mid-generation
    engine = ScriptedEngine(correct_first(lambda i: 1 + i % 3, length=lambda i, j: 3 + (i * 11 + j) % 17), capacity=8)
    ds = loader(make_dataset(40), engine, pool, mode="stream", train_batch_size=3, shuffle=False, carry_surplus=False)
    first = ds.next_batch()
    s = first.stats
    assert s["sampler/requeued"] > 0 and s["tokens/wasted"] > 0
    trained = [g.index for g in first.groups]
    submitted = drawn(engine)
    aborted = [p for p in submitted if p not in trained]
    assert ds.scheduler.queue[: len(aborted)] == aborted  # back at the head, in submission order
    second = ds.next_batch()
    again = drawn(engine)[len(submitted) :]
    assert again[: len(aborted)] == aborted  # tried first in the next step
    batches = [first, second] + [ds.next_batch() for _ in range(12)]
    for b in batches:  # on-policy stream never carries: a finished group behind the batch would be a short one
        assert b.stats["sampler/carried_out"] == 0
    # over 14 steps (one epoch and a bit): every prompt trained once per epoch in queue order, none skipped, none
    # repeated, however often it was aborted on the way
    assert [g.index for b in batches for g in b.groups] == [i % 40 for i in range(3 * 14)]


def test_stream_needs_fewer_groups_in_flight_as_the_batch_fills(pool):
    sampler = SamplerConfig(train_batch_size=64, mode="stream", engine_sequences=10_000)
    sched = SamplingScheduler(sampler, 1000, 1, group_size=G)
    sched.begin_step()
    first = sched.plan()
    # at the first step's guess p = 0.5: enough for 64 with one binomial sigma to spare, not the whole cap
    assert 128 < len(first) < 160
    assert sched.plan() == []  # nothing more until something is observed


# ------------------------------------------------------------------ length bias


class FirstFinished(SamplingScheduler):
    """The naive rule this project does not use: accept groups in completion order, abort the rest when full."""

    def close_step(self):
        stop = super().close_step()
        self._step.stopping = {key: False for key in stop}
        return dict(self._step.stopping)


def long_tailed(p: int, j: int, seed: int) -> tuple[int, bool]:
    """Lengths from a long tail (2..80 tokens, mean ~20) drawn from the sample's seed (a resubmitted prompt gets new
    ones, as from a real engine); long answers are wrong more often (30% right vs 70%)."""
    r = random.Random(seed * 7919 + p)
    length = min(80, int(r.expovariate(1 / 20)) + 2)
    return length, r.random() < (0.7 if length < 20 else 0.3)


class FixedWeights:
    """A TickDriver whose engines hold weights `version` throughout the step."""

    def __init__(self, version: int) -> None:
        self.version = version

    def weights(self) -> int:
        return self.version

    def between_ticks(self) -> None:
        pass


def lagging_weights(ds, eta: int, train_ticks: int = 3):
    """Drive `ds` as the rollout controller does at eta (pipeline.mode=async), deterministically: batch k is collected
    while the batches before it train, starting with the weights of version k - eta (the slowest trainer admission
    allows), and each later update lands train_ticks ticks after the one before; admission counts the batches
    handed out and not trained (untrained_batches). Returns next_batch()."""
    ticks = [0]

    class Lagging:  # the loader's TickDriver
        @staticmethod
        def weights() -> int:
            k = ds.version
            return min(k, max(0, k - eta + ticks[0] // train_ticks))

        @staticmethod
        def between_ticks() -> None:
            ticks[0] += 1

    def next_batch():
        ticks[0] = 0
        return ds.next_batch(Lagging)

    return next_batch


def _trained_lengths(
    pool, mode: str, seed: int, steps: int = 80, scheduler=None, batch: int = 6, async_eta=None, **kw
) -> list[int]:
    """The response length of every sample of every group trained in `steps` steps of 6 groups (engines run every
    group at once; partial rollout keeps 12 groups generating). kw: sampler fields (max_staleness, drop_stale).
    async_eta: collected as the asynchronous controller does at that eta (lagging_weights)."""
    kw = {"mode": mode, "seed": seed} | kw
    if mode == "partial":
        kw |= {"mode": "stream", "partial_rollout": True, "engine_sequences": 12 * G}
    if async_eta is not None:
        kw["max_staleness"] = async_eta
    ds = loader(
        make_dataset(3000), ScriptedEngine(long_tailed), pool, train_batch_size=batch, gen_batch_size=2 * batch, **kw
    )
    if scheduler is not None:
        ds.scheduler = scheduler(ds.scheduler.cfg, 3000, 1, group_size=G, seed=seed)
    next_batch = ds.next_batch if async_eta is None else lagging_weights(ds, async_eta)
    return [n for _ in range(steps) for g in next_batch().groups for n in g.lengths]


def test_no_length_bias_trained_lengths_are_distributed_as_fill_s(pool, seed):
    """Over 80 steps of 6 groups (1920 responses each): fill sees every round to its end, so its trained responses
    are the unbiased reference, and stream and partial rollout at the default eta = 1 must be drawn from the same
    length distribution (two-sample Kolmogorov-Smirnov), as must partial rollout collected as the asynchronous
    controller collects it at eta = 1 and 2 (lagging_weights). Negative controls, which the same test must reject:
    the old drop rule at max_staleness=1 (it drops the longest groups) and first-finished-with-abort (which
    re-samples a long group until it comes out short)."""
    from scipy.stats import ks_2samp

    fill = _trained_lengths(pool, "fill", seed)
    stream = _trained_lengths(pool, "stream", seed)
    assert stream[: 6 * G] == fill[: 6 * G]  # the same first batch, exactly
    runs = {
        "stream": stream,
        "partial eta=1": _trained_lengths(pool, "partial", seed),
        "async eta=1": _trained_lengths(pool, "partial", seed, async_eta=1),
        "async eta=2": _trained_lengths(pool, "partial", seed, async_eta=2),
        "drop_stale 1": _trained_lengths(pool, "partial", seed, drop_stale=True),
        "first_finished": _trained_lengths(pool, "partial", seed, scheduler=FirstFinished),
    }
    p = {name: ks_2samp(fill, lengths).pvalue for name, lengths in runs.items()}
    mean = {name: statistics.mean(lengths) for name, lengths in runs.items()} | {"fill": statistics.mean(fill)}
    print("KS p against fill:", {k: f"{v:.2g}" for k, v in p.items()})
    print("mean trained response length:", {k: round(v, 1) for k, v in mean.items()})
    assert 17 < mean["fill"] < 26
    # equal distributions: p is uniform, so 1e-5 fails a correct sampler once in 1e5 runs; the controls measure
    # 1e-13 to 1e-22 (seeds 1-3, 11-13)
    for name in ("stream", "partial eta=1", "async eta=1", "async eta=2"):
        assert p[name] > 1e-5, (name, p, mean)
    for name in ("drop_stale 1", "first_finished"):
        assert p[name] < 1e-8 and mean[name] < mean["fill"] - 2, (name, p, mean)


def _long_groups(pool, **kw):
    """(engine, loader) of partial rollout in steps of 4 groups over prompts whose every fifth group is 90 tokens
    long (the rest 2-5): those outlive several steps. kw: more sampler fields."""
    script = correct_first(lambda i: 1 + i % 3, length=lambda i, j: 90 if i % 5 == 0 else 2 + j)
    engine = ScriptedEngine(script, capacity=12)
    kw = (
        dict(mode="stream", partial_rollout=True, train_batch_size=4, engine_sequences=6 * G, max_response_length=120)
        | kw
    )
    return engine, loader(make_dataset(100), engine, pool, **kw)


def _lost_prompts(engine, ds, kept: set[int]) -> list[tuple[int, int]]:
    """(key, prompt) of each submitted group not in kept whose prompt never comes back: neither submitted again later
    nor queued (the epoch would lose it)."""
    submitted = engine.submitted
    return [
        (key, p)
        for n, (key, p) in enumerate(submitted)
        if key not in kept and p not in [q for _, q in submitted[n + 1 :]] + ds.scheduler.queue
    ]


def test_staleness_bound_holds_and_drops_what_would_exceed_it(pool):
    """sampler.drop_stale (the rule before admission): every trained token at most max_staleness old, the groups
    that cannot make it dropped and their prompts requeued."""
    # a few very long groups: they cannot finish within the one extra step that max_staleness=1 allows
    engine, ds = _long_groups(pool, max_staleness=1, drop_stale=True)
    dropped = 0
    trained = set()
    for _ in range(12):
        b = ds.next_batch()
        v = ds.version - 1  # the version this batch is trained at
        for g in b.groups:
            for r in b.local[g.key]:
                assert all(0 <= v - x <= 1 for x in r.versions)  # every trained token at most 1 version old
        assert {k for k in b.stats if k.startswith("staleness/tokens_")} == {"staleness/tokens_0", "staleness/tokens_1"}
        assert b.stats["staleness/tokens_0"] + b.stats["staleness/tokens_1"] == sum(g.tokens for g in b.groups)
        assert b.stats["staleness/max"] <= 1
        dropped += b.stats["tokens/wasted"] + b.stats["tokens/wasted_earlier"]
        trained |= {g.key for g in b.groups}
    assert dropped > 0  # the 90-token groups were dropped, not trained stale
    # every group is informative here, so a group neither trained nor still paused was dropped by the bound (or
    # never started): its prompt must come back (submitted again later, or queued), or the epoch would lose it
    kept = trained | {p.key for p in ds.scheduler.paused}
    assert any(p % 5 == 0 for key, p in engine.submitted if key not in kept)  # the 90-token ones among them
    assert not _lost_prompts(engine, ds, kept)


def test_admission_never_drops_a_started_group_and_reports_its_staleness(pool):
    """The default: the same long groups as above are continued under each new version until they finish and are
    trained, nothing generated is thrown away, and the staleness metrics say how old the trained tokens were."""
    engine, ds = _long_groups(pool)
    trained, oldest = {}, 0
    for _ in range(12):
        b = ds.next_batch()
        v = ds.version - 1
        assert b.stats["tokens/wasted"] == b.stats["tokens/wasted_earlier"] == 0
        ages = [v - x for g in b.groups for r in b.local[g.key] for x in r.versions]
        hist = Counter(ages)
        assert b.stats["staleness/max"] == max(ages)
        assert all(b.stats[f"staleness/tokens_{k}"] == hist[k] for k in range(max(ages) + 1))
        ranked = sorted(ages)
        assert b.stats["staleness/p99"] == ranked[math.ceil(0.99 * len(ranked)) - 1]
        oldest = max(oldest, max(ages))
        trained |= {g.key: g.index for g in b.groups}
    assert oldest >= 2  # the 90-token groups: trained, several versions after they started
    assert any(i % 5 == 0 for i in trained.values())
    # every group is informative here: one neither trained nor still pending never started (wasted is 0 above) and
    # its prompt came back
    kept = set(trained) | {p.key for p in ds.scheduler.paused} | {g.key for g in ds.scheduler.carry}
    assert not _lost_prompts(engine, ds, kept)


@pytest.mark.parametrize("eta,split", [(0, False), (1, False), (2, False), (1, True), (2, True)])
def test_admission_keeps_engines_busy_at_a_low_informative_fraction_and_holds_its_bound(pool, seed, eta, split):
    """About 1 group in 4 informative: running groups count as the estimated fraction, so (1 + eta) batches ahead
    allow ~4 (1 + eta) B groups to run, not (1 + eta) B; and at every decision the bound holds. split: collected
    as the asynchronous controller does (lagging_weights), the batches handed out and not trained counted whole."""
    rng = random.Random(seed)
    informative = {i: rng.random() < 0.25 for i in range(3000)}
    script = correct_first(lambda i: 2 if informative[i] else 0, length=lambda i, j: 20 + (i * 7 + j * 3) % 41)
    engine = ScriptedEngine(script)
    B = 4
    ds = loader(
        make_dataset(3000),
        engine,
        pool,
        mode="stream",
        partial_rollout=True,
        max_staleness=eta,
        train_batch_size=B,
        engine_sequences=80 * G,
        max_gen_batches=0,
        seed=rng.randrange(1000),
    )
    sched = ds.scheduler
    plan = sched.plan

    def checked_plan():  # the bound is on starts: whenever groups start, with the estimate they started under
        out = plan()
        st = sched._step
        ahead = sched.untrained_batches * B + len(st.batch) + len(st.surplus) + len(sched.carry)
        if out:
            assert ahead + sched._informative_estimate() * len(sched.flight) <= (1 + eta) * B + 1e-9
        return out

    sched.plan = checked_plan
    next_batch = lagging_weights(ds, eta) if split else ds.next_batch
    flights = []
    for _ in range(15):
        b = next_batch()
        flights.append(b.stats["sampler/in_flight_max"])
    busy = engine.stats["stream_busy_steps"] / engine.stats["stream_steps"]
    print(f"eta={eta} split={split}: engines busy {busy:.3f} of their steps, groups in flight at most {max(flights)}")
    assert busy > 0.95  # idle only while finished groups wait a tick to be scored (eta = 0 starts nothing then)
    assert statistics.median(flights) >= 0.6 * (1 + eta) * B / 0.25  # a mutant counting them whole gets (1 + eta) B


def _short_and_long_partial(pool, max_staleness: int):
    """Partial rollout in steps of 3 groups over prompts whose odd ones answer in 6 tokens and even ones in 30 (those
    outlive a step), every group 2 of 4 right, 4 groups generating at once."""
    engine = ScriptedEngine(correct_first(lambda i: 2, length=lambda i, j: 6 if i % 2 else 30), capacity=16)
    kw = dict(mode="stream", partial_rollout=True, train_batch_size=3, engine_sequences=4 * G, shuffle=False)
    return loader(make_dataset(50), engine, pool, max_staleness=max_staleness, **kw)


def test_a_driver_sets_the_weights_and_serves_between_the_ticks(pool):
    """What the asynchronous controller drives the loader with (placement/controller.py, a TickDriver): its weights()
    before the step and after every tick tag the tokens sampled from then on and count the batches collected and
    not trained for admission; its between_ticks() runs after every tick. Without a driver (colocated) the tag is the
    batch count."""
    ds = _short_and_long_partial(pool, max_staleness=2)
    seen, held = [], [0]

    class Driver:
        @staticmethod
        def weights() -> int:
            return held[0]

        @staticmethod
        def between_ticks() -> None:
            seen.append((ds.version, ds.sampling_version, ds.scheduler.untrained_batches))
            # at once: a wrong count could stall admission, and the step with it
            assert seen[-1] == (ds.version, held[0], ds.version - held[0]), seen[-1]

    batches = [ds.next_batch(Driver) for _ in range(3)]
    assert len(seen) == sum(b.stats["sampler/ticks"] for b in batches) > 0
    assert {v for _, v, _ in seen} == {0} and {(k, u) for k, _, u in seen} == {(0, 0), (1, 1), (2, 2)}
    held[0] = 1  # three batches handed out, the first trained
    seen.clear()
    tagged = ds.next_batch(Driver)
    assert set(seen) == {(3, 1, 2)}
    fresh = [g for g in tagged.groups if g.finished_in == 3]
    assert fresh and all(r.versions[-1] == 1 for g in fresh for r in tagged.local[g.key])
    held[0] = 4
    seen.clear()
    ds.next_batch(Driver)
    assert set(seen) == {(4, 4, 0)}
    ds.next_batch()
    assert ds.sampling_version == 5


def test_paused_groups_continue_with_their_tokens_and_versions(pool):
    ds = _short_and_long_partial(pool, max_staleness=2)
    first = ds.next_batch()
    paused = {p.key: ds.partial[p.key] for p in ds.scheduler.paused}
    assert paused and first.stats["tokens/paused"] > 0
    seen = {}
    for _ in range(4):
        b = ds.next_batch()
        seen.update({g.key: b.local[g.key] for g in b.groups})
    resumed = [k for k in paused if k in seen]
    assert resumed
    for k in resumed:
        for before, after in zip(paused[k], seen[k]):
            assert after.token_ids[: len(before.token_ids)] == before.token_ids  # old tokens kept
            assert after.versions[: len(before.versions)] == before.versions == [0] * len(before.versions)
            assert set(after.versions[len(before.versions) :]) <= {1, 2}


def test_async_tokens_are_tagged_by_the_weights_and_counted_by_the_step_that_made_them(pool):
    """Asynchronous DAPO (the rollout controller's weights() drive the tag): the engines' weights lag the batch count by
    one, so every token generated for batch k is tagged k - 1 and trained one version stale, while the step's token
    counts still go by the step that generated a token (a count by version would find none of batch k's tokens)."""
    ds = _short_and_long_partial(pool, max_staleness=1)
    parts = ("trained", "wasted", "carried", "paused", "uninformative")
    for k in range(4):
        b = ds.next_batch(FixedWeights(max(0, k - 1)))  # what the controller holds while it collects batch k at eta = 1
        st = b.stats
        assert st["tokens/generated"] == sum(st[f"tokens/{p}"] for p in parts) > 0
        fresh = [g for g in b.groups if g.finished_in == k]  # the rest were carried in from an earlier step
        assert all(0 < g.fresh_tokens <= g.tokens for g in fresh)
        assert st["tokens/trained"] == sum(g.fresh_tokens for g in fresh) > 0
        if k >= 1:
            assert st["staleness/tokens_0"] == 0 and st["staleness/max"] >= 1  # nothing sampled by weights k
            assert all(r.versions[-1] == k - 1 for g in fresh for r in b.local[g.key])


# ------------------------------------------------------------------ shortfall


def test_shortfall_error_or_train(pool):
    script = correct_first(lambda i: 2 if i % 10 == 0 else G)  # 1 in 10 informative

    def short(mode: str, **kw):  # two generation batches of 5 prompts hold 1 informative group, not the 5 it needs
        kw = dict(mode=mode, train_batch_size=5, gen_batch_size=5, max_gen_batches=2, shuffle=False, **kw)
        return loader(make_dataset(40), ScriptedEngine(script), pool, **kw)

    for mode in ("stream", "fill"):
        with pytest.raises(DynamicSamplingError, match="only 1 of sampler.train_batch_size=5"):
            short(mode).next_batch()
        b = short(mode, on_shortfall="train").next_batch()
        assert len(b.groups) == 1 and b.stats["sampler/shortfall"] == 1.0
        with pytest.raises(DynamicSamplingError):
            short(mode, on_shortfall="train", min_groups=2).next_batch()
    with pytest.raises(ConfigError, match="sampler.min_groups=9"):
        load_config(overrides=["sampler.train_batch_size=8", "sampler.min_groups=9"])
    with pytest.raises(ConfigError, match="sampler.on_shortfall='skip'"):
        load_config(overrides=["sampler.on_shortfall=skip"])


def test_partial_rollout_needs_stream_and_truncated_is_and_drop_stale_a_staleness():
    with pytest.raises(ConfigError, match="algorithm.tis_cap"):
        load_config(overrides=["sampler.partial_rollout=true"])
    with pytest.raises(ConfigError, match="sampler.partial_rollout=True: expected sampler.mode=stream"):
        load_config(overrides=["sampler.partial_rollout=true", "sampler.mode=fill", "algorithm.tis_cap=2"])
    with pytest.raises(ConfigError, match="sampler.drop_stale=True: expected sampler.partial_rollout=true"):
        load_config(overrides=["sampler.drop_stale=true"])
    pr = ["sampler.partial_rollout=true", "algorithm.tis_cap=2"]
    with pytest.raises(ConfigError, match="sampler.max_staleness=0"):
        load_config(overrides=[*pr, "sampler.drop_stale=true", "sampler.max_staleness=0"])
    load_config(overrides=[*pr, "sampler.max_staleness=0"])  # admission at eta = 0: start only what the batch needs
    load_config(overrides=pr)


# ------------------------------------------------------------------ several engines


@pytest.mark.parametrize("mode", ["fill", "stream"])
def test_two_engines_share_the_work_and_train_what_one_engine_trains(pool, mode, seed):
    """Groups are seeded by submission number and committed in submission order, so the trained groups do not
    depend on how many engines generate them or which finishes first (stream: what is requeued may)."""
    rng = random.Random(seed)
    correct = {i: rng.choice([0, 1, 2, G]) for i in range(200)}
    script = correct_first(lambda i: correct[i], length=lambda i, j: 1 + (i + 3 * j) % 11)
    kw = dict(mode=mode, train_batch_size=6, gen_batch_size=10, seed=rng.randrange(100))
    one = loader(make_dataset(200), ScriptedEngine(script, capacity=16), pool, **kw)
    engines = {0: ScriptedEngine(script, capacity=8), 1: ScriptedEngine(script, capacity=8)}
    two = loader(make_dataset(200), engines, pool, **kw)
    trained_by = set()
    for _ in range(4):
        a, b = one.next_batch(), two.next_batch()
        assert [(g.index, g.lengths, g.acc) for g in a.groups] == [(g.index, g.lengths, g.acc) for g in b.groups]
        trained_by |= {g.engine for g in b.groups}
    assert trained_by == {0, 1}  # both did work that was trained (one batch of 6 may come from one engine alone)
    counts = [len(e.submitted) for e in engines.values()]
    assert abs(counts[0] - counts[1]) <= max(counts) // 4  # each new group goes where the fewest are in flight


@pytest.mark.parametrize("shape", ["buffer", "excess"])
def test_a_group_s_rewards_are_its_scores_plus_the_configured_overlong_penalty(shape):
    """GroupShaping (what the loader does with each finished group): reward = score + the overlong penalty of the
    configured shape, written out here in float64; informative on raw correctness, not on the shaped rewards."""
    from types import SimpleNamespace

    from megatron_dapo.sampling.group_summary import GroupShaping
    from megatron_dapo.types import Group, Prompt, Response

    overrides = ["rollout.max_response_length=20", "algorithm.overlong_buffer_len=8", "algorithm.group_size=4"]
    cfg = load_config(
        overrides=[*overrides, f"algorithm.overlong_shape={shape}", "algorithm.overlong_penalty_factor=0.5"]
    )
    lengths, scores = [5, 12, 16, 20], [1.0, -1.0, 1.0, -1.0]
    prompt = Prompt(index=3, messages=[], text="q", token_ids=[1], ground_truth="7", data_source="x")
    group = Group(prompt, [Response(list(range(n)), "a", truncated=n == 20) for n in lengths], [], [], [])
    scored = SimpleNamespace(scores=scores, acc=[s > 0 for s in scores], status=["ok"] * 4)
    shaping = GroupShaping(cfg.algorithm, 20, cfg.overlong_soft_max())
    meta = shaping.summarise(0, group, 0, scored, version=0)
    if shape == "buffer":  # free to 12, then down to -0.5 at 20
        penalty = [0.0 if n <= 12 else -0.5 * (n - 12) / 8 for n in lengths]
    else:  # past the soft maximum 12 (20 - 8): -0.5 x excess / 12
        penalty = [0.0 if n <= 12 else -0.5 * (n - 12) / 12 for n in lengths]
    assert meta.rewards == pytest.approx([s + p for s, p in zip(scores, penalty)], abs=1e-7)
    assert meta.informative and meta.acc == [True, False, True, False]
