"""Bytes a train rank receives per rollout step from the asynchronous rollout side: every response of the batch to
every train rank (before), against each train rank's own share (after).

    python tools/bench_batch_bytes.py                                    # the paper's shape, 64 train ranks (DP 64)
    python tools/bench_batch_bytes.py --train-ranks 64 --tp 8            # DP 8: each share goes to 8 TP peers
    python tools/bench_batch_bytes.py --groups 16 --max-tokens 2000      # seconds

A batch of the paper's shape is built without a model: --groups prompts x --group-size responses, each of a length
drawn uniformly from 1..--max-tokens, with random token ids (Qwen2.5's vocabulary), logprobs, one policy version per
token and a text of 4 characters a token, as an engine returns them. Every reply is pickled as the batches group
sends it (megatron_dapo/safe_pickle.py), one rank's at a time, so the whole batch is never held at once.

before: every train rank received the whole reply (the groups, stats and every response of the batch, broadcast);
its size is the sum of each group's responses pickled plus the rest (--check compares that sum with one pickle of
the whole reply, which needs the batch in memory: use it with a small batch).
after: each train rank receives its own reply (placement/controller.py batch_replies: the groups, stats and the
responses it trains by the trainer's split, TrainSplit). The ratio is the data-parallel size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping

import numpy as np

from megatron_dapo import safe_pickle
from megatron_dapo.placement.controller import batch_replies
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.sampling.loader import StepBatch
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.types import Response

VOCAB = 152_064  # Qwen2.5's


class Responses(Mapping):
    """key -> the group's responses, made from the seed at each access (only the last group kept: a share takes a
    group's responses one after another)."""

    def __init__(self, lengths: dict[int, list[int]], seed: int) -> None:
        self.lengths, self.seed = lengths, seed
        self.last: tuple[int, list[Response]] = (-1, [])

    def __getitem__(self, key: int) -> list[Response]:
        if self.last[0] != key:
            self.last = (key, self._make(key))
        return self.last[1]

    def _make(self, key: int) -> list[Response]:
        rng = np.random.default_rng([self.seed, key])
        return [
            Response(
                token_ids=rng.integers(0, VOCAB, n).tolist(),
                text="abcd" * n,
                logprobs=(-rng.exponential(1.0, n)).tolist(),
                versions=[7] * n,
            )
            for n in self.lengths[key]
        ]

    def __iter__(self):
        return iter(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=512, help="prompts per step (sampler.train_batch_size)")
    ap.add_argument("--group-size", type=int, default=16, help="responses per prompt (algorithm.group_size)")
    ap.add_argument("--max-tokens", type=int, default=20480, help="longest response (rollout.max_response_length)")
    ap.add_argument("--mini-batch-size", type=int, default=512, help="optim.mini_batch_size")
    ap.add_argument("--train-ranks", type=int, default=64, help="train processes")
    ap.add_argument("--tp", type=int, default=1, help="tensor x pipeline x context parallel size of the train side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare 'before' with one pickle of the whole reply")
    args = ap.parse_args(argv)
    if args.train_ranks % args.tp:
        ap.error(f"--tp {args.tp} does not divide --train-ranks {args.train_ranks}")
    dp = args.train_ranks // args.tp
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    lengths = {k: rng.integers(1, args.max_tokens + 1, args.group_size).tolist() for k in range(args.groups)}
    G = args.group_size
    groups = [
        GroupMeta(
            k, k, k % 32, 7, ls, [j % 2 == 0 for j in range(G)], [1.0] * G, [1.0] * G, [False] * G, True, [sum(ls)]
        )
        for k, ls in lengths.items()
    ]
    stats = {f"stat/{i}": float(i) for i in range(60)}  # about as many as a step reports
    batch = StepBatch(groups=groups, local={}, stats=stats)
    responses = Responses(lengths, args.seed)
    split = TrainSplit(args.mini_batch_size, dp, tuple(r // args.tp for r in range(args.train_ranks)))

    rest = len(safe_pickle.dumps({"groups": groups, "responses": {}, "stats": stats, "state": None}))
    before = rest + sum(len(safe_pickle.dumps({k: responses[k]})) for k in lengths)
    after = [len(safe_pickle.dumps(reply)) for reply in batch_replies(batch, responses, None, split)]
    tokens = sum(map(sum, lengths.values()))
    print(
        f"batch: {args.groups} groups x {G} responses, {tokens:,} tokens (lengths 1..{args.max_tokens}); "
        f"{args.train_ranks} train ranks, DP {dp}"
    )
    print(f"before (every response to every train rank): {before:,} bytes per train rank per step")
    print(f"after (each train rank its share):           {max(after):,} bytes at most, {min(after):,} at least")
    mean = sum(after) / len(after)
    print(
        f"ratio before / after: {before / mean:.2f} on average, {before / max(after):.2f} for the largest (DP = {dp})"
    )
    print(f"every train rank together: before {before * args.train_ranks:,}, after {sum(after):,} bytes")
    if args.check:
        whole = len(safe_pickle.dumps({"groups": groups, "responses": dict(responses), "stats": stats, "state": None}))
        print(
            f"check: one pickle of the whole reply {whole:,} bytes, the sum above {before:,} ({before / whole - 1:+.4%})"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
