"""RewardPool's non-blocking API (submit / poll / done / result) with real workers and real verifiers."""

from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest

# pytest puts tests/ on sys.path and spawned pool workers inherit it: they import tests/reward_helpers.py.
from megatron_dapo.reward import RewardBatch, RewardPool  # noqa: E402

MAX_POLLS = 100_000
"""Engine steps a polling loop may take before the test fails: a bound on steps, not a clock. Each step sleeps
2 ms, so this is minutes of polling, where the tickets here need seconds (workers starting, a time limit or two);
a done() that never makes progress fails here rather than in the hang guard."""

COUNTS = ("reward/timeouts", "reward/errors", "reward/worker_restarts", "reward/accuracy", "reward/score_mean")
"""The metrics that do not depend on timing."""


@pytest.fixture(scope="module")
def auto_pool():
    with RewardPool(num_workers=2, timeout_s=5.0, verifier="auto") as pool:
        yield pool


@pytest.fixture(scope="module")
def naughty_pool():
    with RewardPool(num_workers=2, timeout_s=1.0, worker_memory_mb=1024, verifier="reward_helpers:misbehave") as pool:
        yield pool


def _random_items(rng: random.Random, n: int) -> tuple[list[str], list[str], list[str], list[bool]]:
    """n responses, about half right, in three styles; also whether each is right."""
    responses, golds, sources, right = [], [], [], []
    for _ in range(n):
        correct = rng.random() < 0.5
        style = rng.randrange(3)
        if style == 0:  # DAPO: the last 'Answer:' line, compared as a normalised string
            gold = rng.randrange(0, 10_000)
            answer = gold if correct else gold + rng.randrange(1, 100)
            responses.append(f"Step {rng.randrange(100)}: some work.\nAnswer: {answer}")
            golds.append(str(gold))
            sources.append("math_dapo")
        elif style == 1:  # math-verify with a GSM8K '####' gold
            gold = rng.randrange(0, 10_000)
            answer = gold if correct else gold + rng.randrange(1, 100)
            responses.append(f"So the total is \\boxed{{{answer}}}.")
            golds.append(f"Some work.\n#### {gold}")
            sources.append("openai/gsm8k")
        else:  # math-verify, symbolic: an unreduced fraction against the gold's decimal or reduced form
            p, q = rng.randrange(1, 9), rng.choice([2, 4, 5, 8])
            k = rng.randrange(1, 4)
            value = Fraction(p, q) if correct else Fraction(p, q) + Fraction(1, 3)
            responses.append(
                f"The probability is \\boxed{{\\frac{{{value.numerator * k}}}{{{value.denominator * k}}}}}."
            )
            golds.append(str(float(Fraction(p, q))))
            sources.append("math")
        right.append(correct)
    return responses, golds, sources, right


def _same_batch(a: RewardBatch, b: RewardBatch) -> bool:
    return (a.scores, a.acc, a.preds, a.status) == (b.scores, b.acc, b.preds, b.status) and all(
        a.metrics[k] == b.metrics[k] for k in COUNTS
    )


def _poll_until_done(pool: RewardPool, tickets: list[int]) -> None:
    """Drive the pool with done() alone, as the rollout loop does between engine steps."""
    for _ in range(MAX_POLLS):
        if all(pool.done(t) for t in tickets):
            return
        time.sleep(0.002)  # stands for an engine step (the loop waits on done() itself); leaves the cores to workers
    raise AssertionError(f"polling alone did not finish the tickets in {MAX_POLLS} polls")


# --------------------------------------------------------------------------- several tickets


def test_tickets_match_score_of_each_alone(seed, auto_pool):
    rng = random.Random(seed)
    parts = [_random_items(rng, n) for n in (16, 40, 3, 16, 1)]
    tickets = [auto_pool.submit(*part[:3]) for part in parts]  # all outstanding before any is collected
    assert len(set(tickets)) == len(tickets)
    batches = [auto_pool.result(t) for t in tickets]
    for part, batch in zip(parts, batches):
        alone = auto_pool.score(*part[:3])
        assert _same_batch(batch, alone)
        assert batch.acc == part[3]  # and both are right, not merely equal
        assert batch.status == ["ok"] * len(part[0]) and batch.metrics["reward/seconds"] > 0


def test_results_in_any_order_and_done_by_polling_alone(seed, auto_pool):
    rng = random.Random(seed)
    parts = [_random_items(rng, 16) for _ in range(4)]
    tickets = [auto_pool.submit(*part[:3]) for part in parts]
    _poll_until_done(auto_pool, tickets)
    for i in (2, 0, 3, 1):
        batch = auto_pool.result(tickets[i])
        assert batch.acc == parts[i][3] and batch.status == ["ok"] * 16
        assert batch.metrics["reward/accuracy"] == sum(parts[i][3]) / 16


def test_score_while_tickets_are_outstanding(seed, auto_pool):
    rng = random.Random(seed)
    first, second = _random_items(rng, 24), _random_items(rng, 8)
    ticket = auto_pool.submit(*first[:3])
    assert auto_pool.score(*second[:3]).acc == second[3]
    # FIFO: every response of the earlier ticket went to a worker before the later ones (its last may still be
    # running on the other worker: completion order is not promised, and under load it differs)
    assert not auto_pool._todo
    assert auto_pool.result(ticket).acc == first[3]


