"""Rule-based answer verifiers: pure functions from (response, ground_truth) to a VerifyResult.

- ``dapo_verify``: the DAPO-Math-17K rule. The last ``Answer: ...`` in the response is
  normalised (in the spirit of Minerva's ``normalize_final_answer``) and compared with the
  normalised gold as strings, or as numbers when both are plain numbers.
- ``math_verify_verify``: Hugging Face math-verify 0.9.0 (LaTeX / boxed answers), with
  GSM8K-style ``#### N`` golds and responses.
- ``hybrid_verify`` (hybrid.py): the DAPO rule's extraction, exact rational comparison, then
  math-verify on the extracted answer alone; the default for DAPO data.
- ``select_verifier``: the config's ``reward.verifier`` -> one of those, or a user function.

Every function here is linear in the response length: the regexes are written so they
cannot backtrack catastrophically, and braces are matched in one pass.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

from megatron_dapo.choices import VERIFIER_NAMES

Verifier = Callable[[str, str], "VerifyResult"]


@dataclass
class VerifyResult:
    """One verified response."""

    score: float
    """+1.0 when the answer is correct, -1.0 otherwise (a user verifier may return other values)."""
    acc: bool
    """Raw correctness, kept apart from any shaping of the score."""
    pred: str | None
    """The answer extracted from the response (normalised for dapo); None when none was found."""


def _result(correct: bool, pred: str | None) -> VerifyResult:
    return VerifyResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


# --------------------------------------------------------------------------- DAPO verifier

# Lookahead only: finds every "answer" followed by a colon, overlapping ones included.
_ANSWER_HEAD_RE = re.compile(r"answer(?=\s*:)", re.IGNORECASE)
# The answer may sit on the line after 'Answer:'; the whitespace classes are disjoint so matching is linear.
_ANSWER_RE = re.compile(r"answer\s*:[ \t\r]*(?:\n[ \t\r]*)*([^\n]*)", re.IGNORECASE)

_BOX_HEAD_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_HEAD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])")
# A unit word not inside a longer word or a LaTeX command ('\times', '\sec'), with an optional ^2 / ^3.
_UNIT_RE = re.compile(
    r"(?<![A-Za-z\\])(?:degrees?|units?|sq(?:uare)?|cubic|cm|centimeters?|mm|millimeters?|meters?|km|kilometers?|inch(?:es)?"
    r"|feet|foot|ft|yards?|miles?|mph|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?"
    r"|dollars?|cents?|points?|ways?|students?|people|pounds?|lbs?|kg|grams?|liters?|ml|edges?|digits?"
    r"|integers?|numbers?|times)(?![A-Za-z])(?:\^\{?[23]\}?)?"
)
_FRAC_DIGITS_RE = re.compile(r"\\frac(\d)(\d)")
_FRAC_BRACE_DIGIT_RE = re.compile(r"\\frac(\{[^{}]*\})(\d)")
_FRAC_DIGIT_BRACE_RE = re.compile(r"\\frac(\d)\{")
_SQRT_DIGIT_RE = re.compile(r"\\sqrt(\d)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# No two adjacent sub-patterns can match the same digits, so a failed match costs O(n), not O(n^2).
_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_MAX_NUMBER_CHARS = 400
_FAST_PATH_COLONS = 64
_FAST_PATH_SPACES = 64

_SIMPLE_SUBSTITUTIONS = (
    ("\\$", ""),
    ("$", ""),
    ("\u2212", "-"),  # the Unicode minus sign
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\circ", ""),
    ("\\%", ""),
    ("%", ""),
    ("{,}", ","),
    (",\\!", ","),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\ ", " "),
    ("\\ldots", ""),
    ("\\dots", ""),
)


def _match_braces(s: str) -> dict[int, int]:
    """Index of each '{' -> index of its matching '}' (unmatched opens are absent). One pass."""
    match: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(s):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            match[stack.pop()] = i
    return match


def _unwrap_last_box(s: str) -> str:
    """The content of the last \\boxed{...} / \\fbox{...} in s, or s itself when there is none."""
    heads = list(_BOX_HEAD_RE.finditer(s))
    if not heads:
        return s
    head = heads[-1]
    close = _match_braces(s).get(head.end() - 1)
    # An unclosed box (a truncated response) keeps everything after its opening brace.
    return s[head.end() : close] if close is not None else s[head.end() :]


def _unwrap_commands(s: str, heads_re: re.Pattern[str] = _TEXT_HEAD_RE) -> str:
    """Replace every \\text{X}-like command (or what heads_re finds) by X (nesting allowed), in one pass over s."""
    heads = {m.start(): m.end() for m in heads_re.finditer(s)}
    if not heads:
        return s
    out: list[str] = []
    stack: list[bool] = []  # per open brace: True when it belongs to an unwrapped command
    i, n = 0, len(s)
    while i < n:
        end = heads.get(i)
        if end is not None:
            stack.append(True)
            i = end
            continue
        ch = s[i]
        if ch == "{":
            stack.append(False)
        elif ch == "}" and stack and stack.pop():
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _strip_outer_braces(s: str) -> str:
    """'{x}' -> 'x' while one brace pair encloses the whole string."""
    match = _match_braces(s)
    i, j = 0, len(s) - 1
    while i < j and s[i] == "{" and match.get(i) == j:
        i, j = i + 1, j - 1
    return s[i : j + 1]


def normalize_answer(answer: str, *, split_equations: bool = True) -> str:
    """Canonical string form of a final answer, for exact comparison.

    Unwraps \\boxed{}/\\text{}, drops $, \\left/\\right, degree signs, percent signs, LaTeX
    spacing, simple unit words and all whitespace, keeps what follows the last '=' (unless
    split_equations is False), maps \\dfrac/\\tfrac to \\frac, expands \\frac12 and \\sqrt2, removes
    thousands separators ('1,000' -> '1000') and a trailing period. Linear time in len(answer).
    """
    s = answer.strip()
    if len(s) < _MAX_NUMBER_CHARS and _NUMBER_RE.fullmatch(s):
        return s  # the common case, a plain number: nothing to normalise
    s = s.strip("*").strip()  # '**Answer:** 5' leaves markdown bold around the answer
    s = _unwrap_last_box(s)
    if split_equations:
        s = s.split("=")[-1]
    for before, after in _SIMPLE_SUBSTITUTIONS:
        s = s.replace(before, after)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _unwrap_commands(s)
    s = _UNIT_RE.sub("", s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_BRACE_DIGIT_RE.sub(r"\\frac\1{\2}", s)
    s = _FRAC_DIGIT_BRACE_RE.sub(r"\\frac{\1}{", s)
    s = _SQRT_DIGIT_RE.sub(r"\\sqrt{\1}", s)
    s = _strip_outer_braces(s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s


def _numbers_equal(a: str, b: str) -> bool:
    """True when both strings are plain decimal numbers with the same value ('5.0' == '5')."""
    if len(a) > _MAX_NUMBER_CHARS or len(b) > _MAX_NUMBER_CHARS:
        return False
    if not (_NUMBER_RE.fullmatch(a) and _NUMBER_RE.fullmatch(b)):
        return False
    try:
        # Decimal, not float: 20-digit integers that differ in the last digit stay different.
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def _last_answer_start(response: str) -> int | None:
    """Index of the last 'answer' (any case) followed by optional whitespace and ':', or None."""
    end = len(response)
    # Fast path (~1 us): look back from the last few colons; anything unusual goes to the regex scan.
    for _ in range(_FAST_PATH_COLONS):
        colon = response.rfind(":", 0, end)
        if colon < 0:
            return None
        j = colon
        while j > 0 and colon - j < _FAST_PATH_SPACES and response[j - 1].isspace():
            j -= 1
        if j > 0 and response[j - 1].isspace():
            break  # a long whitespace run: let the regex walk it
        if j >= 6 and response[j - 6 : j].lower() == "answer":
            return j - 6
        end = colon
    last = None
    for match in _ANSWER_HEAD_RE.finditer(response, 0, end + 1):
        last = match
    return last.start() if last else None


def extract_dapo_answer(response: str) -> str | None:
    """The raw text after the last 'Answer:' (case-insensitive) up to the end of its line, or None."""
    start = _last_answer_start(response)
    if start is None:
        return None
    m = _ANSWER_RE.match(response, start)
    return m.group(1) if m else None


# A prompt's G responses share one gold: normalise it once.
_normalize_gold = functools.lru_cache(maxsize=4096)(normalize_answer)


def dapo_verify(response: str, ground_truth: str) -> VerifyResult:
    """DAPO-Math-17K: +1 when the last 'Answer: X' line's X equals the gold after normalisation.

    response: the decoded model output; ground_truth: the reference answer (e.g. '34').
    Returns VerifyResult(score ±1, acc, pred=normalised X or None when no 'Answer:' line).
    """
    raw = extract_dapo_answer(response)
    if raw is None:
        return _result(False, None)
    pred = normalize_answer(raw)
    gold = _normalize_gold(ground_truth)
    correct = bool(pred) and (pred == gold or _numbers_equal(pred, gold))
    return _result(correct, pred)


# --------------------------------------------------------------------------- math-verify

_GSM8K_ANSWER_RE = re.compile(r"####[ \t]*\$?[ \t]*([+-]?\d[\d,]*(?:\.\d+)?)")


def gsm8k_answer(text: str) -> str:
    """The GSM8K answer of a gold string: the text after the last '####', commas removed."""
    return text.rsplit("####", 1)[-1].strip().replace(",", "")


def _gsm8k_prediction(response: str) -> str | None:
    """The number after the last '#### ' in a response, commas removed, or None."""
    last = None
    for match in _GSM8K_ANSWER_RE.finditer(response):
        last = match
    return last.group(1).replace(",", "") if last else None


def _alarm_seconds(timeout_s: float | None) -> int | None:
    # math-verify arms signal.alarm(), which takes whole seconds.
    return None if timeout_s is None else max(1, math.ceil(timeout_s))


def _first_string(parsed: list[Any]) -> str | None:
    # parse() returns [sympy_expr, matched_text]; str() of a huge sympy expression can hang, the text cannot.
    for item in parsed:
        if isinstance(item, str):
            return item
    return None


def math_verify_verify(response: str, ground_truth: str, timeout_s: float | None = 5.0) -> VerifyResult:
    """Verify with math-verify 0.9.0: +1 when the response's answer is mathematically equal to the gold.

    Gold: LaTeX, a bare expression ('0.5', '\\frac{1}{2}') or GSM8K ('... #### 1,234' -> '1234');
    an empty (or whitespace) gold scores every response wrong.
    Prediction: the number after the response's last '#### ' when present, else what
    math-verify extracts (the last \\boxed{}, else the last LaTeX / plain expression).
    timeout_s: math-verify's own SIGALRM limit per parse/compare (rounded up to whole seconds;
    only works in a process's main thread); None disables it, the caller then bounds time.
    Raises ValueError when math-verify cannot parse a non-empty gold.
    """
    from math_verify import parse, verify  # sympy takes ~1 s to import: only scoring processes pay it

    secs = _alarm_seconds(timeout_s)
    gsm8k_pred = _gsm8k_prediction(response)
    pred = parse(gsm8k_pred if gsm8k_pred is not None else response, parsing_timeout=secs)
    gold_text = gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth.strip()
    if not gold_text:
        return _result(False, _first_string(pred))
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"  # math-verify's LaTeX extractor needs a delimiter
    gold = parse(gold_text, parsing_timeout=secs)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth[:200]!r}")
    if not pred:
        return _result(False, None)
    correct = verify(gold, pred, timeout_seconds=secs)
    return _result(bool(correct), _first_string(pred))


# --------------------------------------------------------------------------- selection


def _coerce_user_result(value: Any) -> VerifyResult:
    """A user verifier's VerifyResult | bool | float -> VerifyResult (acc = score > 0 for numbers)."""
    if isinstance(value, VerifyResult):
        score = float(value.score)
        acc, pred = bool(value.acc), value.pred
    elif isinstance(value, bool):
        return _result(value, None)
    elif isinstance(value, (int, float)):
        score = float(value)
        acc, pred = score > 0, None
    else:
        raise TypeError(f"a verifier must return VerifyResult, bool or float, got {type(value).__name__}")
    if not math.isfinite(score):
        raise ValueError(f"verifier returned a non-finite score {score}")
    return VerifyResult(score=score, acc=acc, pred=None if pred is None else str(pred))


