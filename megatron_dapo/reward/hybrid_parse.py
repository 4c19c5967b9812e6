"""The hybrid verifier's parsing: the final answer out of a response, cleaned, classified, split into elements.

The rules are those of hybrid.py's docstring (extraction, cleaning, and the structure of step 3).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from megatron_dapo.reward.answers import (
    ANSWER_RE,
    BOX_HEAD_RE,
    LEFT_RIGHT_RE,
    SIMPLE_SUBSTITUTIONS,
    THOUSANDS_RE,
    gsm8k_answer,
    last_answer_start,
    normalize_answer,
    unwrap_commands,
)
from megatron_dapo.reward.hybrid_exact import MATH_WORDS, Element

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
# Letters written onto a number (no space) that leave it the number: its English ordinal ending, or a unit
# abbreviation of two or more letters (tests/data/reward_corpus.jsonl's header, rule 1); any other word makes it text.
_ATTACHED_UNITS = frozenset("mm cm dm km mg kg lb lbs oz ft in yd mi ml hr hrs min sec mph kph kmh".split())
# Digit groups split by spaces of any kind (rule 2), not starting after a subscript, superscript or decimal point.
_SPACE_SEP = r"(?:[ \t\u00a0\u2009\u202f]|\\[,;: ]|~)+"
_SPACED_DIGITS_RE = re.compile(r"(?<![\d._^])\d+(?:" + _SPACE_SEP + r"\d+)+")
_LIST_COMMA_RE = re.compile(r",\s+(?=\d)")
_SEPARATOR_WORDS = frozenset(("and", "or"))
_MEMBER_RE = re.compile(r"\s*[A-Za-z]\s*\\in(?![A-Za-z])")
_RELATION_RE = re.compile(r"\\(?:leq?|geq?|lt|gt)(?![A-Za-z])|[<>]")
_VARIABLE_RE = re.compile(r"[A-Za-z]")
# What 'x =' may name: x, x_1, f(3), AB, \angle ABC, [ABC], or words ('the area').
_NAME_RE = re.compile(r"(?:\\angle\s*)?[A-Za-z]{1,4}(?:_\{?\w+\}?)?(?:\([^()=]*\))?|\[[A-Z]{2,4}\]|[A-Za-z ]+")
_PLUS_MINUS_RE = re.compile(r"\\pm(?![A-Za-z])")


# --------------------------------------------------------------------------- extraction


def _last_closed_box(response: str) -> tuple[int, int, int] | None:
    """(start of '\\boxed', start of content, index of its '}') of the last box, or None (none, or unclosed)."""
    start = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if start < 0:
        return None
    head = BOX_HEAD_RE.match(response, start)
    if head is None:  # '\boxed 5' or '\boxedx': look for the last well-formed head instead
        heads = list(BOX_HEAD_RE.finditer(response))
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
    start = last_answer_start(response)
    line = ANSWER_RE.match(response, start) if start is not None else None
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
    return [m for m in _WORD_RE.finditer(s) if m.group().lower() not in MATH_WORDS and not m.group().isupper()]


def _strip_wrappers(raw: str) -> str:
    """The answer text without delimiters, wrappers, lead-in and trailing period (see hybrid.py's docstring)."""
    s = raw.translate(_UNICODE)
    for before, after in _RELATIONS:
        s = s.replace(before, after)
    s = unwrap_commands(s, BOX_HEAD_RE)
    for before, after in SIMPLE_SUBSTITUTIONS:
        s = s.replace(before, after)
    s = LEFT_RIGHT_RE.sub("", s)
    s = unwrap_commands(s).replace("~", " ")  # a LaTeX tie is a space
    s = s.strip().strip("*").strip()
    lead = _LEAD_IN_RE.match(s)
    if lead and lead.end() > 0:
        s = s[lead.end() :]
    s = s.rstrip(". ")
    if s.lower().endswith(_HOPE_SUFFIX):
        s = s[: -len(_HOPE_SUFFIX)].rstrip(" .,;")
    return s.strip("* ")


@dataclass
class Answer:
    """A cleaned answer: `text` keeps its spaces (math-verify needs them); `is_text` marks a text answer;
    `whole` is the text before 'x =' was dropped, `is_equation` marks a reference whose '=' is part of the answer;
    `malformed` marks digits split where no digit grouping splits them ('3 4'): equal to nothing."""

    text: str
    is_text: bool
    whole: str = ""
    is_equation: bool = False
    malformed: bool = False

    @functools.cached_property
    def norm(self) -> str:
        # clean_answer already kept what counts; a comma and a space part list items, never digit groups ('1, 000')
        return normalize_answer(_LIST_COMMA_RE.sub(",;", self.text), split_equations=False)

    @functools.cached_property
    def text_key(self) -> str:
        return "".join(self.text.split()).lower()

    @functools.cached_property
    def structure(self) -> tuple[str, list[Element]]:
        kind, parts = _structure(self.text)
        return kind, [Element(_split_equation(p)[1]) for p in parts]


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


def clean_answer(raw: str) -> Answer:
    """Apply the cleaning rules of hybrid.py's docstring to a raw final answer."""
    whole = _strip_wrappers(raw).split("\\approx")[0].strip()
    lhs, rhs = _split_equation(whole)
    answer = _classify(rhs)
    answer.whole = whole
    answer.is_equation = lhs is not None and (not _NAME_RE.fullmatch(lhs) or bool(Element(rhs).variables))
    answer.malformed = any(not _digit_groups(m.group()) for m in _SPACED_DIGITS_RE.finditer(raw))
    return answer


def _digit_groups(run: str) -> bool:
    """A run of digits split by spaces is one number when it is thousands grouping: one kind of separator, a first
    group of one to three digits, then groups of three ('1 000', '12\\,345')."""
    groups, separators = re.findall(r"\d+", run), re.findall(r"\D+", run)
    return 1 <= len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:]) and len(set(separators)) == 1