def test_input_problems_are_recorded_at_submit(auto_pool):
    ticket = auto_pool.submit([b"Answer: \xff", 12345, b"Answer: 3"], ["3", "3", "3"], ["math_dapo"] * 3)
    batch = auto_pool.result(ticket)
    assert batch.status == ["error", "error", "ok"] and batch.scores == [-1.0, -1.0, 1.0]
    assert batch.metrics["reward/errors"] == 2
    only_problems = auto_pool.submit([b"\xff\xfe"], ["1"], ["math_dapo"])
    assert auto_pool.done(only_problems)  # nothing for the workers to do
    assert auto_pool.result(only_problems).status == ["error"]
    empty = auto_pool.submit([], [], [])
    assert auto_pool.result(empty).scores == []
    with pytest.raises(ValueError, match="RewardPool.submit.*same length"):
        auto_pool.submit(["Answer: 1"], ["1", "2"], ["math_dapo"])


# --------------------------------------------------------------------------- limits, crashes


def test_hung_response_times_out_in_its_ticket_only(naughty_pool):
    # 'sleep' is stopped by the worker's own soft limit, 'burn' (C code) only by the parent's SIGKILL
    hung = naughty_pool.submit(["a", "burn", "b", "sleep", "c"], ["a", "x", "b", "x", "z"], ["src"] * 5)
    later_responses = [f"r{i}" for i in range(16)]
    later = naughty_pool.submit(later_responses, later_responses, ["src"] * 16)
    _poll_until_done(naughty_pool, [hung, later])
    ok = naughty_pool.result(later)
    assert ok.status == ["ok"] * 16 and ok.scores == [1.0] * 16
    assert ok.metrics["reward/timeouts"] == 0 and ok.metrics["reward/worker_restarts"] == 0
    batch = naughty_pool.result(hung)
    assert batch.status == ["ok", "timeout", "ok", "timeout", "ok"]
    assert batch.scores == [1.0, -1.0, 1.0, -1.0, -1.0]
    assert batch.metrics["reward/timeouts"] == 2
    assert batch.metrics["reward/worker_restarts"] >= 1  # burn; sleep too if its soft limit lost the race


def test_worker_crash_does_not_lose_or_mix_up_other_tickets():
    # One worker: chunks span tickets, so a crash sends other tickets' responses back to the queue.
    with RewardPool(num_workers=1, timeout_s=5.0, verifier="reward_helpers:misbehave") as pool:
        first = pool.submit(["a", "crash", "b"], ["a", "x", "x"], ["src"] * 3)
        second = pool.submit(["c", "crash", "d", "e", "f"], ["c", "x", "d", "x", "f"], ["src"] * 5)
        third = pool.submit(["g", "h"], ["g", "x"], ["src"] * 2)
        b3 = pool.result(third)  # collected first, though scored last (first in, first out)
        b1, b2 = pool.result(first), pool.result(second)
        assert (b1.status, b1.scores) == (["ok", "error", "ok"], [1.0, -1.0, -1.0])
        assert (b2.status, b2.scores) == (["ok", "error", "ok", "ok", "ok"], [1.0, -1.0, 1.0, -1.0, 1.0])
        assert (b3.status, b3.scores) == (["ok", "ok"], [1.0, -1.0])
        assert [b.metrics["reward/errors"] for b in (b1, b2, b3)] == [1, 1, 0]
        assert [b.metrics["reward/worker_restarts"] for b in (b1, b2, b3)] == [1, 1, 0]


def test_interrupted_result_leaves_no_worker_busy(naughty_pool, monkeypatch):
    naughty_pool.score(["a"] * 4, ["a"] * 4, ["src"] * 4)  # a worker is ready, so submit dispatches at once
    first = naughty_pool.submit(["a", "b", "c"], ["a", "b", "x"], ["src"] * 3)
    second = naughty_pool.submit(["d", "e"], ["d", "x"], ["src"] * 2)
    assert any(w.inflight for w in naughty_pool._workers)

    def interrupted():
        raise KeyboardInterrupt

    # Ctrl-C in the middle of a step: _waitables() runs just before the step waits on the workers.
    monkeypatch.setattr(naughty_pool, "_waitables", interrupted)
    with pytest.raises(KeyboardInterrupt):
        naughty_pool.result(first)
    with pytest.raises(KeyboardInterrupt):
        naughty_pool.score(["f"], ["f"], ["src"])  # its ticket is dropped with it
    monkeypatch.undo()
    assert all(not w.inflight for w in naughty_pool._workers)
    assert sorted(naughty_pool._tickets) == [first, second]
    assert naughty_pool.result(second).scores == [1.0, -1.0]  # the tickets survived, unblamed
    batch = naughty_pool.result(first)
    assert batch.scores == [1.0, 1.0, -1.0] and batch.status == ["ok"] * 3


# --------------------------------------------------------------------------- misuse, close, idle polling


def test_unknown_collected_and_closed_tickets():
    pool = RewardPool(num_workers=1, verifier="reward_helpers:exact")
    try:
        with pytest.raises(KeyError, match="no ticket 12345"):
            pool.result(12345)
        with pytest.raises(KeyError):
            pool.done(12345)
        ticket = pool.submit(["a", "b"], ["a", "x"], ["src", "src"])
        assert pool.result(ticket).scores == [1.0, -1.0]
        with pytest.raises(KeyError, match="already|collected"):
            pool.result(ticket)
        outstanding = pool.submit(["a"], ["a"], ["src"])
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.result(outstanding)
    with pytest.raises(RuntimeError, match="after close"):
        pool.done(outstanding)
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit(["a"], ["a"], ["src"])
    pool.poll()  # nothing to make progress on: no error


def test_idle_poll_returns(auto_pool):
    assert not auto_pool._tickets
    for _ in range(1000):
        assert auto_pool.poll() is None
    assert auto_pool.score(["Answer: 1"], ["1"], ["math_dapo"]).scores == [1.0]  # and the pool still works
