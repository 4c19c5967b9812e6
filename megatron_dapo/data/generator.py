"""Offline math problems with exact integer answers, for tests and the CPU demo (nothing can be downloaded).

Two kinds, deterministic from a seed:

- 'arithmetic': ``What is 37 + 48 * 2?`` with a difficulty knob (number of operands, largest operand);
- 'word': GSM8K-style word problems from a handful of templates (shopping, ages, rates, travel,
  packing, savings), each with a short worked solution in GSM8K's style (``<<a*b=c>>`` calculator notes).

Rows come in the DAPO-Math-17K schema (prompt messages + reward_model.ground_truth) or the GSM8K
schema (question + answer ending with ``#### N``), and are written as JSONL or Parquet:

    python -m megatron_dapo.data.generator --kind word --schema gsm8k --n 1000 --seed 0 --out train.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.choices import DATASET_SCHEMAS
from megatron_dapo.cli import argument_parser

KINDS = ("arithmetic", "word")
SCHEMAS = DATASET_SCHEMAS

DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_DATA_SOURCE = "synthetic_dapo"
GSM8K_DATA_SOURCE = "synthetic_gsm8k"

_NAMES = ("Maria", "Tom", "Aisha", "Kenji", "Lena", "Omar", "Priya", "Diego", "Sofia", "Jamal", "Mei", "Noah")
_ITEMS = (("apple", "apples"), ("pencil", "pencils"), ("notebook", "notebooks"), ("mango", "mangoes"), ("cup", "cups"))


@dataclass(frozen=True)
class Problem:
    """question: str; solution: str (worked steps, the answer last); answer: int (exact)."""

    question: str
    solution: str
    answer: int


# ---------------------------------------------------------------- arithmetic


def _calc(expr: str, value: int) -> str:
    """GSM8K's calculator annotation: '3*4' -> '<<3*4=12>>12'."""
    return f"<<{expr}={value}>>{value}"


def arithmetic_problem(rng: random.Random, n_operands: int = 3, max_operand: int = 50) -> Problem:
    """A '+', '-', '*' expression of n_operands integers in [1, max_operand], evaluated with precedence."""
    if n_operands < 2 or max_operand < 1:
        raise ValueError(
            f"n_operands={n_operands}, max_operand={max_operand}: expected n_operands >= 2, max_operand >= 1"
        )
    nums = [rng.randint(1, max_operand) for _ in range(n_operands)]
    ops = [rng.choice("+-*") for _ in range(n_operands - 1)]
    expr = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
    steps: list[str] = []
    # multiplication first: fold each run of '*' into one term, left to right
    terms, signs = [nums[0]], []
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            product = terms[-1] * n
            steps.append(f"Multiply first: {terms[-1]} * {n} = {_calc(f'{terms[-1]}*{n}', product)}.")
            terms[-1] = product
        else:
            terms.append(n)
            signs.append(op)
    # then additions and subtractions, left to right
    total = terms[0]
    for op, n in zip(signs, terms[1:]):
        new = total + n if op == "+" else total - n
        steps.append(f"{'Then' if steps else 'First'} {total} {op} {n} = {_calc(f'{total}{op}{n}', new)}.")
        total = new
    if not steps:  # unreachable with n_operands >= 2; kept so the solution is never empty
        steps.append(f"The value is {total}.")
    steps.append(f"So {expr} = {total}.")
    return Problem(f"What is {expr}?", "\n".join(steps), total)


# ---------------------------------------------------------------- word problems


def _shopping(rng: random.Random, m: int) -> Problem:
    name = rng.choice(_NAMES)
    (_, item_a), (_, item_b) = rng.sample(_ITEMS, 2)
    a, pa, b, pb = rng.randint(2, m), rng.randint(1, m), rng.randint(2, m), rng.randint(1, m)
    cost_a, cost_b = a * pa, b * pb
    total = cost_a + cost_b
    bill = next(x for x in (10, 20, 50, 100, 200, 500, 1000, 5000, 10000, 10**6) if x >= total)
    change = bill - total
    q = (
        f"{name} buys {a} {item_a} at ${pa} each and {b} {item_b} at ${pb} each. "
        f"{name} pays with a ${bill} bill. How many dollars of change does {name} get back?"
    )
    s = [
        f"The {item_a} cost {a} * {pa} = ${_calc(f'{a}*{pa}', cost_a)}.",
        f"The {item_b} cost {b} * {pb} = ${_calc(f'{b}*{pb}', cost_b)}.",
        f"Together they cost {cost_a} + {cost_b} = ${_calc(f'{cost_a}+{cost_b}', total)}.",
        f"The change is {bill} - {total} = ${_calc(f'{bill}-{total}', change)}.",
    ]
    return Problem(q, "\n".join(s), change)