def _bad_verifier(configured: str, problem: str) -> ValueError:
    return ValueError(
        f"config field reward.verifier={configured!r}: {problem}; expected one of {VERIFIER_NAMES} "
        "or a user function 'package.module:function'"
    )


@functools.lru_cache(maxsize=None)
def _load_user_verifier(configured: str) -> Verifier:
    """'package.module:function' -> a wrapped callable returning VerifyResult. Raises ValueError."""
    module_name, _, attr = configured.partition(":")
    if not module_name or not attr:
        raise _bad_verifier(configured, "a user function needs both a module and a function name")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config problem to report
        raise _bad_verifier(configured, f"cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise _bad_verifier(configured, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise _bad_verifier(configured, f"{attr!r} in module {module_name!r} is not callable")

    @functools.wraps(fn)
    def user_verifier(response: str, ground_truth: str) -> VerifyResult:
        return _coerce_user_result(fn(response, ground_truth))

    return user_verifier


def select_verifier(data_source: str, configured: str, *, math_verify_timeout_s: float | None = 5.0) -> Verifier:
    """The verifier for one row: (response, ground_truth) -> VerifyResult.

    configured: reward.verifier, i.e. 'dapo', 'math_verify', 'hybrid', 'auto' (hybrid when 'dapo'
    is in data_source, e.g. DAPO-Math-17K's 'math_dapo', else math_verify) or 'package.module:function'.
    math_verify_timeout_s: passed to math_verify_verify and hybrid_verify (None when the caller
    bounds time itself).
    Raises ValueError naming reward.verifier for an unknown name or an unimportable function.
    """
    if configured == "auto":
        configured = "hybrid" if "dapo" in (data_source or "").lower() else "math_verify"
    if configured == "dapo":
        return dapo_verify
    if configured == "math_verify":
        return functools.partial(math_verify_verify, timeout_s=math_verify_timeout_s)
    if configured == "hybrid":
        from megatron_dapo.reward.hybrid import hybrid_verify  # hybrid.py builds on this module

        return functools.partial(hybrid_verify, timeout_s=math_verify_timeout_s)
    if ":" in configured:
        return _load_user_verifier(configured)
    raise _bad_verifier(configured, "unknown verifier name")
