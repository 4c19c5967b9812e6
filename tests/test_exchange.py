"""Rollout data between ranks: summaries to every rank, each response only to the ranks that train it (gloo, 2 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from exchange_worker import G, meta, response

from megatron_dapo.launch import torchrun
from megatron_dapo.model.comm import Comm
from megatron_dapo.sampling.exchange import meta_width, metas_to_rows, rows_to_metas

HERE = Path(__file__).parent


def test_summaries_round_trip_through_a_float64_row():
    metas = [meta(k) for k in range(5)]
    rows = metas_to_rows(metas, G)
    widest = max(len(g.version_tokens) for g in metas)
    assert widest == 3 and rows.shape == (5, meta_width(G, widest)) and rows.dtype == torch.float64
    assert rows_to_metas(rows, G) == metas  # a group of fewer versions than the widest keeps its own count
    assert rows_to_metas(metas_to_rows([], G), G) == []
    assert Comm().all_gather_rows(rows) is rows  # one process: nothing moves


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """exchange_worker.py under torchrun, 2 ranks with gloo, every case in one launch: what each rank wrote."""
    out = tmp_path_factory.mktemp("exchange")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun.command(2)
    proc = subprocess.run(
        [*cmd, str(HERE / "exchange_worker.py"), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [{**json.loads((out / f"rank{r}.json").read_text()), "out": out} for r in range(2)]


def test_two_ranks_gather_summaries_and_deliver_only_what_each_trains(two_ranks):
    ranks = [r["exchange"] for r in two_ranks]
    want_metas = [meta(k).to_dict() for k in range(8)]
    for r, res in enumerate(ranks):
        assert res["metas"] == want_metas  # every rank, every group, in key order
        assert res["stopped"] == {
            "10": {"tokens": 5, "tokens_now": 2, "first_version": 7},
            "11": {"tokens": 6, "tokens_now": 2, "first_version": None},
        }
        wanted = {(k, j) for k in range(8) for j in range(G) if (k + j) % 2 == r}
        assert {tuple(map(int, s.split(","))) for s in res["got"]} == wanted  # exactly what it trains
        for sid, (tokens, logps, truncated) in res["got"].items():
            k, j = map(int, sid.split(","))
            ref = response(k, j)
            assert tokens == ref.token_ids and logps == pytest.approx(ref.logprobs) and truncated == (j == 2)
        # it sent what the other rank trains from its own groups: 4 bytes of id + 4 of logprob per token
        sent = sum(len(response(k, j).token_ids) for k in range(8) for j in range(G) if k % 2 == r and (k + j) % 2 != r)
        assert res["sent"] == 8 * sent > 0


def test_ranks_whose_schedulers_disagree_raise_on_every_rank(two_ranks):
    """Two loaders, one engine per rank: the same seed gives every rank the same batches; a different seed on rank 1
    (another prompt order) must raise after the first step on both ranks, each naming its own fingerprint."""
    ranks = [r["agreement"] for r in two_ranks]
    same = [r["same"] for r in ranks]
    assert same[0]["error"] is None and same[1]["error"] is None
    assert same[0]["steps"] == same[1]["steps"] and [len(s) for s in same[0]["steps"]] == [3, 3]
    prints = []
    for r, res in enumerate(ranks):
        error = res["different"]["error"] or ""
        assert res["different"]["steps"] == [], error  # the first step's check raised, on this rank too
        head = f"dynamic sampling: the ranks' schedulers disagree after step 1 (rank {r}: state fingerprint "
        assert error.startswith(head), error
        prints.append(int(error[len(head) :].split(")")[0]))
    assert prints[0] != prints[1]


def test_without_lockstep_a_fast_engine_generates_on_instead_of_waiting_at_the_tick(two_ranks):
    """sampler.lockstep off: the faster rank's engine takes steps past tick_steps while the slower one finishes its
    own (sampler/free_steps, the same number on both ranks), both ranks still take the same batches; on, every
    engine takes exactly the tick's steps. Two ranks driving one engine (rollout.tp = 2) take the same steps, as its
    first rank decides, or vLLM's tensor-parallel step would hang."""
    ranks = [r["free_steps"] for r in two_ranks]
    free, lockstep, tp2 = ([r[case] for r in ranks] for case in ("free", "lockstep", "tp2"))
    for both in (free, lockstep, tp2):
        assert both[0]["steps"] == both[1]["steps"] and [len(s) for s in both[0]["steps"]] == [3, 3]
        assert both[0]["free"] == both[1]["free"]
    assert sum(free[0]["free"]) > 0 and free[0]["engine_steps"] > free[1]["engine_steps"]  # the fast one stepped on
    assert lockstep[0]["free"] == [None, None] and lockstep[0]["engine_steps"] == lockstep[1]["engine_steps"]
    assert sum(tp2[0]["free"]) > 0 and tp2[0]["engine_steps"] == tp2[1]["engine_steps"]


def test_the_comm_counts_each_replica_once_and_names_its_groups(two_ranks):
    """count_once: two data-parallel replicas both count; two tensor-parallel ranks holding copies count once (the
    first), for a max too (the other adds -inf). A group of one moves nothing; a group as large as the world is the
    world, in rank order."""
    for r, res in enumerate(two_ranks):
        got = res["counting"]
        assert got["dp_sum"] == [3.0, 30.0] and got["tp_sum"] == [1.0, 10.0] and got["tp_max"] == [1.0, 10.0]
        assert got["tp_sum_over_dp"] == [1.0 + r, 10.0 * (r + 1)]
        assert got["gathered"] == [[1.0, 10.0], [2.0, 20.0]] and got["broadcast"] == [2.0, 20.0]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}] and got["max"] == [1.0, 0.0]


def test_a_lone_process_comm_moves_nothing():
    comm = Comm()
    t = torch.tensor([1.0, 2.0])
    assert (comm.rank, comm.world) == (0, 1) and comm.all_reduce(t, "tp") is t and comm.all_gather(t, "dp") == [t]
    assert comm.count_once(t, ("tp", "cp", "pp")).tolist() == [1.0, 2.0] and comm.sum([1.0, 2.0]) == [1.0, 2.0]
    assert comm.broadcast_object({"a": 1}) == {"a": 1} and comm.gather_objects(3) == [3]
    assert comm.all_gather_objects(3, "a number") == [3] and comm.max([4.0]) == [4.0]
    comm.barrier()


def test_an_object_from_another_rank_that_would_run_code_is_refused_not_run(two_ranks):
    """The exchange's door (Comm.broadcast_object, gather_objects: the rollout side's batches, the controller's plans):
    records come through; a pickle naming os.system is refused on the rank that reads it, naming it, and the file
    it would have made does not exist."""
    gathered, error = two_ranks[0]["crafted"]["gathered"], two_ranks[0]["crafted"]["error"]
    assert gathered == [[meta(0).to_dict()], [meta(1).to_dict()]] and two_ranks[1]["crafted"]["gathered"] is None
    assert error == (
        "an object broadcast by rank 1: refused to unpickle posix.system: only plain containers, numpy arrays, "
        "tensors and megatron-dapo's own records are read (megatron_dapo/safe_pickle.py ALLOWED); nothing was run"
    )
    assert not (two_ranks[0]["out"] / "ran").exists()
