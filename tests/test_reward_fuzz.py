"""Adversarial responses: every verifier through the real RewardPool (megatron_dapo/reward/fuzz.py, which
tools/fuzz_reward.py runs), the hybrid in-process."""

from __future__ import annotations

import logging
import random
import time

import pytest

from megatron_dapo.reward import fuzz as fuzz_reward
from megatron_dapo.reward import hybrid_verify

N_FUZZ = 20 * len(fuzz_reward.GENERATORS)
"""20 responses per generator: a seeded subset of what `python tools/fuzz_reward.py` runs."""
TIMEOUT_S = 1.0
SLACK_S = 3.0
"""Allowed on top of the time limit for one call (kill, IPC, a busy machine), as in test_reward.py."""


@pytest.fixture(scope="module")
def fuzz_cases() -> tuple[list[str], list[str], list[str]]:
    return fuzz_reward.make_cases(N_FUZZ, seed=0)


def test_fuzz_cases_are_seeded_and_cover_every_generator(fuzz_cases):
    assert fuzz_reward.make_cases(N_FUZZ, seed=0) == fuzz_cases
    responses, references, categories = fuzz_cases
    assert set(categories) == set(fuzz_reward.GENERATORS) and len(responses) == len(references) == N_FUZZ
    assert max(len(r) for r in responses) > 100_000 and "" in references


@pytest.mark.parametrize(
    "verifier", [pytest.param(v, marks=pytest.mark.slow) if v == "math_verify" else v for v in fuzz_reward.VERIFIERS]
)
def test_fuzz_through_the_pool(verifier, fuzz_cases, caplog):
    with caplog.at_level(logging.ERROR, logger="megatron_dapo.reward"):  # the pool logs each timeout: expected
        row = fuzz_reward.fuzz_verifier(verifier, *fuzz_cases, workers=2, timeout_s=TIMEOUT_S)
    assert row["crashes"] == 0, "an exception escaped RewardPool.score"
    assert row["no status"] == 0 and row["ok"] + row["timeout"] + row["error"] == N_FUZZ
    assert row["worst s"] < TIMEOUT_S + SLACK_S
    if verifier != "math_verify":  # math-verify raises on references it cannot parse; ours never raise
        assert row["error"] == 0


@pytest.mark.parametrize(
    "response",
    [
        "".join(random.Random(0).choice("ab{}\\$ :=\n0123456789,.answerAnswer") for _ in range(200_000)),
        "Answer: " + "1" * 200_000 + "x",
        "Answer: " + "1," * 100_000,
        "Answer: " + "\\boxed{" * 40_000,
        "Answer: " + "{" * 100_000 + "}" * 100_000,
        "Answer: " + "(" * 50_000 + "5" + ")" * 50_000,
        "Answer: " + "\\frac{1}{" * 20_000 + "2" + "}" * 20_000,
        "Answer: " + "-" * 200_000 + "5",
        "Answer: " + "x = " * 50_000 + "6",
        "Answer: 5 " + "a " * 100_000,
        "Answer: " + "1 < " * 50_000 + "x",
        "Answer: " + "\\pm " * 50_000 + "1",
        "Answer: " + "1 and " * 50_000 + "2",
        "Answer: \\{" + ", ".join(["1"] * 50_000) + "\\}",
        "Answer: " + "the " * 50_000 + "answer is 6",
        "\\boxed{" + "5" * 100_000 + "}",
        "Answer: " + "2^{" * 2_000 + "2" + "}" * 2_000,
        "Answer: 0." + "1" * 3_000 + "\\overline{" + "3" * 3_000 + "}",
        "Answer: 1e999999999",
        "Answer: 9^{9^{9^{9}}}",
    ],
)
def test_hybrid_is_linear_on_huge_inputs(response):
    t = time.perf_counter()
    result = hybrid_verify(response, "5", timeout_s=None)
    assert time.perf_counter() - t < 1.0  # ~0.1 s at most in practice; quadratic would take minutes
    assert result.score == -1.0