def _ages(rng: random.Random, m: int) -> Problem:
    older, younger = rng.sample(_NAMES, 2)
    y, d, k = rng.randint(2, m), rng.randint(1, m), rng.randint(1, m)
    o = y + d
    y_later, o_later = y + k, o + k
    total = y_later + o_later
    q = (
        f"{younger} is {y} years old. {older} is {d} years older than {younger}. "
        f"In {k} years, what will be the sum of their ages?"
    )
    s = [
        f"{older} is {y} + {d} = {_calc(f'{y}+{d}', o)} years old now.",
        f"In {k} years {younger} will be {y} + {k} = {_calc(f'{y}+{k}', y_later)}.",
        f"In {k} years {older} will be {o} + {k} = {_calc(f'{o}+{k}', o_later)}.",
        f"The sum is {y_later} + {o_later} = {_calc(f'{y_later}+{o_later}', total)}.",
    ]
    return Problem(q, "\n".join(s), total)


def _rates(rng: random.Random, m: int) -> Problem:
    r, h, d = rng.randint(2, m), rng.randint(1, 12), rng.randint(1, 7)
    per_day = r * h
    made = per_day * d
    broken = rng.randint(0, min(m, made))
    good = made - broken
    q = (
        f"A machine makes {r} toys per hour. It runs {h} hours a day for {d} days. "
        f"{broken} of the toys turn out broken. How many toys are not broken?"
    )
    s = [
        f"Each day it makes {r} * {h} = {_calc(f'{r}*{h}', per_day)} toys.",
        f"In {d} days it makes {per_day} * {d} = {_calc(f'{per_day}*{d}', made)} toys.",
        f"Without the broken ones that is {made} - {broken} = {_calc(f'{made}-{broken}', good)} toys.",
    ]
    return Problem(q, "\n".join(s), good)


def _travel(rng: random.Random, m: int) -> Problem:
    name = rng.choice(_NAMES)
    s1, t1, s2, t2 = rng.randint(10, 10 * m), rng.randint(1, 6), rng.randint(10, 10 * m), rng.randint(1, 6)
    d1, d2 = s1 * t1, s2 * t2
    total = d1 + d2
    q = (
        f"{name} drives at {s1} km per hour for {t1} hours, then at {s2} km per hour for {t2} hours. "
        f"How many kilometers does {name} drive in total?"
    )
    s = [
        f"The first part is {s1} * {t1} = {_calc(f'{s1}*{t1}', d1)} km.",
        f"The second part is {s2} * {t2} = {_calc(f'{s2}*{t2}', d2)} km.",
        f"In total that is {d1} + {d2} = {_calc(f'{d1}+{d2}', total)} km.",
    ]
    return Problem(q, "\n".join(s), total)


def _packing(rng: random.Random, m: int) -> Problem:
    name = rng.choice(_NAMES)
    per_box, boxes = rng.randint(2, m), rng.randint(2, m)
    sold = rng.randint(1, boxes)
    cookies = per_box * boxes
    left = boxes - sold
    q = (
        f"{name} bakes {cookies} cookies and packs them into boxes of {per_box}. "
        f"{name} sells {sold} boxes. How many boxes are left?"
    )
    s = [
        f"{name} fills {cookies} / {per_box} = {_calc(f'{cookies}/{per_box}', boxes)} boxes.",
        f"After selling {sold}, {boxes} - {sold} = {_calc(f'{boxes}-{sold}', left)} boxes are left.",
    ]
    return Problem(q, "\n".join(s), left)


def _savings(rng: random.Random, m: int) -> Problem:
    name = rng.choice(_NAMES)
    w, n = rng.randint(2, m), rng.randint(2, m)
    saved = w * n
    spent = rng.randint(1, saved)
    left = saved - spent
    q = f"{name} saves ${w} every week for {n} weeks, then spends ${spent} on a bike. How many dollars are left?"
    s = [
        f"{name} saves {w} * {n} = ${_calc(f'{w}*{n}', saved)}.",
        f"After the bike, {saved} - {spent} = ${_calc(f'{saved}-{spent}', left)} are left.",
    ]
    return Problem(q, "\n".join(s), left)


WORD_TEMPLATES: dict[str, Callable[[random.Random, int], Problem]] = {
    "shopping": _shopping,
    "ages": _ages,
    "rates": _rates,
    "travel": _travel,
    "packing": _packing,
    "savings": _savings,
}


