"""Fuzz the reward verifiers through the real RewardPool with adversarial responses.

    python tools/fuzz_reward.py                                  # 10,000 responses, every verifier
    python tools/fuzz_reward.py --n 2000 --verifier hybrid --timeout-s 2 --seed 7

Generates N responses from a fixed seed (huge numbers, deep nesting, unbalanced braces, very
long text, Unicode, control characters, LaTeX that makes sympy slow, regex traps, random
LaTeX-ish noise), pairs each with a reference (sane ones mostly, some empty, a few fuzzed) and
scores them with ``RewardPool.score`` in calls of ``--batch`` responses (default 1, so a call's
time is its response's time: the pool reports no per-response times). Prints one row per
verifier: responses, crashes (responses in score() calls that raised: must be 0), responses
without a status, the ok/timeout/error statuses, the worst call time and the rate; then the
slowest calls' categories.
"""

from __future__ import annotations

import logging

from megatron_dapo.choices import VERIFIERS
from megatron_dapo.cli import argument_parser, tool_log
from megatron_dapo.reward.fuzz import fuzz_verifier, make_cases

log = tool_log("fuzz_reward")


def print_table(rows: list[dict]) -> None:
    cols = [
        "verifier",
        "responses",
        "crashes",
        "no status",
        "ok",
        "timeout",
        "error",
        "worst s",
        "seconds",
        "responses/s",
    ]
    fmt = {"worst s": "{:.2f}", "seconds": "{:.1f}", "responses/s": "{:,.0f}"}
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if c == "verifier" else "---:" for c in cols) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.get(c, "{}").format(row[c]) for c in cols) + " |")
    for row in rows:
        slow = ", ".join(f"{s:.2f} s ({names})" for s, names in row["slowest"])
        print(f"{row['verifier']}: slowest calls {slow}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--n", type=int, default=10_000, help="responses per verifier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="the pool's per-response limit")
    parser.add_argument("--batch", type=int, default=1, help="responses per score() call")
    parser.add_argument("--verifier", nargs="+", default=list(VERIFIERS), choices=VERIFIERS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # per-response timeouts and errors are counted, not logged
    responses, references, categories = make_cases(args.n, args.seed)
    rows = []
    for v in args.verifier:  # math_verify alone can take an hour (its timeouts): say where the run is
        rows.append(fuzz_verifier(v, responses, references, categories, args.workers, args.timeout_s, args.batch))
        r = rows[-1]
        log(f"{v}: {r['responses']} responses, {r['crashes']} crashes, {r['timeout']} timeouts, {r['seconds']:.0f} s")
    print_table(rows)


if __name__ == "__main__":  # spawned workers must not re-run the fuzzer
    main()
