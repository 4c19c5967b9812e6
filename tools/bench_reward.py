"""Reward scoring throughput: synthetic DAPO-Math responses through RewardPool.

    python tools/bench_reward.py                          # 8192 responses, 2 workers, dapo + math_verify
    python tools/bench_reward.py --n 2048 --workers 4 --verifier dapo --baseline

Each response is a few hundred characters of reasoning then the final answer: an
'Answer: N' line for the dapo verifier, '\\boxed{N}' for math_verify (a mix of correct and
wrong, from a fixed seed). The pool is warmed up first, so the timing is steady-state
scoring, not worker start-up. Prints one table row per verifier; --baseline adds the same
verifier called in this process, sequentially, to show the pool's overhead.
"""

from __future__ import annotations

import argparse
import logging
import random
import time

from megatron_dapo.reward import RewardPool, select_verifier

_WORDS = (
    "we compute the sum of the terms so the total becomes since each factor divides both sides "
    "hence by symmetry note that substituting gives therefore the remainder is equal to"
).split()


def make_batch(n: int, style: str, seed: int = 0) -> tuple[list[str], list[str], list[str], int]:
    """n synthetic responses in `style` ('dapo' or 'math_verify'): (responses, golds, data_sources, #correct)."""
    rng = random.Random(seed)
    responses, golds = [], []
    correct = 0
    for _ in range(n):
        gold = rng.randint(0, 100_000)
        answer = gold if rng.random() < 0.5 else gold + rng.randint(1, 99)
        correct += answer == gold
        steps = [
            f"{rng.randint(2, 999)} * {rng.randint(2, 99)} = {rng.randint(4, 99_999)}" for _ in range(rng.randint(3, 8))
        ]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(30, 80)))
        reasoning = f"Let's think step by step. {words}. " + "; ".join(steps) + "."
        final = f"Answer: {answer}" if style == "dapo" else f"So the final answer is $\\boxed{{{answer}}}$."
        responses.append(f"{reasoning}\n{final}")
        golds.append(str(gold))
    sources = ["math_dapo" if style == "dapo" else "openai/gsm8k"] * n
    return responses, golds, sources, correct


def bench_pool(n: int, workers: int, verifier: str, timeout_s: float) -> dict:
    """Score n responses with a warm RewardPool; returns one table row."""
    responses, golds, sources, correct = make_batch(n, verifier)
    with RewardPool(num_workers=workers, timeout_s=timeout_s, verifier=verifier) as pool:
        pool.score(responses[: 4 * workers], golds[: 4 * workers], sources[: 4 * workers])  # wait for start-up
        batch = pool.score(responses, golds, sources)
    m = batch.metrics
    assert sum(batch.acc) == correct, f"{verifier}: {sum(batch.acc)} correct, expected {correct}"
    return {
        "responses": n,
        "workers": str(workers),
        "verifier": verifier,
        "seconds": m["reward/seconds"],
        "responses/s": m["reward/responses_per_s"],
        "timeouts": int(m["reward/timeouts"]),
        "errors": int(m["reward/errors"]),
    }


def bench_in_process(n: int, verifier: str) -> dict:
    """The same verifier called sequentially in this process (no isolation, no time limit)."""
    responses, golds, sources, correct = make_batch(n, verifier)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its notice that we passed no timeout
    verify = select_verifier(sources[0], verifier, math_verify_timeout_s=None)
    verify(responses[0], golds[0])  # first-call cost (math-verify's imports and caches)
    t = time.perf_counter()
    acc = sum(verify(r, g).acc for r, g in zip(responses, golds))
    seconds = time.perf_counter() - t
    assert acc == correct, f"{verifier}: {acc} correct, expected {correct}"
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="responses per verifier")
    parser.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    parser.add_argument(
        "--verifier",
        nargs="+",
        default=["dapo", "math_verify"],
        choices=["dapo", "math_verify"],
        help="verifiers to run",
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per-response time limit")
    parser.add_argument("--baseline", action="store_true", help="also time each verifier in-process, sequentially")
    args = parser.parse_args()
    rows = []
    for verifier in args.verifier:
        rows.append(bench_pool(args.n, args.workers, verifier, args.timeout_s))
        if args.baseline:
            rows.append(bench_in_process(args.n, verifier))
    print_table(rows)


if __name__ == "__main__":  # spawned workers must not re-run the benchmark
    main()
