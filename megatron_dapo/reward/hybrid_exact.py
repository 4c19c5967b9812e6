"""The hybrid verifier's exact evaluation: an answer's value as a Fraction while exact, a float once irrational."""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any

from megatron_dapo.reward.answers import normalize_answer

MAX_ANSWER_CHARS = 500
"""Longer answers are compared as normalised strings only: no reference is that long, and sympy on it is slow."""
MAX_NESTING = 40
_MAX_BITS = 40_000
"""Exact powers stop at ~12k digits: 9^{9^{9}} is not computed, it is just wrong."""
_MAX_ROOT = 64
# Written without a backslash these are still mathematics: sqrt(2), 2pi, log(8).
MATH_WORDS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt pi max min gcd lcm mod".split()
)
_DECIMAL_RE = re.compile(r"[+-]?\d*\.(\d+)")
_MAX_EXPONENT = 4000
_LETTERS_RE = re.compile(r"\\?[A-Za-z]+")
_CONSTANT_LETTERS = frozenset("ei")
# Disjoint first characters (space, digit or '.', backslash or letter, anything else): linear.
_TOKEN_RE = re.compile(r"\s+|((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)|(\\[A-Za-z]+|[A-Za-z]+)|(\\[{}]|\S)")
_OPENERS = {"(": ")", "{": "}", "[": "]"}


class Element:
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
            if run[0] != "\\" and run.lower() not in MATH_WORDS:
                letters.update(run)
        return frozenset(letters - _CONSTANT_LETTERS)

    @functools.cached_property
    def decimals(self) -> int | None:
        """k for a plain decimal like '0.33' (k = 2), else None."""
        m = _DECIMAL_RE.fullmatch(self.norm)
        return len(m.group(1)) if m else None


class _Unsupported(Exception):
    """Not an expression this evaluator handles (letters, functions, ...): math-verify decides."""


class _TooBig(Exception):
    """An exact rational beyond _MAX_BITS."""


TOO_BIG = object()


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
            if self.depth > MAX_NESTING:
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
        if token.isalpha() and len(token) > 1 and token.lower() not in MATH_WORDS:
            tokens.extend(token)
        elif not token.isspace():
            tokens.append(token)
    return tokens


def _evaluate(norm: str, point: int | None = None) -> Any:
    """The exact (Fraction) or approximate (float) value of a normalised answer, with its variables at test point
    `point` (None: an answer with a variable has no value); None when not a plain number expression; TOO_BIG for a
    rational too large to compute."""
    if len(norm) > MAX_ANSWER_CHARS:
        return None
    tokens = _tokens(norm)
    evaluator = _Evaluator(tokens, point)
    try:
        value = evaluator.expression()
        if evaluator.i != len(tokens):
            return None
    except _TooBig:
        return TOO_BIG
    except (_Unsupported, ZeroDivisionError, OverflowError, ValueError, TypeError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
