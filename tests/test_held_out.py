"""The one evaluation loop (rollout/held_out.py): its batches, seeds and metrics, with a scripted engine and scorer.

The trainer and the rollout controller evaluate all prompts in one batch; tools/eval.py (megatron_dapo/evaluate.py)
in batches of --batch-size. Sample j of problem i must be seeded seed + i*k + j either way, so the numbers are the
same whatever the batching.
"""

from __future__ import annotations

import pytest

from megatron_dapo.model.comm import Comm
from megatron_dapo.reward import RewardBatch
from megatron_dapo.rollout.held_out import HeldOutEval
from megatron_dapo.types import Prompt, Response


class SeedEngine:
    """Each sample's text is its seed; records every generate call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (prompts, first seed)

    def generate(self, token_ids, n, temperature, top_p, max_tokens, stop_token_ids, seed):
        self.calls.append((len(token_ids), seed))
        return [[Response([1], str(seed + i * n + j)) for j in range(n)] for i in range(len(token_ids))]


class EvenScorer:
    """Correct when the sample's seed is even and the problem's ground truth is 'even'."""

    def score(self, responses, ground_truths, data_sources) -> RewardBatch:
        acc = [int(r) % 2 == 0 and g == "even" for r, g in zip(responses, ground_truths)]
        return RewardBatch([1.0 if a else -1.0 for a in acc], acc, [None] * len(acc), ["ok"] * len(acc))


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, [], "", [i], "even" if i % 3 else "never", "test") for i in range(n)]


@pytest.mark.parametrize("batch_size", [None, 1, 2, 5, 100])
def test_batches_seed_each_sample_by_its_place_whatever_the_batching(batch_size):
    engine = SeedEngine()
    held_out = HeldOutEval(engine, EvenScorer(), Comm(), tp=1, seed=100, stop_token_ids=[0])
    got = list(held_out.batches(prompts(5), 3, 1.0, 1.0, 8, batch_size))
    size = batch_size or 5
    assert engine.calls == [(min(size, 5 - s), 100 + s * 3) for s in range(0, 5, size)]
    texts = [r.text for _, groups, _ in got for g in groups for r in g]
    assert texts == [str(100 + i) for i in range(15)]  # problem i, sample j: seed + i*k + j
    assert [p.index for batch, _, _ in got for p in batch] == list(range(5))


def test_evaluate_is_avg_and_pass_at_k_over_the_batches():
    held_out = HeldOutEval(SeedEngine(), EvenScorer(), Comm(), tp=1, seed=100, stop_token_ids=[0])
    got = held_out.evaluate(prompts(5), 3, 1.0, 1.0, 8)
    # problems 1, 2, 4 can be right; their seeds 103-105, 106-108, 112-114 hold 1, 2, 2 even ones
    assert got == {"eval/avg_at_k": 5 / 15, "eval/pass_at_k": 3 / 5, "eval/k": 3.0, "eval/problems": 5.0}
    with pytest.raises(ValueError, match="no prompts"):
        held_out.evaluate([], 3, 1.0, 1.0, 8)


def test_an_evaluator_runs_requests_on_chosen_prompts_or_the_validation_set_loaded_once():
    """What either rollout side runs an EvalRequest with (placement/evaluation.py): the request's k, temperature and
    length on its prompts, or on the validation set (prompts=None), which is loaded the first time it is asked for."""
    from megatron_dapo.placement.evaluation import Evaluator
    from megatron_dapo.types import EvalRequest

    engine, loads = SeedEngine(), []

    def val() -> list[Prompt]:
        loads.append(1)
        return prompts(5)

    evaluator = Evaluator(HeldOutEval(engine, EvenScorer(), Comm(), tp=1, seed=100, stop_token_ids=[0]), val)
    assert evaluator.run(EvalRequest(k=2, temperature=0.0, top_p=1.0, max_tokens=8, prompts=prompts(2))) == {
        "eval/avg_at_k": 0.25,  # 1 of 4: problem 1 (seeds 102, 103) once; problem 0 never
        "eval/pass_at_k": 0.5,
        "eval/k": 2.0,
        "eval/problems": 2.0,
    }
    assert loads == []
    held_out = EvalRequest(k=3, temperature=1.0, top_p=1.0, max_tokens=8)
    want = {"eval/avg_at_k": 5 / 15, "eval/pass_at_k": 3 / 5, "eval/k": 3.0, "eval/problems": 5.0}
    assert evaluator.run(held_out) == want and evaluator.run(held_out) == want and loads == [1]
