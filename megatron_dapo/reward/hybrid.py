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
  anything but unit words follows: "42 because 6*7 = 42" and "42, no wait, 41" are prose;
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

Units are not converted (5 cm != 50 mm); spelled numbers are text (five != 5). Every function
here is linear in the response length, as in verifiers.py.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from megatron_dapo.reward.verifiers import (
    _ANSWER_RE,
    _BOX_HEAD_RE,
    _LEFT_RIGHT_RE,
    _SIMPLE_SUBSTITUTIONS,
    _THOUSANDS_RE,
    VerifyResult,
    _alarm_seconds,
    _last_answer_start,
    _result,
    _unwrap_commands,
    gsm8k_answer,
    normalize_answer,
)

_MAX_ANSWER_CHARS = 500
"""Longer answers are compared as normalised strings only: no reference is that long, and sympy on it is slow."""
_MAX_NESTING = 40
_MAX_ELEMENTS = 32
_MAX_BITS = 40_000
"""Exact powers stop at ~12k digits: 9^{9^{9}} is not computed, it is just wrong."""
_MAX_ROOT = 64
_FLOAT_RTOL, _FLOAT_ATOL = 1e-6, 1e-9
"""Float values closer than this may be equal (sympy decides); farther apart they differ, float error or not."""
_TEST_POINTS = 2

_UNICODE = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\u221a": "\\sqrt",
        "\u03c0": "\\pi ",
        "\u221e": "\\infty ",
        "\u00d7": "\\times ",
        "\u00b7": "\\cdot ",
        "\u22c5": "\\cdot ",
        "\u00f7": "\\div ",
        "\u2264": "\\le ",
        "\u2265": "\\ge ",
        "\u2260": "\\ne ",
        "\u2248": "\\approx ",
        "\u00b1": "\\pm ",
        "\u00b0": "",  # degree sign
    }
)
_RELATIONS = (("<=", " \\le "), (">=", " \\ge "), ("!=", " \\ne "))
# Anchored, and every part is optional or literal, so a failed attempt is linear.
_LEAD_IN_RE = re.compile(
    r"(?:(?:so|thus|therefore|hence)\b[,\s]*)?(?:the\s+)?(?:final\s+)?answer\s*(?:is\b)?[\s:]*", re.IGNORECASE
)
_HOPE_SUFFIX = "i hope it is correct"
# A word: two or more letters not inside a LaTeX command name.
_WORD_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}")
# Written without a backslash these are still mathematics: sqrt(2), 2pi, log(8).
_MATH_WORDS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt pi max min gcd lcm mod".split()
)
# After a number, words that change it or hedge it are not a unit.
_NOT_UNIT_WORDS = frozenset(
    "hundred hundreds thousand thousands million millions billion billions trillion dozen dozens half halves "
    "third thirds quarter quarters fourth fourths fifth fifths tenth tenths hundredth hundredths thousandth "
    "squared cubed not no wrong incorrect false never except or and plus minus times less more fewer greater "
    "smaller larger over under above below about approximately approx roughly nearly almost around least most "
    "than maybe probably either".split()
)
# Unit words, spaces and a ^2 / ^3; the two parts start with different characters, so matching is linear.
_UNIT_TAIL_RE = re.compile(r"[A-Za-z\s/.]*(?:\^\{?[23]\}?[A-Za-z\s/.]*)*")
_SUBSCRIPT_RE = re.compile(r"_(?:\{[^{}]*\}|\w)")
_CHOICE_RE = re.compile(r"\(?([A-Z])\)?")
_DECIMAL_RE = re.compile(r"[+-]?\d*\.(\d+)")
_SEPARATOR_WORDS = frozenset(("and", "or"))
_MAX_EXPONENT = 4000
_MEMBER_RE = re.compile(r"\s*[A-Za-z]\s*\\in(?![A-Za-z])")
_RELATION_RE = re.compile(r"\\(?:leq?|geq?|lt|gt)(?![A-Za-z])|[<>]")
_VARIABLE_RE = re.compile(r"[A-Za-z]")
# What 'x =' may name: x, x_1, f(3), AB, \angle ABC, [ABC], or words ('the area').
_NAME_RE = re.compile(r"(?:\\angle\s*)?[A-Za-z]{1,4}(?:_\{?\w+\}?)?(?:\([^()=]*\))?|\[[A-Z]{2,4}\]|[A-Za-z ]+")
_PLUS_MINUS_RE = re.compile(r"\\pm(?![A-Za-z])")
_LETTERS_RE = re.compile(r"\\?[A-Za-z]+")
_CONSTANT_LETTERS = frozenset("ei")
_INFINITIES = {"\\infty": 1, "+\\infty": 1, "-\\infty": -1, "\\inf": 1, "-\\inf": -1, "+\\inf": 1}
# Disjoint first characters (space, digit or '.', backslash or letter, anything else): linear.
_TOKEN_RE = re.compile(r"\s+|((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)|(\\[A-Za-z]+|[A-Za-z]+)|(\\[{}]|\S)")
_OPENERS = {"(": ")", "{": "}", "[": "]"}


