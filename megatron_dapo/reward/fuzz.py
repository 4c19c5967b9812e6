"""Adversarial responses for the reward verifiers, and a fuzz run of one verifier through the real RewardPool.

make_cases draws N responses from a fixed seed (huge numbers, deep nesting, unbalanced braces, very long text,
Unicode, control characters, LaTeX that makes sympy slow, regex traps, random LaTeX-ish noise), each paired with a
reference (sane ones mostly, some empty, a few fuzzed); fuzz_verifier scores them with RewardPool.score and counts
crashes, missing statuses, ok/timeout/error statuses and the slowest calls. tools/fuzz_reward.py runs it.
"""

from __future__ import annotations

import logging
import random
import time

from megatron_dapo.reward.pool import RewardPool

SANE_REFERENCES = (
    "5",
    "42",
    "-3",
    "1000",
    "0.5",
    "\\frac{1}{2}",
    "2\\sqrt{2}",
    "x^2+1",
    "(1,2)",
    "\\{1,2\\}",
    "Monday",
)
_WORDS = "we compute the sum so the total is since each factor divides both sides hence answer Answer: note".split()
# Answers that are cheap to write and expensive for sympy (or for a naive evaluator).
_SLOW_LATEX = (
    "x^{x^{x^{x^{x}}}}",
    "9^{9^{9^{9}}}",
    "2^{2^{2^{2^{2^{2}}}}}",
    "10^{10^{10}}",
    "e^{e^{e^{e^{e}}}}",
    "(x+y+z+1)^{40}",
    "(x+1)^{100000}",
    "x^{1000000}-1",
    "\\frac{x^{200}-1}{x-1}",
    "\\sum_{k=1}^{10^{9}} k",
    "\\sum_{k=1}^{\\infty} \\frac{1}{k^{2}}",
    "\\prod_{k=1}^{200} (x+k)",
    "100000!",
    "(10^{6})!",
    "\\binom{10^{6}}{500000}",
    "\\int_0^1 x^{x} \\, dx",
    "\\int e^{x^{2}} dx",
    "\\lim_{x \\to 0} \\frac{\\sin x}{x}",
    "\\sqrt[999]{2}^{999}",
    "\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(1))))))))",
    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}^{100}",
    "\\frac{(x+1)^{50}-(x-1)^{50}}{x}",
    "\\left(1+\\frac{1}{10^{9}}\\right)^{10^{9}}",
    "\\tan^{-1}(\\tan^{-1}(\\tan^{-1}(x)))",
    "\\gcd(2^{10000}-1, 3^{10000}-1)",
)


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choices("0123456789", k=n))


def _pick(rng: random.Random, *makers) -> str:
    """One of the makers' strings; only the chosen one is built (some are hundreds of kB)."""
    return rng.choice(makers)()