def word_problem(rng: random.Random, max_value: int = 20, template: Optional[str] = None) -> Problem:
    """A GSM8K-style word problem; max_value scales its numbers; template picks one of WORD_TEMPLATES."""
    if max_value < 2:
        raise ValueError(f"max_value={max_value}: expected an integer >= 2")
    name = template if template is not None else rng.choice(sorted(WORD_TEMPLATES))
    if name not in WORD_TEMPLATES:
        raise ValueError(f"template={name!r}: expected one of {sorted(WORD_TEMPLATES)}")
    return WORD_TEMPLATES[name](rng, max_value)


# ---------------------------------------------------------------- rows and files


def generate_problems(
    kind: str = "arithmetic",
    n: int = 100,
    seed: int = 0,
    n_operands: int = 3,
    max_operand: int = 50,
    max_value: int = 20,
) -> list[Problem]:
    """n problems of kind 'arithmetic' (n_operands, max_operand) or 'word' (max_value), deterministic from seed."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    rng = random.Random(seed)
    if kind == "arithmetic":
        return [arithmetic_problem(rng, n_operands, max_operand) for _ in range(n)]
    return [word_problem(rng, max_value) for _ in range(n)]


def to_dapo_row(problem: Problem, index: int = 0) -> dict[str, Any]:
    """A row in the DAPO-Math-17K schema, with its prompt wording."""
    return {
        "data_source": DAPO_DATA_SOURCE,
        "prompt": [{"role": "user", "content": DAPO_PROMPT_PREFIX + problem.question + DAPO_PROMPT_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"index": str(index)},
    }


def to_gsm8k_row(problem: Problem) -> dict[str, Any]:
    """A row in the GSM8K schema: the answer is the worked solution then '#### N'."""
    return {
        "question": problem.question,
        "answer": f"{problem.solution}\n#### {problem.answer}",
        "data_source": GSM8K_DATA_SOURCE,
    }


def generate_rows(
    kind: str = "arithmetic", schema: str = "dapo", n: int = 100, seed: int = 0, **knobs: int
) -> list[dict]:
    """n rows of schema 'dapo' or 'gsm8k'; knobs go to generate_problems (n_operands, max_operand, max_value)."""
    if schema not in SCHEMAS:
        raise ValueError(f"schema={schema!r}: expected one of {SCHEMAS}")
    problems = generate_problems(kind, n, seed, **knobs)
    if schema == "dapo":
        return [to_dapo_row(p, i) for i, p in enumerate(problems)]
    return [to_gsm8k_row(p) for p in problems]


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    """One JSON object per line, UTF-8 (non-ASCII kept as is). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_parquet(path: str | Path, rows: Iterable[dict]) -> Path:
    """All rows in one Parquet table; nested dicts become structs, a key a row lacks is null. Returns the path."""
    import pyarrow as pa  # deferred: JSONL-only users never pay for importing pyarrow
    import pyarrow.parquet as pq

    rows = list(rows)
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's keys, in order of first appearance
    # column by column: Table.from_pylist would take the columns from the first row alone
    table = pa.Table.from_pydict({k: pa.array([row.get(k) for row in rows]) for k in keys})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: write --n generated rows to --out (.jsonl or .parquet)."""
    ap = argument_parser(__doc__, prog="python -m megatron_dapo.data.generator")
    ap.add_argument("--kind", choices=KINDS, default="arithmetic")
    ap.add_argument("--schema", choices=SCHEMAS, default="dapo")
    ap.add_argument("--n", type=int, default=1000, help="number of rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="output file, .jsonl or .parquet")
    ap.add_argument("--operands", type=int, default=3, help="arithmetic: operands per expression")
    ap.add_argument("--max-operand", type=int, default=50, help="arithmetic: largest operand")
    ap.add_argument("--max-value", type=int, default=20, help="word: scale of the numbers")
    args = ap.parse_args(argv)
    if args.out.suffix not in (".jsonl", ".parquet"):
        ap.error(f"--out {args.out}: expected a .jsonl or .parquet file")
    rows = generate_rows(
        args.kind,
        args.schema,
        args.n,
        args.seed,
        n_operands=args.operands,
        max_operand=args.max_operand,
        max_value=args.max_value,
    )
    (write_jsonl if args.out.suffix == ".jsonl" else write_parquet)(args.out, rows)
    print(f"wrote {len(rows)} {args.kind} rows ({args.schema} schema, seed {args.seed}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
