"""Run under torchrun (gloo, 2 ranks) by tests/test_exchange.py: gather summaries, deliver responses, write what arrived."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from megatron_dapo.data.exchange import Comm, deliver, gather_metas, gather_stopped
from megatron_dapo.data.records import GroupMeta, Stopped
from megatron_dapo.types import Response

G = 3


def response(key: int, j: int) -> Response:
    """What engine rank key % 2 generated for sample j of group key: recognisable ids and logprobs."""
    n = 1 + (key * 5 + j) % 7
    return Response(
        token_ids=[key * 100 + j * 10 + t for t in range(n)],
        text="x",
        logprobs=[-0.25 * (t + 1) - key for t in range(n)],
        truncated=j == 2,
    )


def meta(key: int) -> GroupMeta:
    lengths = [len(response(key, j).token_ids) for j in range(G)]
    return GroupMeta(
        key=key,
        index=key + 1000,
        engine=key % 2,
        version=3,
        lengths=lengths,
        acc=[j == 0 for j in range(G)],
        scores=[0.5 * j for j in range(G)],
        rewards=[0.5 * j - 0.125 for j in range(G)],
        truncated=[j == 2 for j in range(G)],
        informative=key % 3 != 0,
        version_tokens=[sum(lengths) - 1, 1],
        reward_timeouts=key % 2,
        reward_errors=0,
    )


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    comm = Comm()
    rank = comm.rank
    keys = range(8)
    mine = [meta(k) for k in keys if k % 2 == rank]
    metas = gather_metas(comm, mine, G, max_staleness=1)
    stopped = gather_stopped(comm, {10 + rank: Stopped(5 + rank, 2, None if rank else 7)})
    local = {k: [response(k, j) for j in range(G)] for k in keys if k % 2 == rank}
    # rank r trains the samples whose (key + j) % 2 == r: half its own, half the other rank's
    wanted = {r: [(k, j) for k in keys for j in range(G) if (k + j) % 2 == r] for r in range(2)}
    got, sent = deliver(comm, metas, local, owner_rank=lambda g: g.engine, wanted_by=lambda r: wanted[r])
    result = {
        "metas": [m.to_dict() for m in metas],
        "stopped": {str(k): vars(v) for k, v in stopped.items()},
        "got": {f"{k},{j}": [r.token_ids, r.logprobs, r.truncated] for (k, j), r in got.items()},
        "sent": sent,
    }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