def _huge_number(rng: random.Random) -> str:
    n = rng.choice((50, 400, 5000, 50_000, 200_000))
    return _pick(
        rng,
        lambda: _digits(rng, n),
        lambda: "-" + _digits(rng, n),
        lambda: _digits(rng, n) + "." + _digits(rng, n // 2),
        lambda: ",".join(_digits(rng, 3) for _ in range(n // 4)),
        lambda: f"1e{_digits(rng, rng.randint(3, 12))}",
        lambda: f"\\frac{{{_digits(rng, n)}}}{{{_digits(rng, n)}}}",
        lambda: f"{_digits(rng, 3)}^{{{_digits(rng, rng.randint(4, 9))}}}",
    )


def _deep_nesting(rng: random.Random) -> str:
    k = rng.choice((10, 50, 500, 5000, 30_000))
    return _pick(
        rng,
        lambda: "{" * k + "5" + "}" * k,
        lambda: "(" * k + "5" + ")" * k,
        lambda: "\\frac{1}{" * k + "2" + "}" * k,
        lambda: "\\sqrt{" * k + "2" + "}" * k,
        lambda: "2^{" * k + "2" + "}" * k,
        lambda: "\\boxed{" * k + "5" + "}" * k,
        lambda: "\\text{" * k + "5" + "}" * k,
        lambda: "\\left(" * k + "1" + "\\right)" * k,
        lambda: "-" * k + "5",
    )


def _unbalanced(rng: random.Random) -> str:
    k = rng.choice((1, 10, 100, 1000, 50_000))
    return _pick(
        rng,
        lambda: "{" * k + "5",
        lambda: "5" + "}" * k,
        lambda: "\\frac{1}{2" * k,
        lambda: "\\boxed{5" * k,
        lambda: "".join(rng.choices("{}[]()5,\\", k=k)),
        lambda: "\\left(" * k + "5",
        lambda: "$" * k + "5",
    )


def _long_text(rng: random.Random) -> str:
    n = rng.choice((2_000, 10_000, 50_000, 300_000))
    words = rng.choices(_WORDS + [_digits(rng, rng.randint(1, 6)) for _ in range(5)], k=n // 5)
    return " ".join(words)


_CODE_POINTS = [
    c
    for lo, hi in (
        (0x80, 0x2FF),
        (0x300, 0x36F),
        (0x590, 0x6FF),
        (0x2200, 0x22FF),
        (0x4E00, 0x4FFF),
        (0x1F300, 0x1F64F),
    )
    for c in range(lo, hi + 1)
]
"""Latin-1 and accents, combining marks, Hebrew and Arabic (right to left), math operators, CJK, emoji."""


def _unicode(rng: random.Random) -> str:
    chars = [chr(c) for c in rng.choices(_CODE_POINTS, k=rng.choice((10, 1000, 50_000)))]
    special = "\u2212\u221a\u03c0\u221e\u00d7\u2264\u00b1\uff15\u200b\u200d\ufeff\u00a0\u202e"
    chars.extend(rng.choices(special, k=rng.randint(1, 20)))
    if rng.random() < 0.1:
        chars.append(chr(rng.randint(0xD800, 0xDFFF)))  # a lone surrogate: not encodable as UTF-8
    rng.shuffle(chars)
    return "".join(chars)


def _control(rng: random.Random) -> str:
    controls = [chr(c) for c in range(32)] + ["\x7f", "\x85", "\u2028", "\u2029"]
    return "".join(rng.choice(controls) if rng.random() < 0.5 else rng.choice("5 Answer:{}") for _ in range(200))


def _slow_latex(rng: random.Random) -> str:
    return rng.choice(_SLOW_LATEX)


def _regex_trap(rng: random.Random) -> str:
    k = rng.choice((100, 1000, 10_000, 200_000))
    return _pick(
        rng,
        lambda: "answer " * (k // 7),
        lambda: ":" * k,
        lambda: "Answer:" + " " * k,
        lambda: "Answer" + " " * k + ":5",
        lambda: "a" * k + "1",
        lambda: "1," * (k // 2),
        lambda: "=" * k,
        lambda: "x = " * (k // 4) + "5",
        lambda: "1 < " * (k // 4) + "x",
        lambda: "\\pm " * (k // 4) + "1",
        lambda: "1 and " * (k // 6) + "2",
        lambda: "5 cm" + "^2" * (k // 2),
        lambda: "\\{" + ", ".join(["1"] * (k // 3)) + "\\}",
    )


def _noise(rng: random.Random) -> str:
    alphabet = "0123456789+-*/^_{}()[]\\,.=<> abcxyz$%" + "\\frac\\sqrt\\pi\\infty\\boxed\\text"
    return "".join(rng.choices(alphabet, k=rng.choice((10, 100, 2000))))


GENERATORS = {
    "huge_number": _huge_number,
    "deep_nesting": _deep_nesting,
    "unbalanced": _unbalanced,
    "long_text": _long_text,
    "unicode": _unicode,
    "control": _control,
    "slow_latex": _slow_latex,
    "regex_trap": _regex_trap,
    "noise": _noise,
}
_FORMATS = (
    "Answer: {}",
    "Answer: ${}$",
    "\\boxed{{{}}}",
    "So the final answer is $\\boxed{{{}}}$.",
    "{}",
    "Answer:\n{}",
)


def make_cases(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """n adversarial (responses, references, categories) from `seed`, cycling through GENERATORS."""
    rng = random.Random(seed)
    names = list(GENERATORS)
    responses, references, categories = [], [], []
    for i in range(n):
        name = names[i % len(names)]
        answer = GENERATORS[name](rng)
        reasoning = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 40)))
        responses.append(f"{reasoning}\n{rng.choice(_FORMATS).format(answer)}")
        roll = rng.random()
        if roll < 0.05:
            references.append(rng.choice(("", "   ")))
        elif roll < 0.10:
            references.append(GENERATORS[rng.choice(names)](rng)[:2000])  # a fuzzed reference, kept short
        else:
            references.append(rng.choice(SANE_REFERENCES))
        categories.append(name)
    return responses, references, categories


def fuzz_verifier(
    verifier: str,
    responses: list[str],
    references: list[str],
    categories: list[str],
    workers: int = 2,
    timeout_s: float = 2.0,
    batch: int = 1,
) -> dict:
    """Score every response through a RewardPool; returns the counts and timings of one table row."""
    sources = ["math_dapo"] * len(responses)
    statuses = {"ok": 0, "timeout": 0, "error": 0}
    crashes, missing, worst, slowest = 0, 0, 0.0, []
    t0 = time.monotonic()
    with RewardPool(num_workers=workers, timeout_s=timeout_s, verifier=verifier) as pool:
        pool.score(["Answer: 1"] * workers, ["1"] * workers, sources[:workers])  # wait for start-up
        for start in range(0, len(responses), batch):
            end = min(start + batch, len(responses))
            t = time.monotonic()
            try:
                result = pool.score(responses[start:end], references[start:end], sources[start:end])
            except Exception:  # noqa: BLE001 - the thing being counted
                logging.getLogger(__name__).exception("score() raised on responses %d-%d", start, end - 1)
                crashes += end - start
                continue
            elapsed = time.monotonic() - t
            worst = max(worst, elapsed)
            slowest.append((elapsed, ",".join(sorted(set(categories[start:end])))))
            for status in result.status:
                if status in statuses:
                    statuses[status] += 1
                else:
                    missing += 1
            missing += (end - start) - len(result.status)
    seconds = time.monotonic() - t0
    slowest.sort(reverse=True)
    return {
        "verifier": verifier,
        "responses": len(responses),
        "crashes": crashes,
        "no status": missing,
        **statuses,
        "worst s": worst,
        "seconds": seconds,
        "responses/s": len(responses) / seconds,
        "slowest": slowest[:5],
    }
