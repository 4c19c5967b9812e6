"""The labelled reward corpus: false negatives and false positives of every verifier, and the hybrid's rules.

tests/data/reward_corpus.jsonl opens with a header of `#` lines (the rules of the answers whose cases it generates),
then holds one hand-written case a line: `response`, `reference`,
`correct` (the label, by the DAPO-Math convention: the reference is the canonical answer and a
mathematically equal form is correct), `reason` (why, one line) and `category`; a long
response stores its filler as `prefix_repeat: [text, n]` (response = text * n + response).
The default verifier for DAPO data must be right on every case; the others must make exactly the
mistakes recorded in MISTAKES (false negatives and false positives per category): a verifier
change that moves them, for better or worse, updates the record on purpose.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from megatron_dapo.reward import (
    VerifyResult,
    dapo_verify,
    extract_final_answer,
    hybrid_verify,
    math_verify_verify,
    select_verifier,
)

CORPUS = Path(__file__).resolve().parent / "data" / "reward_corpus.jsonl"
MISTAKES = {
    "dapo": {
        "decimal": (2, 0),
        "equation": (1, 2),
        "expression": (12, 0),
        "extraction": (3, 1),
        "fraction": (18, 0),
        "grouping": (2, 9),
        "integer": (2, 0),
        "junk": (1, 2),
        "long": (1, 0),
        "negative": (5, 0),
        "power": (13, 0),
        "radical": (15, 0),
        "structure": (16, 0),
        "suffix": (6, 0),
        "text": (3, 0),
        "unit": (4, 0),
    },
    "math_verify": {
        "decimal": (2, 0),
        "equation": (3, 0),
        "expression": (14, 1),
        "extraction": (1, 2),
        "fraction": (6, 1),
        "grouping": (6, 1),
        "integer": (7, 0),
        "junk": (1, 6),
        "long": (0, 1),
        "negative": (3, 0),
        "power": (6, 0),
        "radical": (21, 1),
        "structure": (21, 2),
        "suffix": (0, 9),
        "text": (10, 0),
        "thousands": (2, 0),
        "unit": (2, 1),
    },
    "hybrid": {},
}
"""Per verifier, per category: (false negatives, false positives) on the corpus; categories without a mistake left
out. math_verify's count includes the one reference it cannot parse (MATH_VERIFY_UNPARSABLE)."""
MATH_VERIFY_UNPARSABLE = ["\\$12"]
"""References math-verify raises ValueError on (scored wrong, status 'error', by the pool)."""


def _default_for_dapo() -> str:
    """The name of what reward.verifier=auto picks for a DAPO data source."""
    verify = select_verifier("math_dapo", "auto")
    return {dapo_verify: "dapo", math_verify_verify: "math_verify", hybrid_verify: "hybrid"}[
        getattr(verify, "func", verify)
    ]


def load_corpus() -> list[dict]:
    """The corpus cases, with `response` expanded from `prefix_repeat`."""
    cases = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            continue  # the header
        case = json.loads(line)
        text, times = case.pop("prefix_repeat", ("", 0))
        case["response"] = text * times + case["response"]
        cases.append(case)
    return cases


def _verifiers() -> dict:
    # In-process calls pass timeout None: math-verify's SIGALRM would cancel pytest-timeout's
    return {
        "dapo": dapo_verify,
        "math_verify": functools.partial(math_verify_verify, timeout_s=None),
        "hybrid": functools.partial(hybrid_verify, timeout_s=None),
    }


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return load_corpus()


