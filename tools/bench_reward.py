"""Reward scoring throughput: synthetic DAPO-Math responses through RewardPool.

    python tools/bench_reward.py                          # 8192 responses, 2 workers, dapo + math_verify
    python tools/bench_reward.py --n 2048 --workers 4 --verifier dapo --baseline
    python tools/bench_reward.py --workload mixed --verifier hybrid math_verify --baseline

Each response is a few hundred characters of reasoning then the final answer: an
'Answer: X' line for the dapo and hybrid verifiers, '\\boxed{X}' for math_verify (a mix of
correct and wrong, from a fixed seed). The 'integers' workload (the default) answers integers
only. The 'mixed' workload is a benchmark's mix, in groups of 16 responses per reference as in
a DAPO step: integers 50%, fractions 15%, radicals 10%, expressions 10%, powers 5%, decimals 5%,
intervals 5%; half the responses correct, each in one of the reference's equal forms (0.5 for
\\frac{1}{2}, \\sqrt{8} for 2\\sqrt{2}, (x+1)(x+2) for x^2+3x+2: some need symbolic algebra),
half wrong. The pool is warmed up first, so the timing is steady-state scoring, not worker
start-up. Prints one table row per verifier; --baseline adds the same verifier called in this
process, sequentially, to show the pool's overhead. A row's count of correct answers must
match the labels, except dapo's on the mixed workload (it compares strings: printed instead).
"""

from __future__ import annotations

import logging
import math
import random
import time

from megatron_dapo.cli import argument_parser, tool_log
from megatron_dapo.reward import RewardPool, select_verifier

log = tool_log("bench_reward")

_WORDS = (
    "we compute the sum of the terms so the total becomes since each factor divides both sides "
    "hence by symmetry note that substituting gives therefore the remainder is equal to"
).split()


_GROUP = 16
"""Responses per reference in the mixed workload, as a DAPO step samples them per prompt."""
_MIXED_KINDS = ("integer", "fraction", "radical", "expression", "power", "decimal", "interval")
_MIXED_WEIGHTS = (50, 15, 10, 10, 5, 5, 5)
_SQUAREFREE = (2, 3, 5, 6, 7, 10, 11, 13)


def _mixed_problem(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(reference, equal forms of it, wrong answers) for one problem of the mixed workload."""
    kind = rng.choices(_MIXED_KINDS, _MIXED_WEIGHTS)[0]
    if kind == "integer":
        g = rng.randint(0, 100_000)
        return str(g), [str(g), f"{g:,}"], [str(g + rng.randint(1, 99)), str(g * 10)]
    if kind == "fraction":
        den = rng.choice((2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 25))
        num = rng.choice([a for a in range(1, 3 * den) if math.gcd(a, den) == 1])
        right = [f"\\frac{{{num}}}{{{den}}}", f"{num}/{den}", f"\\frac{{{2 * num}}}{{{2 * den}}}"]
        if 10**6 % den == 0:
            right.append(str(num / den))  # a terminating decimal
        return right[0], right, [f"\\frac{{{den}}}{{{num}}}", f"\\frac{{{num + 1}}}{{{den}}}"]
    if kind == "radical":
        k, m = rng.randint(2, 9), rng.choice(_SQUAREFREE)
        gold = f"{k}\\sqrt{{{m}}}"
        return (
            gold,
            [gold, f"\\sqrt{{{k * k * m}}}", f"{k} \\sqrt{{{m}}}"],
            [f"{k + 1}\\sqrt{{{m}}}", f"\\sqrt{{{k * m}}}"],
        )
    if kind == "expression":
        p, q = rng.randint(1, 9), rng.randint(1, 9)
        gold = f"x^2+{p + q}x+{p * q}"
        return gold, [gold, f"(x+{p})(x+{q})"], [f"(x+{p})(x+{q + 1})", f"x^2+{p + q}x"]
    if kind == "power":
        b, e = rng.randint(2, 9), rng.randint(2, 12)
        return f"{b}^{{{e}}}", [str(b**e), f"{b}^{{{e}}}"], [str(b**e + 1), f"{b}^{{{e + 1}}}"]
    if kind == "decimal":
        tenths = rng.randint(11, 999)
        gold = f"{tenths // 10}.{tenths % 10}"
        wrong = [f"{(tenths + 1) // 10}.{(tenths + 1) % 10}", str(tenths)]
        return gold, [gold, f"\\frac{{{tenths}}}{{10}}"], wrong
    a = rng.randint(-20, 10)
    b = a + rng.randint(1, 20)
    return f"({a}, {b})", [f"({a}, {b})", f"({a},{b})"], [f"[{a}, {b}]", f"({b}, {a})"]


def make_batch(
    n: int, style: str, seed: int = 0, workload: str = "integers"
) -> tuple[list[str], list[str], list[str], int]:
    """n synthetic responses in `style` ('dapo': an Answer line, 'math_verify': a box) for `workload`
    ('integers' or 'mixed'): (responses, golds, data_sources, #correct)."""
    rng = random.Random(seed)
    responses, golds = [], []
    correct = 0
    problem: tuple[str, list[str], list[str]] = ("", [], [])
    for i in range(n):
        if workload == "mixed":
            if i % _GROUP == 0:
                problem = _mixed_problem(rng)
            right = rng.random() < 0.5
            gold, answer = problem[0], rng.choice(problem[1] if right else problem[2])
        else:
            g = rng.randint(0, 100_000)
            answer_value = g if rng.random() < 0.5 else g + rng.randint(1, 99)
            right, gold, answer = answer_value == g, str(g), str(answer_value)
        correct += right
        steps = [
            f"{rng.randint(2, 999)} * {rng.randint(2, 99)} = {rng.randint(4, 99_999)}" for _ in range(rng.randint(3, 8))
        ]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(30, 80)))
        reasoning = f"Let's think step by step. {words}. " + "; ".join(steps) + "."
        final = f"Answer: {answer}" if style == "dapo" else f"So the final answer is $\\boxed{{{answer}}}$."
        responses.append(f"{reasoning}\n{final}")
        golds.append(gold)
    sources = ["math_dapo" if style == "dapo" else "openai/gsm8k"] * n
    return responses, golds, sources, correct


