"""The dynamic-sampling loader, driven by a scripted rollout whose per-prompt correctness we set.

Responses are real text scored by the real DAPO verifier in the real reward pool.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.data.dynamic_sampling import DynamicSamplingError, DynamicSamplingLoader
from megatron_dapo.data.types import Prompt, Response
from megatron_dapo.reward import RewardPool

G = 4


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=1, timeout_s=5.0) as p:
        yield p


def make_dataset(n: int) -> list[Prompt]:
    return [
        Prompt(
            index=i,
            messages=[{"role": "user", "content": f"What is {i} * 7?"}],
            text=f"What is {i} * 7?",
            token_ids=[1, 2, 3],
            ground_truth=str(i * 7),
            data_source="synthetic_dapo",
        )
        for i in range(n)
    ]


class ScriptedRollout:
    """Prompt p gets num_correct(p) right answers then wrong ones; lengths(p) sets token counts."""

    def __init__(self, num_correct, lengths=None):
        self.num_correct = num_correct
        self.lengths = lengths or (lambda p, j: 5)
        self.calls: list[list[int]] = []

    def __call__(self, prompts: list[Prompt], n: int) -> list[list[Response]]:
        self.calls.append([p.index for p in prompts])
        out = []
        for p in prompts:
            k = self.num_correct(p.index)
            group = []
            for j in range(n):
                answer = p.ground_truth if j < k else str(int(p.ground_truth) + 1)
                length = self.lengths(p.index, j)
                group.append(Response(token_ids=[7] * length, text=f"Some steps.\nAnswer: {answer}", logprobs=None))
            out.append(group)
        return out


def loader(dataset, rollout, pool, **kw):
    kw.setdefault("group_size", G)
    kw.setdefault("max_response_length", 100)
    kw.setdefault("overlong_buffer_len", 20)
    return DynamicSamplingLoader(dataset, rollout, pool, **kw)


def test_exact_batch_and_statistics(pool):
    rng = random.Random()
    correct = {i: rng.choice([0, 0, 1, 2, 3, G, G]) for i in range(60)}
    rollout = ScriptedRollout(lambda i: correct[i])
    ds = loader(
        make_dataset(60),
        rollout,
        pool,
        train_batch_size=5,
        gen_batch_size=8,
        max_gen_batches=0,
        seed=rng.randrange(1000),
    )
    batch = ds.next_batch()
    drawn = [i for call in rollout.calls for i in call]
    informative = [i for i in drawn if 0 < correct[i] < G]
    assert len(batch.groups) == 5
    assert [g.prompt.index for g in batch.groups] == informative[:5]
    assert [g.prompt.index for g in ds.carry] == informative[5:]
    for g in batch.groups:
        assert g.num_correct == correct[g.prompt.index]
        assert g.scores == [1.0] * g.num_correct + [-1.0] * (G - g.num_correct)
    s = batch.stats
    assert s["sampler/gen_rounds"] == len(rollout.calls)
    assert s["sampler/groups_generated"] == len(drawn)
    assert s["sampler/informative"] == len(informative)
    assert s["sampler/informative_frac"] == pytest.approx(len(informative) / len(drawn))
    assert s["sampler/all_correct"] == sum(correct[i] == G for i in drawn)
    assert s["sampler/all_wrong"] == sum(correct[i] == 0 for i in drawn)
    assert s["reward/acc"] == pytest.approx(sum(correct[i] for i in drawn) / (G * len(drawn)))
    assert s["sampler/carried_out"] == len(informative) - 5


def test_surplus_is_carried_over_and_nothing_is_lost(pool):
    rollout = ScriptedRollout(lambda i: 1 + i % 3)  # every group informative
    ds = loader(make_dataset(100), rollout, pool, train_batch_size=5, gen_batch_size=3)
    first = ds.next_batch()  # rounds of 3: 6 collected, 1 carried
    assert len(first.groups) == 5 and len(ds.carry) == 1
    carried = ds.carry[0].prompt.index
    second = ds.next_batch()
    assert second.groups[0].prompt.index == carried and second.stats["sampler/carried_in"] == 1
    trained = [g.prompt.index for b in (first, second) for g in b.groups] + [g.prompt.index for g in ds.carry]
    assert trained == [i for call in rollout.calls for i in call]  # every informative group, once, in order


def test_step_served_from_the_carry_reports_no_rollout_rates(pool):
    rollout = ScriptedRollout(lambda i: 1 + i % 3)  # every group informative
    ds = loader(make_dataset(100), rollout, pool, train_batch_size=2, gen_batch_size=4)
    ds.next_batch()  # 4 generated, 2 trained, 2 carried
    calls = len(rollout.calls)
    second = ds.next_batch()
    assert len(rollout.calls) == calls and len(second.groups) == 2
    s = second.stats
    assert s["sampler/gen_rounds"] == 0 and s["sampler/carried_in"] == 2 and s["sampler/batch_groups"] == 2
    # no fresh responses: rates are absent, never a 0 that reads as a collapse
    for key in ("reward/mean", "reward/acc", "sampler/informative_frac", "response/length_mean"):
        assert key not in s


def test_cap_error_reports_what_was_found(pool):
    rollout = ScriptedRollout(lambda i: 2 if i in (3, 11) else 0)
    ds = loader(make_dataset(50), rollout, pool, train_batch_size=4, gen_batch_size=5, max_gen_batches=3, shuffle=False)
    with pytest.raises(DynamicSamplingError) as e:
        ds.next_batch()
    msg = str(e.value)
    assert len(rollout.calls) == 3
    assert "after 3 generation rounds (sampler.max_gen_batches=3)" in msg
    assert "only 2 of sampler.train_batch_size=4 informative groups were found" in msg
    assert "2 of 15 groups generated this step were informative, fraction 0.133" in msg
    assert "13 all wrong" in msg
    assert [g.prompt.index for g in ds.carry] == [3, 11]  # kept, not thrown away


def test_all_wrong_group_with_different_shaped_rewards_is_not_informative(pool):
    # L_max 100, buffer 20: lengths 80 (no penalty), 85, 90, 100 (full penalty) shape the -1 scores apart
    lengths = [80, 85, 90, 100]
    rollout = ScriptedRollout(lambda i: 0 if i == 0 else 1, lengths=lambda i, j: lengths[j])
    ds = loader(make_dataset(2), rollout, pool, train_batch_size=1, gen_batch_size=2, shuffle=False)
    batch = ds.next_batch()
    assert [g.prompt.index for g in batch.groups] == [1]
    assert batch.stats["sampler/all_wrong"] == 1 and batch.stats["sampler/informative"] == 1
    # the shaped rewards of the accepted group: score + ((L_max - L_cache) - |o|) / L_cache, floored at -1
    assert batch.groups[0].rewards == pytest.approx([1.0, -1.25, -1.5, -2.0])
    assert batch.groups[0].scores == [1.0, -1.0, -1.0, -1.0]


def test_epoch_wrap_reshuffles_without_repeats_or_skips(pool):
    n = 10
    rollout = ScriptedRollout(lambda i: 2)
    ds = loader(make_dataset(n), rollout, pool, train_batch_size=4, gen_batch_size=4)
    for _ in range(5):
        ds.next_batch()
    drawn = [i for call in rollout.calls for i in call]
    assert len(drawn) == 20
    assert sorted(drawn[:10]) == list(range(n)) and sorted(drawn[10:]) == list(range(n))
    assert drawn[:10] != drawn[10:]  # a new permutation per epoch
    assert ds.epoch == 2


def test_no_prompt_twice_in_a_step_across_an_epoch_end(pool):
    n = 5
    rollout = ScriptedRollout(lambda i: 2)
    ds = loader(make_dataset(n), rollout, pool, train_batch_size=4, gen_batch_size=3)
    seen = Counter()
    for _ in range(6):
        before = len(rollout.calls)
        batch = ds.next_batch()
        in_step = [i for call in rollout.calls[before:] for i in call]
        carried = [g.prompt.index for g in batch.groups if g.meta["step"] < ds.steps - 1]
        assert len(set(in_step + carried)) == len(in_step) + len(carried)
        assert len({g.prompt.index for g in batch.groups}) == len(batch.groups)
        seen.update(in_step)
    assert max(seen.values()) - min(seen.values()) <= 1  # every prompt drawn as often as any other, +-1


def test_dataset_smaller_than_a_step_is_a_clear_error(pool):
    ds = loader(make_dataset(3), ScriptedRollout(lambda i: 2), pool, train_batch_size=4, gen_batch_size=2)
    with pytest.raises(
        DynamicSamplingError, match="after every one of the 3 prompts was tried in this step, only 3 of"
    ):
        ds.next_batch()


def test_state_save_restore_mid_epoch(pool):
    def fresh(rollout):
        return loader(make_dataset(23), rollout, pool, train_batch_size=4, gen_batch_size=3, seed=7)

    correct = lambda i: [0, 1, 2, 4][i % 4]  # noqa: E731
    a = fresh(ScriptedRollout(correct))
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # plain containers, as a checkpoint stores them
    assert state["carry"] and 0 < len(state["queue"]) < 23 * 2
    rest_a = [[g.prompt.index for g in a.next_batch().groups] for _ in range(4)]

    b_rollout = ScriptedRollout(correct)
    b = fresh(b_rollout)
    b.load_state_dict(state)
    rest_b = [[g.prompt.index for g in b.next_batch().groups] for _ in range(4)]
    assert rest_a == rest_b
    assert a.state_dict() == b.state_dict()
    # the restored carry holds the same data, not just the same prompts
    assert b.state_dict()["carry"] == a.state_dict()["carry"]

    other = loader(make_dataset(24), ScriptedRollout(correct), pool, seed=7)
    with pytest.raises(ValueError, match="dataset of 23 prompts, but this dataset has 24"):
        other.load_state_dict(state)


def test_dynamic_bs_trains_on_one_round(pool):
    correct = {i: [0, 2, G][i % 3] for i in range(30)}
    rollout = ScriptedRollout(lambda i: correct[i])
    ds = loader(make_dataset(30), rollout, pool, mode="dynamic_bs", train_batch_size=7, gen_batch_size=100)
    batch = ds.next_batch()
    assert len(rollout.calls) == 1 and len(rollout.calls[0]) == 7
    assert [g.prompt.index for g in batch.groups] == [i for i in rollout.calls[0] if correct[i] == 2]
    assert ds.carry == []


def test_user_filter_and_no_dynamic_sampling(pool):
    correct = {i: [0, 2, G][i % 3] for i in range(30)}
    rollout = ScriptedRollout(lambda i: correct[i])
    ds = loader(
        make_dataset(30), rollout, pool, train_batch_size=6, gen_batch_size=6, filter_fn=lambda g: g.num_correct > 0
    )
    assert all(g.num_correct > 0 for g in ds.next_batch().groups)
    ds = loader(
        make_dataset(30),
        ScriptedRollout(lambda i: correct[i]),
        pool,
        train_batch_size=6,
        gen_batch_size=6,
        dynamic_sampling=False,
    )
    batch = ds.next_batch()
    assert len(batch.groups) == 6 and batch.stats["sampler/gen_rounds"] == 1


def test_from_config_and_bad_rollouts(pool):
    cfg = load_config(
        overrides=[
            "algorithm.group_size=4",
            "sampler.train_batch_size=2",
            "sampler.gen_batch_size=2",
            "optim.mini_batch_size=8",
        ]
    )
    ds = DynamicSamplingLoader.from_config(cfg, make_dataset(4), ScriptedRollout(lambda i: 2), pool)
    assert (ds.group_size, ds.train_batch_size, ds.max_response_length) == (4, 2, 20480)
    assert len(ds.next_batch().groups) == 2

    def short(prompts, n):
        return [[Response(token_ids=[1], text="Answer: 1")] * (n - 1) for _ in prompts]

    with pytest.raises(
        RuntimeError, match="rollout returned 3 responses for prompt .*, expected algorithm.group_size=4"
    ):
        loader(make_dataset(4), short, pool).next_batch()
    with pytest.raises(ValueError, match="empty"):
        loader([], short, pool)