def _ordinal_ending(n: int) -> str:
    return "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _attached_word_keeps_number(head: str, word: str) -> bool:
    """A word written onto the number that ends `head` ('34' + 'th', '34' + 'cm'): does the number stand?"""
    digits = re.search(r"\d+$", head)
    return word.lower() in _ATTACHED_UNITS or (digits is not None and word == _ordinal_ending(int(digits.group())))


def _classify(s: str) -> Answer:
    """A math or text answer, with a unit dropped, 'and'/'or' lists and inequalities rewritten (hybrid.py)."""
    words = _words(s)
    if words and all(w.group().lower() in _SEPARATOR_WORDS for w in words):
        # '1 and 2', 'x = 1 or x = 2': a list of answers (a hedge '42 or 43' is then a wrong set)
        bounds = [0] + [i for w in words for i in (w.start(), w.end())] + [len(s)]
        s = ", ".join(s[a:b].strip().rstrip(",").strip() for a, b in zip(bounds[::2], bounds[1::2]))
        return Answer(s, is_text=False)
    if not words:
        return Answer(_as_interval(s), is_text=False)
    head, tail = s[: words[0].start()].rstrip(), s[words[0].start() :]
    attached = words[0].start() > 0 and s[words[0].start() - 1].isdigit()
    if attached and not _attached_word_keeps_number(head, words[0].group()):
        return Answer(s, is_text=True)  # '34abc' is a word, not 34 with a unit
    if (
        any(ch.isdigit() or ch == "\\" for ch in head)
        and _UNIT_TAIL_RE.fullmatch(tail)
        and not any(w.group().lower() in _NOT_UNIT_WORDS for w in words)
    ):
        return Answer(head, is_text=False)
    return Answer(s, is_text=True)


@functools.lru_cache(maxsize=4096)
def parse_reference(ground_truth: str) -> Answer | None:
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
    if THOUSANDS_RE.fullmatch(s):  # '1,000'; '1, 000' is the list of 1 and 000
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