def _style(verifier: str) -> str:
    return "math_verify" if verifier == "math_verify" else "dapo"


def _check(verifier: str, workload: str, got: int, expected: int) -> None:
    """Every row must judge as labelled, except dapo on the mixed workload (it compares strings)."""
    if verifier == "dapo" and workload == "mixed":
        log(f"dapo on the mixed workload: {got} judged correct of {expected} correct")
    else:
        assert got == expected, f"{verifier}: {got} correct, expected {expected}"


def bench_pool(n: int, workers: int, verifier: str, timeout_s: float, workload: str = "integers") -> dict:
    """Score n responses with a warm RewardPool; returns one table row."""
    responses, golds, sources, correct = make_batch(n, _style(verifier), workload=workload)
    # Start-up, and the first symbolic comparison in each worker (imports sympy when the pool did not)
    warm_up = ["Answer: \\sqrt{8}" if _style(verifier) == "dapo" else "\\boxed{\\sqrt{8}}"] * (4 * workers)
    with RewardPool(num_workers=workers, timeout_s=timeout_s, verifier=verifier) as pool:
        pool.score(warm_up, ["2\\sqrt{2}"] * len(warm_up), sources[: len(warm_up)])
        batch = pool.score(responses, golds, sources)
    m = batch.metrics
    _check(verifier, workload, sum(batch.acc), correct)
    return {
        "responses": n,
        "workers": str(workers),
        "verifier": verifier,
        "seconds": m["reward/seconds"],
        "responses/s": m["reward/responses_per_s"],
        "timeouts": int(m["reward/timeouts"]),
        "errors": int(m["reward/errors"]),
    }


def bench_in_process(n: int, verifier: str, workload: str = "integers") -> dict:
    """The same verifier called sequentially in this process (no isolation, no time limit)."""
    responses, golds, sources, correct = make_batch(n, _style(verifier), workload=workload)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its notice that we passed no timeout
    verify = select_verifier(sources[0], verifier, math_verify_timeout_s=None)
    verify("So \\boxed{\\sqrt{8}}.", "2\\sqrt{2}")  # first-call cost (math-verify's imports and caches)
    t = time.perf_counter()
    acc = sum(verify(r, g).acc for r, g in zip(responses, golds))
    seconds = time.perf_counter() - t
    _check(verifier, workload, acc, correct)
    return {
        "responses": n,
        "workers": "in-process",
        "verifier": verifier,
        "seconds": seconds,
        "responses/s": n / seconds,
        "timeouts": 0,
        "errors": 0,
    }


def print_table(rows: list[dict]) -> None:
    """A Markdown table, ready to paste into benchmarks/RESULTS.md."""
    cols = ["responses", "workers", "verifier", "seconds", "responses/s", "timeouts", "errors"]
    fmt = {"seconds": "{:.3f}", "responses/s": "{:,.0f}"}
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---:" if c not in ("verifier", "workers") else "---" for c in cols) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.get(c, "{}").format(row[c]) for c in cols) + " |")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--n", type=int, default=8192, help="responses per verifier")
    parser.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    parser.add_argument(
        "--verifier",
        nargs="+",
        default=["dapo", "math_verify"],
        choices=["dapo", "math_verify", "hybrid"],
        help="verifiers to run",
    )
    parser.add_argument(
        "--workload", default="integers", choices=["integers", "mixed"], help="the answers' forms (see above)"
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per-response time limit")
    parser.add_argument("--baseline", action="store_true", help="also time each verifier in-process, sequentially")
    args = parser.parse_args()
    rows = []
    for verifier in args.verifier:
        rows.append(bench_pool(args.n, args.workers, verifier, args.timeout_s, args.workload))
        if args.baseline:
            rows.append(bench_in_process(args.n, verifier, args.workload))
    print_table(rows)


if __name__ == "__main__":  # spawned workers must not re-run the benchmark
    main()