@pytest.fixture(scope="module")
def verdicts(corpus) -> dict[str, dict]:
    """Per verifier: 'acc' (one bool per case) and 'unparsable' (the references math-verify raised ValueError on,
    in corpus order: the one exception expected; any other fails the test)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its notice that we passed no timeout
    out = {}
    for name, verify in _verifiers().items():
        acc, unparsable = [], []
        for case in corpus:
            try:
                acc.append(verify(case["response"], case["reference"]).acc)
            except ValueError as e:
                if name != "math_verify" or "cannot parse the ground truth" not in str(e):
                    raise
                acc.append(False)  # as the pool scores it
                unparsable.append(case["reference"])
        out[name] = {"acc": acc, "unparsable": unparsable}
    return out


def _mistakes(corpus: list[dict], acc: list[bool]) -> tuple[list[dict], list[dict]]:
    """(false negatives, false positives)."""
    fn = [c for c, a in zip(corpus, acc) if c["correct"] and not a]
    fp = [c for c, a in zip(corpus, acc) if not c["correct"] and a]
    return fn, fp


def _by_category(corpus: list[dict], acc: list[bool]) -> dict[str, tuple[int, int]]:
    """{category: (false negatives, false positives)} for the categories with a mistake."""
    fn, fp = _mistakes(corpus, acc)
    fn_count, fp_count = Counter(c["category"] for c in fn), Counter(c["category"] for c in fp)
    return {k: (fn_count[k], fp_count[k]) for k in sorted(fn_count | fp_count)}


def _describe(cases: list[dict]) -> str:
    return "\n".join(f"  [{c['category']}] {c['response'][-80:]!r} vs {c['reference']!r}: {c['reason']}" for c in cases)


# --------------------------------------------------------------------------- the corpus


def test_corpus_is_well_formed(corpus):
    assert len(corpus) >= 200
    for case in corpus:
        assert set(case) == {"category", "response", "reference", "correct", "reason"}, case
        assert isinstance(case["correct"], bool) and case["reason"].strip() and "\n" not in case["reason"]
    assert len({(c["response"], c["reference"]) for c in corpus}) == len(corpus), "duplicate cases"
    labels = Counter(c["correct"] for c in corpus)
    assert labels[True] >= 60 and labels[False] >= 60


@pytest.mark.parametrize("name", MISTAKES)
def test_each_verifier_makes_exactly_its_recorded_mistakes(corpus, verdicts, name):
    got = _by_category(corpus, verdicts[name]["acc"])
    fn, fp = _mistakes(corpus, verdicts[name]["acc"])
    assert got == MISTAKES[name], (
        f"{name}: (FN, FP) by category {got}, recorded {MISTAKES[name]}\nFN:\n{_describe(fn)}\nFP:\n{_describe(fp)}"
    )
    assert verdicts[name]["unparsable"] == (MATH_VERIFY_UNPARSABLE if name == "math_verify" else [])


def test_default_verifier_is_right_on_every_case(corpus, verdicts):
    default = _default_for_dapo()
    fn, fp = _mistakes(corpus, verdicts[default]["acc"])
    assert not fp, f"{default} rewards {len(fp)} wrong answers:\n{_describe(fp)}"
    assert not fn, f"{default} rejects {len(fn)} correct answers:\n{_describe(fn)}"


def test_auto_picks_the_hybrid_for_dapo_data():
    assert _default_for_dapo() == "hybrid"
    assert select_verifier("math_dapo", "auto")("Answer: 0.5", "\\frac{1}{2}").acc
    assert select_verifier("openai/gsm8k", "auto").func is math_verify_verify
    assert select_verifier("anything", "hybrid", math_verify_timeout_s=None).keywords == {"timeout_s": None}


# --------------------------------------------------------------------------- the hybrid's rules, one by one


def _hybrid(answer: str, reference: str) -> bool:
    return hybrid_verify(f"Reasoning.\nAnswer: {answer}", reference, timeout_s=None).acc


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Answer: 5", "5"),
        ("Answer: 4\nAnswer: 5", "5"),  # the last Answer line
        ("so \\boxed{5}.", "5"),  # no Answer line: the last box
        ("Answer: \\boxed{5} cm", "\\boxed{5} cm"),  # a box inside the line is part of the line
        ("Answer: 4\nthen \\boxed{5}", "5"),  # a box after the Answer line is the later answer
        ("\\boxed{5}\nAnswer: 4", "4"),
        ("\\boxed{5} and \\boxed{6", None),  # the last box is unclosed: a truncated response has no answer
        ("\\boxed{5", None),
        ("Answer: 5}\n\\boxed 6", "5}"),
        ("no final answer", None),
    ],
)
def test_extraction(response, expected):
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "answer, reference, correct",
    [
        # rationals are exact: Fraction arithmetic
        ("0.5", "\\frac{1}{2}", True),
        ("10^{3}", "1000", True),
        ("0.333", "\\frac{1}{3}", False),
        ("0.\\overline{3}", "\\frac{1}{3}", True),
        ("0.1\\overline{6}", "\\frac{1}{6}", True),
        ("2\\frac{1}{2}", "\\frac{5}{2}", True),  # a mixed number
        ("-2\\frac{1}{2}", "-\\frac{5}{2}", True),
        ("1.5e3", "1500", True),
        ("\\sqrt{4}", "2", True),
        ("8^{2/3}", "4", True),
        ("10!", "3628800", True),
        ("\\binom{10}{3}", "120", True),
        ("(10^{6})!", "5", False),  # too big to compute: wrong, and fast
        # a decimal reference: exact, or a non-terminating value that rounds to it at its precision
        ("\\frac{1}{3}", "0.33", True),
        ("\\frac{1}{3}", "0.333", True),
        ("\\frac{2}{3}", "0.67", True),
        ("\\frac{2}{3}", "0.66", False),  # truncated, not rounded
        ("0.333", "0.33", False),  # a terminating prediction must equal the reference
        ("0.331", "0.33", False),
        ("\\frac{1}{8}", "0.13", False),  # 1/8 terminates: 0.125 is not 0.13
        ("\\sqrt{2}", "1.41", True),
        ("\\pi", "3.14", True),
        ("\\pi", "3.15", False),
        ("1.4142", "\\sqrt{2}", False),  # a decimal approximation of an irrational reference
        ("\\frac{99}{70}", "\\sqrt{2}", False),  # a rational cannot equal an irrational
    ],
)
def test_numbers(answer, reference, correct):
    assert _hybrid(answer, reference) is correct


@pytest.mark.parametrize(
    "answer, reference, correct",
    [
        ("(1,2)", "(1, 2)", True),
        ("(2,1)", "(1,2)", False),  # tuple or interval: ordered either way
        ("[1,2]", "(1,2)", False),  # closed is not open
        ("(1,2]", "(1,2)", False),
        ("(1,2]", "(1, 2]", True),
        ("\\{1,2\\}", "(1,2)", False),  # a set is neither a pair nor an interval
        ("1, 2", "(1,2)", False),  # a bare list is a set
        ("\\{2,1\\}", "\\{1,2\\}", True),  # sets ignore order
        ("\\{2,1,2\\}", "\\{1,2\\}", True),  # and repeats
        ("{2, 1}", "1, 2", True),
        ("2, 1", "\\{1,2\\}", True),
        ("\\{5\\}", "5", True),  # one solution, as a set
        ("5, 6", "5", False),
        ("(\\sqrt{8}, 1)", "(2\\sqrt{2}, 1)", True),  # elements compared symbolically
        ("(-\\infty, 3]", "(-\\infty,3]", True),
        ("(-\\infty, 3]", "(\\infty,3]", False),
        ("(1,2,3)", "(1,2)", False),
        ("1 and 2", "1, 2", True),
        ("x = 1 or x = 2", "\\{1, 2\\}", True),
        ("42 or 43", "42", False),  # a hedge is a set of two
    ],
)
def test_sets_intervals_tuples(answer, reference, correct):
    assert _hybrid(answer, reference) is correct


@pytest.mark.parametrize(
    "answer, reference, correct",
    [
        ("x = 5", "5", True),
        ("x=5", "x = 5", True),
        ("f(3) = 5", "5", True),
        ("5", "x = 5", True),
        ("x \\le 5", "5", False),
        ("x <= 5", "5", False),  # not an equation: '<=' is '\le'
        ("41 because 6 \\cdot 7 = 42", "42", False),  # the lhs mixes numbers and words: no split
        ("x = 1, y = 2", "2", False),  # a top-level comma: two answers
        ("x^2 = 4", "x^2+y^2=4", False),  # an equation reference: the whole equation is the answer
        ("y^2 + x^2 = 4", "x^2+y^2=4", True),
        ("4", "x^2+y^2=4", False),
        ("y = 1 + 2x", "y=2x+1", True),  # a variable on the right: an equation too
        ("x = 2x + 1", "y=2x+1", False),
        ("2x+1", "y=2x+1", False),
    ],
)
def test_equations(answer, reference, correct):
    assert _hybrid(answer, reference) is correct


@pytest.mark.parametrize(
    "answer, reference, correct",
    [
        ("5 cm", "5", True),
        ("5", "5 \\text{ cm}", True),
        ("5 \\text{cm}^2", "5", True),
        ("5 sq. ft.", "5", True),
        ("42 apples", "42", True),
        ("42 because", "42", True),  # a trailing word is a unit: it does not change the number
        ("5 cm", "50", False),  # units are not converted
        ("42 thousand", "42", False),
        ("3 halves", "3", False),
        ("5 squared", "5", False),
        ("42 is wrong", "42", False),
        ("42 because 6 * 7 = 42", "42", False),  # judgment call: prose after the answer
        ("approximately 42", "42", False),
        ("42 (approximately)", "42", False),
        ("25\\%", "25", True),  # percent signs dropped, as the DAPO rule does
    ],
)
def test_units_and_trailing_words(answer, reference, correct):
    assert _hybrid(answer, reference) is correct


@pytest.mark.parametrize(
    "answer, reference, correct",
    [
        ("Monday", "Monday", True),
        ("\\text{ MONDAY }", "Monday", True),  # case and spaces ignored
        ("Tuesday", "Monday", False),
        ("no solution", "\\text{no solution}", True),
        ("No solutions", "\\text{no solution}", False),
        ("five", "5", False),  # spelled numbers are text
        ("B", "(B)", True),
        ("\\text{(B)}", "B", True),
        ("(C)", "(B)", False),
        ("AB", "AB", True),  # upper-case names are symbols, compared as math
    ],
)
def test_text_answers(answer, reference, correct):
    assert _hybrid(answer, reference) is correct


@pytest.mark.parametrize(
    "line, reference, correct",
    [
        ("42.", "42", True),
        ("**42**", "42", True),
        ("The final answer is $42$. I hope it is correct.", "42", True),
        ("$\\boxed{42}$", "42", True),
        ("\\boxed{41} or \\boxed{42}", "42", False),
        ("2\\sqrt{2} \\approx 2.83", "2\\sqrt{2}", True),  # the exact value, then an approximation
        ("2.83 \\approx 2\\sqrt{2}", "2\\sqrt{2}", False),
        ("42, 43", "42", False),
        ("4200000000000000000000000000000000000001", "42", False),
        ("9^{9^{9^{9}}}", "81", False),  # too big to compute: wrong, and fast
        ("42} junk {", "42", False),  # unbalanced braces never reach math-verify
    ],
)
def test_junk_on_the_answer_line(line, reference, correct):
    assert _hybrid(line, reference) is correct


@pytest.mark.parametrize("reference", ["", "   ", "\n\t"])
def test_empty_reference_is_wrong_and_never_raises(reference):
    assert hybrid_verify("Answer: 5", reference, timeout_s=None) == VerifyResult(-1.0, False, "5")
    assert math_verify_verify("so \\boxed{5}", reference, timeout_s=None) == VerifyResult(-1.0, False, "5")
    assert math_verify_verify("nothing to see", reference, timeout_s=None) == VerifyResult(-1.0, False, None)
    assert math_verify_verify("Work.\n#### 5", "Work.\n#### " + reference, timeout_s=None).acc is False


def test_hybrid_preds_and_gsm8k_references():
    assert hybrid_verify("Answer: $x = \\frac{1}{2}$.", "0.5", timeout_s=None) == VerifyResult(
        1.0, True, "\\frac{1}{2}"
    )
    assert hybrid_verify("no answer here", "5", timeout_s=None) == VerifyResult(-1.0, False, None)
    assert hybrid_verify("Answer:", "5", timeout_s=None) == VerifyResult(-1.0, False, "")
    assert hybrid_verify("Answer: 1,234", "She has 1,234.\n#### 1,234", timeout_s=None).acc


def test_hybrid_with_its_own_time_limit():
    # The one call here that arms math-verify's SIGALRM (timeout_s=1): the symbolic path under a limit.
    assert hybrid_verify("Answer: \\sqrt{8}", "2\\sqrt{2}", timeout_s=1).acc
