"""Run under torchrun (gloo, 2 ranks) by tests/test_exchange.py, as `exchange_worker.py OUT_DIR`: one launch for
every case; each rank writes OUT_DIR/rank{r}.json, {case: what it saw}. exchange: gather summaries, deliver
responses, write what arrived. agreement: two dynamic-sampling loaders (a scripted engine per rank, one reward pool
each) take two steps with the same seed on both ranks, then with a different seed on rank 1; write the groups each
step trained and the error each raised. free_steps: loaders whose engines run at different speeds, with and without
sampler.lockstep. counting: model/comm.py's groups and count_once. crafted: the project's records gathered on rank 0, then rank 1 sends rank 0 a pickle that would
run a command (leaving OUT_DIR/ran): what rank 0's Comm.broadcast_object said."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch.distributed as dist
from run_helpers import RunsCode
from scripted_engine import ScriptedEngine, loader_config, make_dataset, make_loader

from megatron_dapo.model.comm import Comm
from megatron_dapo.model.parallel import init_plain_world
from megatron_dapo.reward import RewardPool
from megatron_dapo.sampling.exchange import deliver, gather_metas, gather_stopped
from megatron_dapo.sampling.records import GroupMeta, Stopped
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
        version_tokens=[sum(lengths) - 2, 1, 1] if key % 2 else [sum(lengths) - 1, 1],  # rank 1's rows are wider
        reward_timeouts=key % 2,
        reward_errors=0,
    )


def exchange(comm: Comm) -> dict:
    """Every rank's summaries to every rank, each response to the rank that trains it: what arrived, bytes sent."""
    rank = comm.rank
    keys = range(8)
    mine = [meta(k) for k in keys if k % 2 == rank]
    metas = gather_metas(comm, mine, G)
    stopped = gather_stopped(comm, {10 + rank: Stopped(5 + rank, 2, None if rank else 7)})
    local = {k: [response(k, j) for j in range(G)] for k in keys if k % 2 == rank}
    # rank r trains the samples whose (key + j) % 2 == r: half its own, half the other rank's
    wanted = {r: [(k, j) for k in keys for j in range(G) if (k + j) % 2 == r] for r in range(2)}
    got, sent = deliver(comm, metas, local, owner_rank=lambda g: g.engine, wanted_by=lambda r: wanted[r])
    return {
        "metas": [m.to_dict() for m in metas],
        "stopped": {str(k): vars(v) for k, v in stopped.items()},
        "got": {f"{k},{j}": [r.token_ids, r.logprobs, r.truncated] for (k, j), r in got.items()},
        "sent": sent,
    }


def scripted(prompt: int, j: int, seed: int) -> tuple[int, bool]:
    """Prompt p's sample j: 1-5 tokens, the first 1 + p % 3 of the group's 4 right (every group informative)."""
    return 1 + (prompt + 3 * j) % 5, j < 1 + prompt % 3


def small_config(**fields):
    """Groups of 4, batches of 3, responses up to 8 tokens, a decision every 2 engine steps; `fields` on top."""
    return loader_config(
        group_size=4,
        train_batch_size=3,
        gen_batch_size=4,
        max_response_length=8,
        overlong_buffer_len=2,
        tick_steps=2,
        **fields,
    )


def agreement(comm: Comm) -> dict:
    """{"same" | "different": {"steps": [[prompt index of each trained group] per step], "error": str | None}}."""
    out = {}
    with RewardPool(num_workers=1) as pool:
        for case, seeds in (("same", (5, 5)), ("different", (5, 6))):
            cfg = small_config(seed=seeds[comm.rank])
            engines = {comm.rank: ScriptedEngine(scripted, capacity=8)}
            loader = make_loader(cfg, make_dataset(40), engines, pool, num_engines=2, comm=comm)
            steps, error = [], None
            try:
                for _ in range(2):
                    steps.append([g.index for g in loader.next_batch().groups])
            except RuntimeError as e:
                error = str(e)
            out[case] = {"steps": steps, "error": error}
    return out


