"""The hybrid verifier for DAPO-style answers: the DAPO rule's extraction, exact fast paths, math-verify last.

``hybrid_verify(response, ground_truth)`` takes the final answer out of the response, cleans
it, and compares it with the cleaned reference; the reference is the canonical answer and a
mathematically equal form is correct. The rules, in the order they apply:

Extraction (``extract_final_answer``)
- the text after the last ``Answer:`` up to the end of its line, exactly as ``dapo_verify``;
- or the content of the last ``\\boxed{}``/``\\fbox{}`` when it comes after that line or there is
  no Answer line (a box inside the Answer line is part of the line). A last box left unclosed
  (a truncated response) does not count.

Cleaning (``clean_answer``): what on that line is the answer
- dropped: ``$``, ``\\(``/``\\)``, ``\\left``/``\\right``, markdown ``*``, every
  ``\\boxed{}``/``\\text{}`` wrapper (their content stays), LaTeX spacing, percent and degree
  signs (as DAPO), a lead-in ("the final answer is"), a trailing "I hope it is correct", trailing
  periods, an approximation after ``\\approx``; Unicode minus, ``√``, ``π``, ``∞``, ``×``, ``≤``,
  ``±`` and ``<=`` become their LaTeX forms;
- ``lhs = rhs`` is rhs (the last ``=``) unless the line has a top-level comma or its lhs mixes
  numbers and words ("41 because 6*7 = 42" is not 42). A reference whose lhs is not a name
  (``x^2+y^2=4``) or whose rhs has a variable (``y=2x+1``) is an equation: the prediction must
  be an equal equation;
- words after a number are a unit and dropped ("5 cm", "12 square units", "42 apples", even
  "42 because"), unless a word changes the number (thousand, half, squared, or, not, ...) or
  anything but unit words follows: "42 because 6*7 = 42" and "42, no wait, 41" are prose. A word
  written onto the number with no space leaves it the number only as its ordinal ending (34th)
  or a listed unit abbreviation (34cm); "34abc" is text (tests/data/reward_corpus.jsonl's header);
- digits split by spaces (plain, thin, no-break, ``\\,``, ``~``) are one number only in groups of
  three ("1 000", "12\\,345"); split elsewhere ("3 4", "10 00") they equal nothing; a comma and a
  space part a list ("1, 000" is not 1000);
- 'and'/'or' between answers make a list ("1 and 2", "x = 1 or x = 2"; so "42 or 43" is a set of
  two); ``a \\pm b`` is the set {a+b, a-b}; ``x \\in S`` is S; an inequality in one variable is
  its interval ("1 < x \\le 2" is (1, 2], "x > 3" is (3, \\infty));
- an answer with words that are not a unit (prose, "Monday", "no solution") is a text answer:
  equal only to a reference with the same text, ignoring case and spaces, so prose is wrong.
  Single letters and upper-case names (x, AB) are math symbols, not words.

Comparison, cheapest first
1. equal after ``normalize_answer`` (the DAPO rule's normalisation) -> correct;
2. a choice letter: "(B)" == "B";
3. structure: a top-level comma list, ``{a, b}`` or ``\\{a, b\\}`` is a set (order and repeats
   ignored; a single answer equals a one-element set); ``(a, b)``, ``[a, b]``, ``(a, b]``,
   ``[a, b)`` are ordered (tuple or interval alike): same brackets, equal elements in order.
   So (1,2) != (2,1), (1,2) != [1,2], (1,2) != {1,2} and (1,2) != "1, 2";
4. numbers, evaluated here exactly (Fraction) where possible: rationals compare exactly (0.5 ==
   1/2, 10^{3} == 1000, 1e3 == 1000, \\sqrt{4} == 2, 0.\\overline{3} == 1/3, 0.333 != 1/3;
   ``2\\frac{1}{2}`` is the mixed number 5/2). A decimal reference with k decimals also accepts a
   prediction whose exact value does not terminate (1/3, \\sqrt{2}, \\pi) and rounds to it at k
   decimals: 1/3 for 0.33, \\sqrt{2} for 1.41; never a terminating one (0.331 or 1/8 for 0.33).
   A decimal prediction of an irrational reference is wrong (1.4142 for \\sqrt{2}). Values that
   differ numerically are wrong without sympy; rationals above ~12k digits (power towers) are
   wrong unless the strings are equal; answers with different free variables (x+1 vs y+1, 5 vs
   5x), or whose values differ at a test point (x^2+3x vs x^2+3x+2 at x = 241/29), are wrong
   without sympy;
5. math-verify's parser and symbolic equality on the two answers alone, never the response,
   under ``timeout_s`` (``\\sqrt{8}`` == ``2\\sqrt{2}``, ``(x+1)^2`` == ``x^2+2x+1``). Answers over
   500 characters, nested over 40 levels or with unbalanced braces skip it (wrong).

Units are not converted (5 cm != 50 mm); spelled numbers are text (five != 5). Extraction,
cleaning and structure are in hybrid_parse.py, exact evaluation in hybrid_exact.py, the comparison
here; every function of the three is linear in the response length, as in verifiers.py.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any

from megatron_dapo.reward.answers import VerifyResult, alarm_seconds, verify_result
from megatron_dapo.reward.hybrid_exact import MAX_ANSWER_CHARS, MAX_NESTING, TOO_BIG, Element
from megatron_dapo.reward.hybrid_parse import Answer, clean_answer, extract_final_answer, parse_reference

_MAX_ELEMENTS = 32
_FLOAT_RTOL, _FLOAT_ATOL = 1e-6, 1e-9
"""Float values closer than this may be equal (sympy decides); farther apart they differ, float error or not."""
_TEST_POINTS = 2
_CHOICE_RE = re.compile(r"\(?([A-Z])\)?")
_INFINITIES = {"\\infty": 1, "+\\infty": 1, "-\\infty": -1, "\\inf": 1, "-\\inf": -1, "+\\inf": 1}


def _round_to(value: Any, decimals: int) -> Fraction:
    scale = 10**decimals
    return Fraction(round(Fraction(value) * scale), scale)


def _terminates(x: Fraction) -> bool:
    """True when x has a finite decimal expansion (its denominator has no prime but 2 and 5)."""
    den = x.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def _numeric_decision(pred: Element, gold: Element) -> bool | None:
    """The rules of step 4 of the module docstring; None when only symbolic algebra can tell."""
    p, g = pred.value, gold.value
    if p is TOO_BIG or g is TOO_BIG:
        return False
    if p is None or g is None:
        return None
    k = gold.decimals
    if isinstance(p, Fraction) and isinstance(g, Fraction):
        if p == g:
            return True
        return k is not None and pred.decimals is None and not _terminates(p) and _round_to(p, k) == g
    if isinstance(g, Fraction) and k is not None:
        return _round_to(p, k) == g  # an irrational prediction of a decimal reference
    if pred.decimals is not None and isinstance(g, float):
        return False  # a decimal approximation of an irrational reference
    try:
        close = math.isclose(float(p), float(g), rel_tol=_FLOAT_RTOL, abs_tol=_FLOAT_ATOL)
    except OverflowError:
        return False  # a rational beyond the float range cannot equal a (finite) irrational value
    return None if close else False


def _differ(p: Any, g: Any) -> bool:
    """True when two values at the same test point are certainly different (exactly, or well beyond float error)."""
    if p is None or g is None or p is TOO_BIG or g is TOO_BIG:
        return False
    if isinstance(p, Fraction) and isinstance(g, Fraction):
        return p != g
    try:
        return not math.isclose(float(p), float(g), rel_tol=_FLOAT_RTOL, abs_tol=_FLOAT_ATOL)
    except OverflowError:
        return True


def _balanced_depth(text: str) -> int:
    """The deepest bracket nesting of text, or -1 when its brackets do not balance."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return -1
    return deepest if depth == 0 else -1


