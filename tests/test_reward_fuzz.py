"""Adversarial responses: every verifier through the real RewardPool (megatron_dapo/reward/fuzz.py, which
tools/fuzz_reward.py runs), the hybrid in-process."""

from __future__ import annotations

import logging
import random

import pytest

from megatron_dapo.choices import VERIFIERS
from megatron_dapo.reward import fuzz as fuzz_reward
from megatron_dapo.reward import hybrid_verify

N_FUZZ = 20 * len(fuzz_reward.GENERATORS)
"""20 responses per generator: a seeded subset of what `python tools/fuzz_reward.py` runs."""
TIMEOUT_S = 1.0
SCALE = 5
"""The huge responses below are SCALE x 200,000 characters (as test_reward.HUGE): a linear verifier takes well under
a second on each; a quadratic one (a regex that backtracks, a loop that rescans) takes ~1e12 steps, hours at the
~1e8 steps a second of Python's regex engine, and so runs into pytest-timeout's hang guard (900 s) instead of
passing."""


@pytest.fixture(scope="module")
def fuzz_cases() -> tuple[list[str], list[str], list[str]]:
    return fuzz_reward.make_cases(N_FUZZ, seed=0)


def test_fuzz_cases_are_seeded_and_cover_every_generator(fuzz_cases):
    assert fuzz_reward.make_cases(N_FUZZ, seed=0) == fuzz_cases
    responses, references, categories = fuzz_cases
    assert set(categories) == set(fuzz_reward.GENERATORS) and len(responses) == len(references) == N_FUZZ
    assert max(len(r) for r in responses) > 100_000 and "" in references


@pytest.mark.parametrize(
    "verifier", [pytest.param(v, marks=pytest.mark.slow) if v == "math_verify" else v for v in VERIFIERS]
)
def test_fuzz_through_the_pool(verifier, fuzz_cases, caplog):
    # math-verify, the slowest (its slow LaTeX runs into the timeout), takes the first half: 10 of every generator
    n = N_FUZZ // 2 if verifier == "math_verify" else N_FUZZ
    cases = [column[:n] for column in fuzz_cases]
    assert set(cases[2]) == set(fuzz_reward.GENERATORS)
    with caplog.at_level(logging.ERROR, logger="megatron_dapo.reward"):  # the pool logs each timeout: expected
        row = fuzz_reward.fuzz_verifier(verifier, *cases, workers=2, timeout_s=TIMEOUT_S)
    assert row["crashes"] == 0, "an exception escaped RewardPool.score"
    # every response has a status, those that would run for ever (slow LaTeX under math-verify) 'timeout'
    assert row["no status"] == 0 and row["ok"] + row["timeout"] + row["error"] == n
    if verifier != "math_verify":  # math-verify raises on references it cannot parse; ours never raise
        assert row["error"] == 0


HUGE_RESPONSES = {
    "digits_then_letter": lambda: "Answer: " + "1" * 200_000 * SCALE + "x",
    "commas": lambda: "Answer: " + "1," * 100_000 * SCALE,
    "open_boxes": lambda: "Answer: " + "\\boxed{" * 40_000 * SCALE,
    "nested_braces": lambda: "Answer: " + "{" * 100_000 * SCALE + "}" * 100_000 * SCALE,
    "nested_parens": lambda: "Answer: " + "(" * 50_000 * SCALE + "5" + ")" * 50_000 * SCALE,
    "nested_fracs": lambda: "Answer: " + "\\frac{1}{" * 20_000 * SCALE + "2" + "}" * 20_000 * SCALE,
    "minus_signs": lambda: "Answer: " + "-" * 200_000 * SCALE + "5",
    "equations": lambda: "Answer: " + "x = " * 50_000 * SCALE + "6",
    "unit_words": lambda: "Answer: 5 " + "a " * 100_000 * SCALE,
    "inequalities": lambda: "Answer: " + "1 < " * 50_000 * SCALE + "x",
    "plus_minus": lambda: "Answer: " + "\\pm " * 50_000 * SCALE + "1",
    "and_list": lambda: "Answer: " + "1 and " * 50_000 * SCALE + "2",
    "set": lambda: "Answer: \\{" + ", ".join(["1"] * 50_000 * SCALE) + "\\}",
    "prose": lambda: "Answer: " + "the " * 50_000 * SCALE + "answer is 6",
    "long_box": lambda: "\\boxed{" + "5" * 100_000 * SCALE + "}",
    # exact arithmetic that must never be attempted: these would not finish (or exhaust memory) if it were
    "power_tower_2000": lambda: "Answer: " + "2^{" * 2_000 + "2" + "}" * 2_000,
    "repeating_decimal": lambda: "Answer: 0." + "1" * 3_000 + "\\overline{" + "3" * 3_000 + "}",
    "huge_exponent": lambda: "Answer: 1e999999999",
    "power_tower_4": lambda: "Answer: 9^{9^{9^{9}}}",
}


@pytest.mark.parametrize("name", HUGE_RESPONSES)
def test_hybrid_is_linear_on_huge_inputs(name):
    # no clock: a quadratic verifier, or one that evaluates these numbers, would not finish before the hang guard
    assert hybrid_verify(HUGE_RESPONSES[name](), "5", timeout_s=None).score == -1.0


def test_hybrid_is_linear_on_huge_random_text(seed):
    # 'answer', colons, braces and digits at random; no 9 anywhere, so no answer in it can equal the gold 9
    rng = random.Random(seed)
    text = "".join(rng.choices("ab{}\\$ :=\n012345678,.answerAnswer", k=200_000 * SCALE))
    assert hybrid_verify(text, "9", timeout_s=None).score == -1.0
