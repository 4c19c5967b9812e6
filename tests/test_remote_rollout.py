"""Asynchronous DAPO's two ends in one process (placement/remote.py, placement/controller.py): two train ranks'
RemoteRollout and the real RolloutController (its start, plan, hand-out, weight updates and evaluations) over real
transport groups, each side a thread; the controller drives a stand-in loader, engine and evaluator (what
build_rollout_parts gives a rollout process), so no model runs.
"""

from __future__ import annotations

import socket
import threading

import torch

from megatron_dapo.config import load_config
from megatron_dapo.model.comm import Comm
from megatron_dapo.placement.controller import serve
from megatron_dapo.placement.remote import RemoteRollout
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.placement.transport import Transport
from megatron_dapo.rollout.weight_transport import WeightReceiver
from megatron_dapo.sampling.loader import StepBatch
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.types import EvalRequest, Prompt, Response

G = 4
TIMEOUT_S = 30.0


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the batches and weights groups)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


class StandInLoader:
    """DynamicSamplingLoader as the controller drives it: batch k is groups 2k and 2k + 1 of G responses, collected
    over two ticks; driven records (batch, the driver's weights at its start)."""

    def __init__(self) -> None:
        self.version = 0
        self.driven: list[tuple[int, int]] = []

    def next_batch(self, driver) -> StepBatch:
        self.driven.append((self.version, driver.weights()))
        for _ in range(2):
            driver.between_ticks()
        k, self.version = self.version, self.version + 1
        keys = (2 * k, 2 * k + 1)
        groups = [
            GroupMeta(key, key, 0, k, [2] * G, [True, False] * 2, [1.0] * G, [1.0] * G, [False] * G, True, [2 * G])
            for key in keys
        ]
        local = {key: [Response([key, j], f"{key}/{j}") for j in range(G)] for key in keys}
        return StepBatch(groups=groups, local=local, stats={"sampler/gen_rounds": 1.0})

    def state_dict(self):
        return {"scheduler": {"batches": self.version}, "finished": {}, "partial": {}}


class StandInEngine:
    weight_format = "none"

    def __init__(self) -> None:
        self.updates: list[tuple[int, float]] = []  # (version, the update's one tensor's first value)

    def update_weights_in_flight(self, tensors, version: int, recompute_kv: bool) -> dict[str, float]:
        received = list(tensors)  # the whole update, as an engine takes it
        self.updates.append((version, float(received[0][1][0])))
        return {"pause_s": 0.0}


class StandInEvaluator:
    def __init__(self, engine: StandInEngine) -> None:
        self.engine, self.runs = engine, []

    def run(self, request: EvalRequest) -> dict[str, float]:
        problems = -1 if request.prompts is None else len(request.prompts)
        self.runs.append((self.engine.updates[-1][0], request.k, problems))
        return {"eval/k": float(request.k), "eval/problems": float(problems)}


class Weights:
    """A WeightSource of one tensor holding the version."""

    def sync(self, engine, version: int = 0) -> dict[str, float]:
        engine.update_weights([("w", torch.full((3,), float(version)))], None)
        engine.finish_weight_update()
        return {"weight_sync/seconds": 0.0}


def test_the_train_ranks_get_their_shares_and_evaluations_of_chosen_prompts_and_the_validation_set():
    """Each train rank receives the batch's groups and only the responses it trains (rank 0 also the loader state),
    in bytes it reports; an evaluation asked with a sync (the validation set) and one of chosen prompts asked of the
    weights last sent (Trainer.evaluate's) both run on the rollout side, on the weights they ask about, whether their
    result is read at once or only after the next sync; at eta = 0 each batch is collected with the weights that
    train it."""
    cfg = load_config(
        None, ["sampler.max_staleness=0", f"trainer.collective_timeout_s={TIMEOUT_S}", "trainer.stall_timeout_s=20"]
    )
    port, split = _two_free_ports(), TrainSplit(mini_batch_size=8, dp=2, dp_rank_of=(0, 1))
    transport = Transport("127.0.0.1", port, train_procs=2)
    loader, engine = StandInLoader(), StandInEngine()
    evaluator, errors, seen = StandInEvaluator(engine), [], {0: {}, 1: {}}

    def controller() -> None:
        try:
            batches, weights = transport.connect("rollout", 0, 1, "gloo", TIMEOUT_S)
            serve(cfg, loader, engine, evaluator, batches, WeightReceiver(weights, src=1), Comm())
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(("controller", repr(e)))

    def train(rank: int) -> None:
        got = seen[rank]
        try:
            rollout = RemoteRollout(transport, rank, 1, "gloo", TIMEOUT_S, split)
            rollout.start(None, Weights(), 0)
            first = rollout.next_batch()
            got["shares"] = [sorted(rollout.responses(first)[0])]
            got["bytes"], got["state"] = first.stats["pipeline/batch_bytes"], rollout.state_dict()
            val = EvalRequest(k=3, temperature=0.6, top_p=1.0, max_tokens=8)
            got["val"] = rollout.sync(Weights(), 1, evaluate=val).evaluation.result()
            second = rollout.next_batch()
            got["shares"].append(sorted(rollout.responses(second)[0]))
            prompts = [Prompt(i, [], "", [1, 2], "1", "test") for i in range(2)]
            chosen = rollout.evaluate(EvalRequest(k=2, temperature=0.0, top_p=1.0, max_tokens=8, prompts=prompts))
            rollout.sync(Weights(), 2)  # the evaluation asked before it is of weights 1 still
            got["chosen"] = chosen.result()
            rollout.close()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append((f"train {rank}", repr(e)))

    threads = [threading.Thread(target=controller, daemon=True)]
    threads += [threading.Thread(target=train, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert seen[0]["shares"] == [[(0, j) for j in range(G)], [(2, j) for j in range(G)]]
    assert seen[1]["shares"] == [[(1, j) for j in range(G)], [(3, j) for j in range(G)]]
    assert seen[0]["state"] == {"scheduler": {"batches": 1}, "finished": {}, "partial": {}} and seen[1]["state"] is None
    assert 0 < seen[1]["bytes"] < seen[0]["bytes"]  # rank 0's reply holds the state too
    assert all(seen[r]["val"] == {"eval/k": 3.0, "eval/problems": -1.0} for r in (0, 1))
    assert all(seen[r]["chosen"] == {"eval/k": 2.0, "eval/problems": 2.0} for r in (0, 1))
    assert evaluator.runs == [(1, 3, -1), (1, 2, 2)]  # both of weights 1
    assert engine.updates == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert loader.driven[:2] == [(0, 0), (1, 1)]  # eta = 0: batch k from weights k