@functools.cache
def _latex_only() -> list:
    from math_verify import LatexExtractionConfig  # sympy takes ~1 s to import: only scoring processes pay it

    return [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]


@functools.lru_cache(maxsize=4096)
def _parse(text: str, secs: int | None) -> tuple:
    """math-verify's parse of one answer (16 responses share a reference; many share an answer)."""
    from math_verify import parse

    return tuple(parse("\\boxed{" + text + "}", _latex_only(), fallback_mode="no_fallback", parsing_timeout=secs))


@functools.lru_cache(maxsize=4096)
def _symbolic_equal(pred: str, gold: str, secs: int | None) -> bool:
    """math-verify on the two answers alone; unbalanced braces could close the \\boxed{} early, so they are wrong.

    Cached: a prompt's responses often repeat one answer."""
    from math_verify import verify

    for text in (pred, gold):
        if len(text) > MAX_ANSWER_CHARS or not 0 <= _balanced_depth(text) <= MAX_NESTING:
            return False
    gold_parsed, pred_parsed = _parse(gold, secs), _parse(pred, secs)
    return bool(gold_parsed and pred_parsed and verify(list(gold_parsed), list(pred_parsed), timeout_seconds=secs))


def _scalar_equal(pred: Element, gold: Element, secs: int | None) -> bool:
    if pred.norm == gold.norm:
        return True
    if pred.norm in _INFINITIES or gold.norm in _INFINITIES:
        return _INFINITIES.get(pred.norm) == _INFINITIES.get(gold.norm)
    decision = _numeric_decision(pred, gold)
    if decision is not None:
        return decision
    if pred.variables != gold.variables:
        return False  # different free variables: not the same expression (and sympy need not expand it)
    if pred.variables and any(_differ(pred.value_at(k), gold.value_at(k)) for k in range(_TEST_POINTS)):
        return False  # two expressions that differ at a point differ: no sympy needed to say so
    return _symbolic_equal(pred.text, gold.text, secs)


