"""Scoring k samples per problem and the accuracy metrics over them: avg@k and pass@k.

One definition for the trainer's periodic evaluation (logged as eval/avg_at_k, eval/pass_at_k) and
tools/eval.py (the same keys in its summary), so the two cannot disagree on what a number means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def score_samples(scorer: Any, prompts: Sequence[Any], groups: Sequence[Sequence[Any]]) -> Any:
    """Score every response against its problem's ground truth, in order.

    prompts: P Prompts (.ground_truth, .data_source); groups: P lists of k Responses (.text);
    scorer: anything with .score(texts, ground_truths, data_sources) (a RewardPool). Returns its RewardBatch
    over the P*k responses, problem-major.
    """
    return scorer.score(
        [r.text for responses in groups for r in responses],
        [p.ground_truth for p, responses in zip(prompts, groups) for _ in responses],
        [p.data_source for p, responses in zip(prompts, groups) for _ in responses],
    )


def accuracy_at_k(correct: Sequence[Sequence[bool]]) -> dict[str, float]:
    """avg@k: mean correctness over every (problem, sample); pass@k: fraction of problems with any correct sample.

    correct: P problems x k samples (k equal for every problem). Returns avg_at_k, pass_at_k, k, problems.
    Both means are of 0/1 values: count / total, exact in float64.
    """
    if not correct:
        raise ValueError("accuracy_at_k: no problems")
    k = len(correct[0])
    if k == 0 or any(len(row) != k for row in correct):
        raise ValueError(f"accuracy_at_k: every problem needs the same k >= 1 samples, got {[len(r) for r in correct]}")
    return {
        "avg_at_k": sum(map(sum, correct)) / (len(correct) * k),
        "pass_at_k": sum(map(any, correct)) / len(correct),
        "k": float(k),
        "problems": float(len(correct)),
    }
