"""Answer text: the result every verifier returns, and the primitives that find and normalise a final answer.

Shared by the verifiers (verifiers.py: the DAPO rule and math-verify; hybrid*.py: the hybrid verifier). Every
function here is linear in the text's length: the regexes are written so they cannot backtrack catastrophically,
and braces are matched in one pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

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


def verify_result(correct: bool, pred: str | None) -> VerifyResult:
    return VerifyResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


# --------------------------------------------------------------------------- the final answer

# Lookahead only: finds every "answer" followed by a colon, overlapping ones included.
_ANSWER_HEAD_RE = re.compile(r"answer(?=\s*:)", re.IGNORECASE)
# The answer may sit on the line after 'Answer:'; the whitespace classes are disjoint so matching is linear.
ANSWER_RE = re.compile(r"answer\s*:[ \t\r]*(?:\n[ \t\r]*)*([^\n]*)", re.IGNORECASE)

BOX_HEAD_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_HEAD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])")
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
THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# No two adjacent sub-patterns can match the same digits, so a failed match costs O(n), not O(n^2).
_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_MAX_NUMBER_CHARS = 400
_FAST_PATH_COLONS = 64
_FAST_PATH_SPACES = 64

SIMPLE_SUBSTITUTIONS = (
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
    heads = list(BOX_HEAD_RE.finditer(s))
    if not heads:
        return s
    head = heads[-1]
    close = _match_braces(s).get(head.end() - 1)
    # An unclosed box (a truncated response) keeps everything after its opening brace.
    return s[head.end() : close] if close is not None else s[head.end() :]


def unwrap_commands(s: str, heads_re: re.Pattern[str] = _TEXT_HEAD_RE) -> str:
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
    for before, after in SIMPLE_SUBSTITUTIONS:
        s = s.replace(before, after)
    s = LEFT_RIGHT_RE.sub("", s)
    s = unwrap_commands(s)
    s = _UNIT_RE.sub("", s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_BRACE_DIGIT_RE.sub(r"\\frac\1{\2}", s)
    s = _FRAC_DIGIT_BRACE_RE.sub(r"\\frac{\1}{", s)
    s = _SQRT_DIGIT_RE.sub(r"\\sqrt{\1}", s)
    s = _strip_outer_braces(s)
    if THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s


def numbers_equal(a: str, b: str) -> bool:
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


def last_answer_start(response: str) -> int | None:
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
    start = last_answer_start(response)
    if start is None:
        return None
    m = ANSWER_RE.match(response, start)
    return m.group(1) if m else None


def gsm8k_answer(text: str) -> str:
    """The GSM8K answer of a gold string: the text after the last '####', commas removed."""
    return text.rsplit("####", 1)[-1].strip().replace(",", "")


def alarm_seconds(timeout_s: float | None) -> int | None:
    # math-verify arms signal.alarm(), which takes whole seconds.
    return None if timeout_s is None else max(1, math.ceil(timeout_s))