class SlowEngine(ScriptedEngine):
    """A scripted engine whose every step takes `delay` seconds more: the slowest engine of a tick."""

    def __init__(self, script, capacity: int, delay: float) -> None:
        super().__init__(script, capacity=capacity)
        self.delay = delay

    def step(self):
        time.sleep(self.delay)
        return super().step()


def free_steps(comm: Comm) -> dict:
    """Rank 1's engine 5 ms slower a step. Cases: "free" (sampler.lockstep off, an engine per rank), "lockstep"
    (on), "tp2" (off, one engine driven by both ranks, as rollout.tp = 2 drives one): {case: {"steps": [[prompt
    index of each trained group] per step], "free": [sampler/free_steps per step], "engine_steps": this rank's}}."""
    out = {}
    with RewardPool(num_workers=1) as pool:
        for case, num_engines, lockstep in (("free", 2, False), ("lockstep", 2, True), ("tp2", 1, False)):
            cfg = small_config(seed=5, lockstep=lockstep)
            engine_id = comm.rank % num_engines
            engine = SlowEngine(scripted, capacity=8, delay=0.005 * comm.rank)
            owned = {engine_id} if comm.rank < num_engines else set()  # an engine's first rank holds its groups
            loader = make_loader(
                cfg, make_dataset(40), {engine_id: engine}, pool, num_engines=num_engines, owned=owned, comm=comm
            )
            steps, free = [], []
            for _ in range(2):
                batch = loader.next_batch()
                steps.append([g.index for g in batch.groups])
                free.append(batch.stats.get("sampler/free_steps"))
            out[case] = {"steps": steps, "free": free, "engine_steps": engine.steps}
    return out


def counting(comm: Comm) -> dict:
    """The Comm's groups and its one rule for counting replicas once, over this world seen two ways: two data-parallel
    replicas (the plain world), and one tensor-parallel group of two ranks holding copies of the same numbers."""
    import torch

    rank = comm.rank
    tp = Comm(replace(comm.layout, tp=2, dp=1, tp_rank=rank, dp_rank=0))
    mine = torch.tensor([1.0 + rank, 10.0 * (rank + 1)], dtype=torch.float64)  # which rank counted shows
    return {
        "dp_sum": comm.count_once(mine, ("tp",)).tolist(),  # tp=1: every rank is its own replica
        "tp_sum": tp.count_once(mine, ("tp",)).tolist(),  # the TP group's first rank counts
        "tp_max": tp.count_once(mine, ("tp",), "max").tolist(),
        "tp_sum_over_dp": tp.sum(mine.tolist(), "dp"),  # a group of one: nothing moves
        "gathered": [t.tolist() for t in tp.all_gather(mine, "tp")],
        "broadcast": tp.broadcast(mine.clone(), 1, "tp").tolist(),
        "objects": tp.all_gather_objects({"rank": rank}, "a test's object", over="tp"),
        "max": comm.max([float(rank), -float(rank)]),
    }


def crafted(comm: Comm, out_dir: str) -> dict:
    import pickle

    import torch

    from megatron_dapo.model.comm import broadcast_bytes
    from megatron_dapo.safe_pickle import RefusedPickle

    gathered = comm.gather_objects([meta(comm.rank)], dst=0)
    data = pickle.dumps([RunsCode(f"{out_dir}/ran")]) if comm.rank == 1 else None
    error = None
    if comm.rank == 1:  # what an attacker on the network sends: bytes, as Comm sends objects
        broadcast_bytes(data, True, lambda t: dist.broadcast(t, src=1), torch.device("cpu"))
    else:
        try:
            comm.broadcast_object(None, src=1)
        except RefusedPickle as e:
            error = str(e)
    return {"gathered": gathered and [[m.to_dict() for m in part] for part in gathered], "error": error}


def main(out_dir: str) -> None:
    comm = Comm(init_plain_world())
    result = {case.__name__: case(comm) for case in (exchange, agreement, free_steps, counting)}
    result["crafted"] = crafted(comm, out_dir)
    with open(f"{out_dir}/rank{comm.rank}.json", "w") as f:
        json.dump(result, f)
    comm.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