# --------------------------------------------------------------------------- extraction


def _last_closed_box(response: str) -> tuple[int, int, int] | None:
    """(start of '\\boxed', start of content, index of its '}') of the last box, or None (none, or unclosed)."""
    start = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if start < 0:
        return None
    head = _BOX_HEAD_RE.match(response, start)
    if head is None:  # '\boxed 5' or '\boxedx': look for the last well-formed head instead
        heads = list(_BOX_HEAD_RE.finditer(response))
        if not heads:
            return None
        head = heads[-1]
    depth = 0
    for i in range(head.end(), len(response)):
        ch = response[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return head.start(), head.end(), i
            depth -= 1
    return None


def extract_final_answer(response: str) -> str | None:
    """The raw final answer: the last 'Answer:' line, or the last \\boxed{} after it (or without one); None when
    there is neither, or when the last box is unclosed and there is no Answer line before it."""
    start = _last_answer_start(response)
    line = _ANSWER_RE.match(response, start) if start is not None else None
    box = _last_closed_box(response)
    if box is not None and (line is None or box[0] >= line.end()):
        return response[box[1] : box[2]]
    return line.group(1) if line else None


# --------------------------------------------------------------------------- cleaning


def _top_level(s: str) -> tuple[int, bool]:
    """(index of the last '=' outside brackets or -1, whether a ',' sits outside brackets)."""
    depth, last_eq, comma = 0, -1, False
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            if ch == "=":
                last_eq = i
            elif ch == ",":
                comma = True
    return last_eq, comma


def _words(s: str) -> list[re.Match]:
    """Words that are neither mathematics (sqrt, pi) nor upper-case point and segment names (AB, ABC)."""
    return [m for m in _WORD_RE.finditer(s) if m.group().lower() not in _MATH_WORDS and not m.group().isupper()]


def _strip_wrappers(raw: str) -> str:
    """The answer text without delimiters, wrappers, lead-in and trailing period (see the module docstring)."""
    s = raw.translate(_UNICODE)
    for before, after in _RELATIONS:
        s = s.replace(before, after)
    s = _unwrap_commands(s, _BOX_HEAD_RE)
    for before, after in _SIMPLE_SUBSTITUTIONS:
        s = s.replace(before, after)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _unwrap_commands(s)
    s = s.strip().strip("*").strip()
    lead = _LEAD_IN_RE.match(s)
    if lead and lead.end() > 0:
        s = s[lead.end() :]
    s = s.rstrip(". ")
    if s.lower().endswith(_HOPE_SUFFIX):
        s = s[: -len(_HOPE_SUFFIX)].rstrip(" .,;")
    return s.strip("* ")


@dataclass
class _Answer:
    """A cleaned answer: `text` keeps its spaces (math-verify needs them); `is_text` marks a text answer;
    `whole` is the text before 'x =' was dropped, `is_equation` marks a reference whose '=' is part of the answer."""

    text: str
    is_text: bool
    whole: str = ""
    is_equation: bool = False

    @functools.cached_property
    def norm(self) -> str:
        return normalize_answer(self.text, split_equations=False)  # clean_answer already kept what counts

    @functools.cached_property
    def text_key(self) -> str:
        return "".join(self.text.split()).lower()

    @functools.cached_property
    def structure(self) -> tuple[str, list[_Element]]:
        kind, parts = _structure(self.text)
        return kind, [_Element(_split_equation(p)[1]) for p in parts]


def _split_equation(s: str) -> tuple[str | None, str]:
    """'x = 5' -> ('x', '5'): the sides of the last top-level '='; (None, s) when there is none, when there
    is a top-level comma, or when the left side mixes words and numbers ('41 because 6*7 = 42')."""
    eq, comma = _top_level(s)
    if eq < 0 or comma:
        return None, s
    lhs = s[:eq].strip()
    if _words(lhs) and any(ch.isdigit() for ch in _SUBSCRIPT_RE.sub("", lhs)):
        return None, s
    return lhs, s[eq + 1 :].strip()


def _as_interval(s: str) -> str:
    """'x \\in S' -> 'S'; an inequality in one variable -> its interval: '1 < x \\le 2' -> '(1, 2]',
    'x > 3' -> '(3, \\infty)'. Anything else is returned unchanged."""
    member = _MEMBER_RE.match(s)
    if member:
        return s[member.end() :].strip()
    relations = list(_RELATION_RE.finditer(s))
    if not 1 <= len(relations) <= 2:
        return s
    bounds = [0] + [i for m in relations for i in (m.start(), m.end())] + [len(s)]
    parts = [s[a:b].strip() for a, b in zip(bounds[::2], bounds[1::2])]
    less = [m.group() in ("<", "\\le", "\\leq", "\\lt") for m in relations]
    strict = [m.group() in ("<", ">", "\\lt", "\\gt") for m in relations]
    variables = [i for i, part in enumerate(parts) if _VARIABLE_RE.fullmatch(part)]
    if not all(parts) or len(variables) != 1:
        return s
    if len(parts) == 3:
        if variables != [1] or less[0] != less[1]:
            return s
        (lo, lo_strict), (hi, hi_strict) = (parts[0], strict[0]), (parts[2], strict[1])
        if not less[0]:
            (lo, lo_strict), (hi, hi_strict) = (hi, hi_strict), (lo, lo_strict)
    else:
        bound = parts[1 - variables[0]]
        upper = less[0] == (variables[0] == 0)  # x < b, or b > x: b is an upper bound
        lo, lo_strict, hi, hi_strict = (
            ("-\\infty", True, bound, strict[0]) if upper else (bound, strict[0], "\\infty", True)
        )
    return f"{'(' if lo_strict else '['}{lo}, {hi}{')' if hi_strict else ']'}"


def clean_answer(raw: str) -> _Answer:
    """Apply the cleaning rules of the module docstring to a raw final answer."""
    whole = _strip_wrappers(raw).split("\\approx")[0].strip()
    lhs, rhs = _split_equation(whole)
    answer = _classify(rhs)
    answer.whole = whole
    answer.is_equation = lhs is not None and (not _NAME_RE.fullmatch(lhs) or bool(_Element(rhs).variables))
    return answer


def _classify(s: str) -> _Answer:
    """A math or text answer, with a unit dropped, 'and'/'or' lists and inequalities rewritten (module docstring)."""
    words = _words(s)
    if words and all(w.group().lower() in _SEPARATOR_WORDS for w in words):
        # '1 and 2', 'x = 1 or x = 2': a list of answers (a hedge '42 or 43' is then a wrong set)
        bounds = [0] + [i for w in words for i in (w.start(), w.end())] + [len(s)]
        s = ", ".join(s[a:b].strip().rstrip(",").strip() for a, b in zip(bounds[::2], bounds[1::2]))
        return _Answer(s, is_text=False)
    if not words:
        return _Answer(_as_interval(s), is_text=False)
    head, tail = s[: words[0].start()].rstrip(), s[words[0].start() :]
    if (
        any(ch.isdigit() or ch == "\\" for ch in head)
        and _UNIT_TAIL_RE.fullmatch(tail)
        and not any(w.group().lower() in _NOT_UNIT_WORDS for w in words)
    ):
        return _Answer(head, is_text=False)
    return _Answer(s, is_text=True)


@functools.lru_cache(maxsize=4096)
def _reference(ground_truth: str) -> _Answer | None:
    """The cleaned reference (a prompt's 16 responses share it), or None when it is empty."""
    text = gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth
    answer = clean_answer(text)
    return answer if answer.text else None


# --------------------------------------------------------------------------- structures


def _encloses(s: str, begin: int, end: int) -> bool:
    """True when s[begin:end] has balanced brackets, i.e. s's first bracket closes at its last."""
    depth = 0
    for i in range(begin, end):
        ch = s[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _split_commas(s: str) -> list[str]:
    """s split at the commas outside brackets, each part stripped."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    parts.append(s[start:].strip())
    return parts


def _structure(text: str) -> tuple[str, list[str]]:
    """('scalar', [text]) | ('set', elements) | (brackets like '()' or '(]', elements); a bare list is a set."""
    s = text.strip()
    if _THOUSANDS_RE.fullmatch("".join(s.split())):
        return "scalar", [s]
    kind, inner = "set", s
    if s.startswith("\\{") and s.endswith("\\}") and _encloses(s, 2, len(s) - 2):
        inner = s[2:-2]
    elif s[:1] == "{" and s[-1:] == "}" and _encloses(s, 1, len(s) - 1):
        inner = s[1:-1]
    elif s[:1] in "([" and s[-1:] in ")]" and _encloses(s, 1, len(s) - 1):
        kind, inner = s[0] + s[-1], s[1:-1]
    parts = _split_commas(inner)
    if len(parts) == 1 and (kind != "set" or inner is s):  # '(5)' is a parenthesised number, not a 1-tuple
        signs = list(_PLUS_MINUS_RE.finditer(s))
        if len(signs) == 1 and kind == "set":  # 'a \\pm b' is the set {a + b, a - b}
            before, after = s[: signs[0].start()], s[signs[0].end() :]
            return "set", [f"{before}+{after}", f"{before}-{after}"]
        return "scalar", [s]
    return kind, parts


class _Element:
    """One scalar of an answer: its text, normalised text and value (computed once, when needed)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._values_at: dict[int, Any] = {}

    @functools.cached_property
    def norm(self) -> str:
        return normalize_answer(self.text, split_equations=False)

    @functools.cached_property
    def value(self) -> Any:
        return _evaluate(self.norm)

    def value_at(self, point: int) -> Any:
        """The value with every variable set to its value at test point `point` (see _variable_value)."""
        if point not in self._values_at:
            self._values_at[point] = _evaluate(self.norm, point)
        return self._values_at[point]

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The letters of the answer outside command names and math words: its free variables (e, i are constants)."""
        letters = set()
        for m in _LETTERS_RE.finditer(self.text):
            run = m.group()
            if run[0] != "\\" and run.lower() not in _MATH_WORDS:
                letters.update(run)
        return frozenset(letters - _CONSTANT_LETTERS)

    @functools.cached_property
    def decimals(self) -> int | None:
        """k for a plain decimal like '0.33' (k = 2), else None."""
        m = _DECIMAL_RE.fullmatch(self.norm)
        return len(m.group(1)) if m else None


# --------------------------------------------------------------------------- exact evaluation


class _Unsupported(Exception):
    """Not an expression this evaluator handles (letters, functions, ...): math-verify decides."""


class _TooBig(Exception):
    """An exact rational beyond _MAX_BITS."""


_TOO_BIG = object()


def _exact_root(x: Fraction, n: int) -> Fraction | None:
    """x^(1/n) when it is rational (x >= 0), else None."""

    def int_root(v: int) -> int | None:
        if v.bit_length() > 1000:
            return None
        r = math.isqrt(v) if n == 2 else round(v ** (1.0 / n))
        return next((c for c in (r - 1, r, r + 1) if c >= 0 and c**n == v), None)

    num, den = int_root(x.numerator), int_root(x.denominator)
    return Fraction(num, den) if num is not None and den is not None else None


def _power(base: Any, exponent: Any) -> Any:
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        e = int(exponent)
        if isinstance(base, Fraction):
            if max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(e) > _MAX_BITS:
                raise _TooBig
            return base**e
        return float(base) ** e
    if (
        isinstance(exponent, Fraction)
        and isinstance(base, Fraction)
        and base >= 0
        and exponent.denominator <= _MAX_ROOT
    ):
        root = _exact_root(base, exponent.denominator)
        if root is not None:
            return _power(root, Fraction(exponent.numerator))
    if base < 0:
        raise _Unsupported("a negative base with a non-integer exponent")
    return float(base) ** float(exponent)


def _natural(x: Any) -> int:
    if not (isinstance(x, Fraction) and x.denominator == 1 and x >= 0):
        raise _Unsupported("not a natural number")
    return int(x)


def _factorial(x: Any) -> Fraction:
    n = _natural(x)
    if n > 2 and n * math.log2(n) > _MAX_BITS:
        raise _TooBig
    return Fraction(math.factorial(n))


def _binomial(n: Any, k: Any) -> Fraction:
    n, k = _natural(n), _natural(k)
    if n > _MAX_BITS:  # C(n, k) < 2^n
        raise _TooBig
    return Fraction(math.comb(n, k))


def _root(x: Any, n: Any) -> Any:
    if not (isinstance(n, Fraction) and n.denominator == 1 and 2 <= n <= _MAX_ROOT):
        raise _Unsupported("root index")
    n = int(n)
    if x < 0:
        if n % 2 == 0:
            raise _Unsupported("even root of a negative number")
        return -_root(-x, Fraction(n))
    exact = _exact_root(x, n) if isinstance(x, Fraction) else None
    return exact if exact is not None else float(x) ** (1.0 / n)


class _Evaluator:
    """Recursive descent over normalised LaTeX: numbers, + - * / ^ !, \\frac, \\sqrt, \\binom, \\pi, brackets.

    Values are Fraction while exact, float once irrational (\\sqrt{2}, \\pi). Nesting is capped,
    and signs are read in a loop, so the recursion depth stays small whatever the input.
    """

    def __init__(self, tokens: list[str], point: int | None = None) -> None:
        self.tokens = tokens
        self.point = point
        """None: a variable is unsupported; k: variables take their values at test point k."""
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _Unsupported("unexpected end")
        self.i += 1
        return token

    def expect(self, token: str) -> None:
        if self.take() != token:
            raise _Unsupported(f"expected {token}")

    def expression(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Any:
        value = self.signed()
        while True:
            token = self.peek()
            if token in ("*", "\\cdot", "\\times"):
                self.i += 1
                value = value * self.signed()
            elif token in ("/", "\\div"):
                self.i += 1
                value = value / self.signed()
            elif token is not None and (
                token[0].isalnum() or token in ("(", "{", "\\frac", "\\sqrt", "\\pi", "\\binom", "\\dbinom", "\\tbinom")
            ):
                value = value * self.power()  # implicit multiplication: 2\sqrt{2}, 3\pi, (1)(2)
            else:
                return value

    def signed(self) -> Any:
        negative = False
        while self.peek() in ("+", "-"):
            negative ^= self.take() == "-"
        value = self.power()
        return -value if negative else value

    def power(self) -> Any:
        base = self.primary()
        if self.peek() == "!":
            self.i += 1
            if self.peek() == "!":
                raise _Unsupported("double factorial")
            base = _factorial(base)
        if self.peek() != "^":
            return base
        self.i += 1
        token = self.peek()
        if token in ("{", "("):
            exponent = self.primary()
        elif token is not None and len(token) == 1 and token.isdigit():
            exponent = Fraction(self.take())
        else:
            raise _Unsupported("exponent")  # 2^10 is 2^{10} to a reader and 2^1 0 to LaTeX: math-verify decides
        return _power(base, exponent)

    def group(self) -> Any:
        """A LaTeX argument: {...}, (...) or a single digit."""
        token = self.peek()
        if token in ("{", "("):
            return self.primary()
        if token is not None and len(token) == 1 and token.isdigit():
            return Fraction(self.take())
        raise _Unsupported("argument")

    def primary(self) -> Any:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return self.number(token)
        if token in _OPENERS:
            self.depth += 1
            if self.depth > _MAX_NESTING:
                raise _Unsupported("nesting")
            value = self.expression()
            self.expect(_OPENERS[token])
            self.depth -= 1
            return value
        if token == "\\frac":
            return self.group() / self.group()
        if token in ("\\binom", "\\dbinom", "\\tbinom"):
            return _binomial(self.group(), self.group())
        if token in ("\\sqrt", "sqrt"):
            index = Fraction(2)
            if self.peek() == "[":
                self.i += 1
                index = self.expression()
                self.expect("]")
            return _root(self.group(), index)
        if token in ("\\pi", "pi"):
            return math.pi
        if self.point is not None and len(token) == 1 and token.isalpha() and token not in _CONSTANT_LETTERS:
            return _variable_value(token, self.point)
        raise _Unsupported(token)

    def number(self, token: str) -> Fraction:
        """A literal, with what may follow it: 1e3, a repeating decimal 0.1\\overline{6}, a mixed number 2\\frac{1}{2}."""
        mantissa, _, exponent = token.lower().partition("e")
        if exponent and abs(int(exponent)) > _MAX_EXPONENT:
            raise _TooBig
        value = Fraction(token)
        if token.isdigit() and self.tokens[self.i : self.i + 2] == ["\\frac", "{"]:
            return value + self.mixed_fraction()
        t = self.tokens[self.i : self.i + 4]
        if "." in token and not exponent and len(t) == 4 and t[:2] == ["\\overline", "{"] and t[2].isdigit():
            if t[3] != "}":
                raise _Unsupported("repeating part")
            self.i += 4
            shift = len(mantissa.partition(".")[2])
            return value + Fraction(int(t[2]), (10 ** len(t[2]) - 1) * 10**shift)
        return value

    def mixed_fraction(self) -> Fraction:
        """The fraction of a mixed number 2\\frac{1}{2}: only literal integers, else it is a product."""
        t = self.tokens[self.i : self.i + 7]
        if len(t) == 7 and t[2].isdigit() and t[5].isdigit() and t[3] == "}" and t[4] == "{" and t[6] == "}":
            self.i += 7
            return Fraction(int(t[2]), int(t[5]))
        raise _Unsupported("a product with a fraction")


def _variable_value(letter: str, point: int) -> Fraction:
    """A variable's value at a test point: positive (no even root of a negative), not an integer, distinct per letter."""
    return Fraction(2 * ord(letter) + 1, 29 + 12 * point)


def _tokens(norm: str) -> list[str]:
    """Numbers, commands, symbols; a plain letter run is one letter a token (xy is x times y) unless it is a math word."""
    tokens = []
    for m in _TOKEN_RE.finditer(norm):
        token = m.group()
        if token.isalpha() and len(token) > 1 and token.lower() not in _MATH_WORDS:
            tokens.extend(token)
        elif not token.isspace():
            tokens.append(token)
    return tokens


def _evaluate(norm: str, point: int | None = None) -> Any:
    """The exact (Fraction) or approximate (float) value of a normalised answer, with its variables at test point
    `point` (None: an answer with a variable has no value); None when not a plain number expression; _TOO_BIG for a
    rational too large to compute."""
    if len(norm) > _MAX_ANSWER_CHARS:
        return None
    tokens = _tokens(norm)
    evaluator = _Evaluator(tokens, point)
    try:
        value = evaluator.expression()
        if evaluator.i != len(tokens):
            return None
    except _TooBig:
        return _TOO_BIG
    except (_Unsupported, ZeroDivisionError, OverflowError, ValueError, TypeError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --------------------------------------------------------------------------- comparison


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


def _numeric_decision(pred: _Element, gold: _Element) -> bool | None:
    """The rules of step 4 of the module docstring; None when only symbolic algebra can tell."""
    p, g = pred.value, gold.value
    if p is _TOO_BIG or g is _TOO_BIG:
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
    if p is None or g is None or p is _TOO_BIG or g is _TOO_BIG:
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
        if len(text) > _MAX_ANSWER_CHARS or not 0 <= _balanced_depth(text) <= _MAX_NESTING:
            return False
    gold_parsed, pred_parsed = _parse(gold, secs), _parse(pred, secs)
    return bool(gold_parsed and pred_parsed and verify(list(gold_parsed), list(pred_parsed), timeout_seconds=secs))


def _scalar_equal(pred: _Element, gold: _Element, secs: int | None) -> bool:
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


def _answers_equal(pred: _Answer, gold: _Answer, secs: int | None) -> bool:
    """The comparison of the module docstring, steps 1-5."""
    if pred.is_text or gold.is_text:
        return pred.text_key == gold.text_key
    if gold.is_equation:  # 'x^2+y^2=4', 'y=2x+1': the whole equation is the answer
        whole_pred, whole_gold = _Element(pred.whole), _Element(gold.whole)
        if whole_pred.norm == whole_gold.norm:
            return True
        return "=" in whole_pred.norm and _symbolic_equal(whole_pred.text, whole_gold.text, secs)
    if pred.norm == gold.norm:
        return True
    choices = _CHOICE_RE.fullmatch(pred.norm), _CHOICE_RE.fullmatch(gold.norm)
    if choices[0] and choices[1]:
        return choices[0].group(1) == choices[1].group(1)
    if len(pred.text) > _MAX_ANSWER_CHARS:
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
        return _result(False, None)
    pred = clean_answer(raw)
    gold = _reference(ground_truth)
    if not pred.text or gold is None:
        return _result(False, pred.text)
    return _result(_answers_equal(pred, gold, _alarm_seconds(timeout_s)), pred.text)