def _answers_equal(pred: Answer, gold: Answer, secs: int | None) -> bool:
    """The comparison of the module docstring, steps 1-5."""
    if pred.malformed or gold.malformed:
        return False
    if pred.is_text or gold.is_text:
        return pred.text_key == gold.text_key
    if gold.is_equation:  # 'x^2+y^2=4', 'y=2x+1': the whole equation is the answer
        whole_pred, whole_gold = Element(pred.whole), Element(gold.whole)
        if whole_pred.norm == whole_gold.norm:
            return True
        return "=" in whole_pred.norm and _symbolic_equal(whole_pred.text, whole_gold.text, secs)
    if pred.norm == gold.norm:
        return True
    choices = _CHOICE_RE.fullmatch(pred.norm), _CHOICE_RE.fullmatch(gold.norm)
    if choices[0] and choices[1]:
        return choices[0].group(1) == choices[1].group(1)
    if len(pred.text) > MAX_ANSWER_CHARS:
        return False
    (p_kind, p_items), (g_kind, g_items) = pred.structure, gold.structure
    if p_kind == g_kind == "scalar":
        return _scalar_equal(p_items[0], g_items[0], secs)
    if len(p_items) > _MAX_ELEMENTS or len(g_items) > _MAX_ELEMENTS:
        return False
    unordered = ("scalar", "set")
    if p_kind in unordered and g_kind in unordered:

        @functools.cache
        def equal(i: int, j: int) -> bool:
            return _scalar_equal(p_items[i], g_items[j], secs)

        return all(any(equal(i, j) for j in range(len(g_items))) for i in range(len(p_items))) and all(
            any(equal(i, j) for i in range(len(p_items))) for j in range(len(g_items))
        )
    if p_kind != g_kind or len(p_items) != len(g_items):
        return False
    return all(_scalar_equal(p, g, secs) for p, g in zip(p_items, g_items))


def hybrid_verify(response: str, ground_truth: str, timeout_s: float | None = 5.0) -> VerifyResult:
    """+1 when the response's final answer equals the reference by the rules of the module docstring.

    response: the decoded model output; ground_truth: the reference ('34', '\\frac{1}{2}', '(1, 2]',
    GSM8K '... #### 34'). Returns VerifyResult(score ±1, acc, pred=the cleaned answer, or None when
    the response has no final answer). An empty reference scores every response wrong.
    timeout_s: math-verify's SIGALRM limit per parse/compare (whole seconds, main thread only);
    None disables it, the caller then bounds time (the reward pool does).
    """
    raw = extract_final_answer(response)
    if raw is None:
        return verify_result(False, None)
    pred = clean_answer(raw)
    gold = parse_reference(ground_truth)
    if not pred.text or gold is None:
        return verify_result(False, pred.text)
    return verify_result(_answers_equal(pred, gold, alarm_seconds(timeout_s)), pred.text)
