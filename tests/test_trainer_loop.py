"""The Trainer loop against the rollout protocol (megatron_dapo/placement/protocol.py), without engines: a stand-in
rollout written here implements `Rollout` (scripted batches of groups and responses, syncs that record the versions and
the weights they carried, evaluations asked for and answered), and the real Trainer (the tiny model, Megatron on one
CPU process) runs its steps against it. Also the split both sides hold: which train rank gets which response.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from run_helpers import python_path

from megatron_dapo.placement.evaluation import Evaluation, Synced
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.sampling.loader import StepBatch
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.types import Response

REPO = Path(__file__).resolve().parent.parent
G, GROUPS = 4, 4  # algorithm.group_size, sampler.train_batch_size: 16 responses, 2 mini-batches of 8


class StandInRollout:
    """placement.protocol.Rollout without engines: batch k holds GROUPS groups of G scripted responses; sync() is a
    weight sink for the real bridge (it records each version's tensors); evaluations answer with the version they
    were asked of. calls: what the trainer asked, in order. short: the next responses() leaves one out."""

    def __init__(self, dataset, split: TrainSplit, weights, version: int, state) -> None:
        self.dataset, self.split = dataset, split
        self.calls: list[list] = [["start", version, state]]
        self.version: int | None = None
        self.batches = 0
        self.short = False
        self.received: dict[str, float] = {}  # the sync in progress: name -> sum of the tensor
        self.weights: dict[int, dict[str, float]] = {}  # version -> what it carried
        self.sync(weights, version)

    # the bridge's WeightSink
    def update_weights(self, named_tensors, digest=None) -> None:
        self.received.update({name: float(t.double().sum()) for name, t in named_tensors})

    def finish_weight_update(self) -> None:
        pass

    # the Rollout protocol
    def next_batch(self) -> StepBatch:
        k = self.batches
        self.batches += 1
        self.calls.append(["next_batch", k])
        groups, local = [], {}
        for i in range(GROUPS):
            key, index = k * GROUPS + i, (k * GROUPS + i) % len(self.dataset)
            lengths = [3 + (key + j) % 5 for j in range(G)]
            acc = [(key + j) % 2 == 0 for j in range(G)]  # two right of four: every group informative
            rewards = [1.0 if a else -1.0 for a in acc]
            groups.append(
                GroupMeta(
                    key=key,
                    index=index,
                    engine=0,
                    version=k,
                    lengths=lengths,
                    acc=acc,
                    scores=rewards,
                    rewards=rewards,
                    truncated=[False] * G,
                    informative=True,
                    version_tokens=[sum(lengths)],
                )
            )
            local[key] = [
                Response(token_ids=[10 + (key * 7 + j + t) % 250 for t in range(n)], text="", logprobs=[-4.0] * n)
                for j, n in enumerate(lengths)
            ]
        return StepBatch(groups=groups, local=local, stats={"sampler/gen_rounds": 1.0, "stand_in/batch": float(k)})

    def responses(self, batch: StepBatch) -> tuple[dict, float]:
        self.calls.append(["responses", int(batch.stats["stand_in/batch"])])
        out = {(key, j): r for key, group in batch.local.items() for j, r in enumerate(group)}
        if self.short:  # a protocol break: one response of this rank's share missing
            out.pop(self.split.wanted_by(batch.groups)(0)[-1])
        return out, 0.0

    def sync(self, weights, version: int, evaluate=None) -> Synced:
        self.calls.append(["sync", version, None if evaluate is None else evaluate.k])
        self.received = {}
        metrics = weights.sync(self, version)
        self.weights[version], self.version = self.received, version
        if evaluate is None:
            return Synced(metrics)
        return Synced(metrics, Evaluation(version, evaluate, self._answer))

    def evaluate(self, request) -> Evaluation:
        evaluation = Evaluation(self.version, request, self._answer)
        self._answer(evaluation)
        return evaluation

    def _answer(self, evaluation: Evaluation) -> None:
        request = evaluation.request
        problems = len(request.prompts) if request.prompts is not None else -1.0  # -1: the validation set
        self.calls.append(["evaluated", evaluation.version, request.k, problems])
        evaluation.resolve({"eval/avg_at_k": evaluation.version / 10, "eval/k": float(request.k)})

    def state_dict(self):
        return {"scheduler": {"stand_in": self.batches}, "finished": {}, "partial": {}}

    def close(self, *, exiting: bool = False) -> None:
        self.calls.append(["close", exiting])


def drive(model: str, root: str) -> None:
    """In a process of its own (Megatron's state is process-wide): the real Trainer against StandInRollout, three
    steps whose third gets a short delivery, as train.py drives it (a step's evaluation read after it); then an
    evaluation of chosen prompts. Writes root/result.json."""
    from megatron_dapo.config import load_config
    from megatron_dapo.data.generator import generate_rows, write_jsonl
    from megatron_dapo.trainer import Trainer

    out_dir = Path(root)
    write_jsonl(out_dir / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=16, seed=0))
    write_jsonl(out_dir / "val.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=4, seed=1))  # never read
    cfg = load_config(
        None,
        [
            f"model.hf_path={model}",
            "model.dtype=fp32",
            f"data.train_files=[{out_dir / 'train.jsonl'}]",
            f"data.val_files=[{out_dir / 'val.jsonl'}]",
            "data.max_prompt_length=480",
            "rollout.max_response_length=24",
            "algorithm.overlong_buffer_len=8",
            f"algorithm.group_size={G}",
            f"sampler.train_batch_size={GROUPS}",
            f"sampler.gen_batch_size={GROUPS}",
            "optim.mini_batch_size=8",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            "trainer.total_steps=3",
            f"trainer.run_dir={out_dir / 'run'}",
            "eval.every=2",
            "eval.k=3",
        ],
    )
    stand_ins: list[StandInRollout] = []

    def make_rollout(cfg, tokenizer, dataset, comm, split, weights, version, state):
        stand_ins.append(StandInRollout(dataset, split, weights, version, state))
        return stand_ins[-1]

    trainer = Trainer(cfg, make_rollout=make_rollout)
    rollout, result = stand_ins[0], {"steps": [], "error": None}
    try:
        for step in range(3):
            rollout.short = step == 2
            try:
                metrics = trainer.train_step()
            except RuntimeError as e:
                result["error"] = str(e)
                break
            if trainer.evaluation is not None:
                metrics.update(trainer.evaluation.result())
            result["steps"].append(metrics)
        result["chosen"] = trainer.evaluate(list(trainer.dataset)[:2], k=2)
        result["loader"] = trainer.state_dict()["loader"]
    finally:
        trainer.close(exiting=True)  # as train.py's last call: the rollout is told the process ends next
    result["calls"] = rollout.calls
    result["weights_changed"] = [rollout.weights[v] != rollout.weights[v - 1] for v in sorted(rollout.weights)[1:]]
    result["tensors"] = len(rollout.weights[0])
    (out_dir / "result.json").write_text(json.dumps(result))


def test_the_loop_drives_a_stand_in_rollout_through_its_protocol(tiny_qwen2, tmp_path):
    """The Trainer's calls on a Rollout, in order: built ready (the first weights synced as version 0), then per
    step next_batch, responses, sync of the next version (with the eval section's request when eval.every says so,
    whose result the loop reads after the step), and evaluate() for chosen prompts of the weights last synced; each
    sync carries the trained weights (every tensor, changed by the step); the metrics are the step's; a delivery that
    does not cover the rank's share is a clear error, before anything trains."""
    env = {**os.environ, "PYTHONPATH": python_path(REPO, REPO / "tests"), "OMP_NUM_THREADS": "1"}
    code = f"import test_trainer_loop as t; t.drive({str(tiny_qwen2())!r}, {str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["calls"] == [
        ["start", 0, None],
        ["sync", 0, None],
        ["next_batch", 0],
        ["responses", 0],
        ["sync", 1, None],
        ["next_batch", 1],
        ["responses", 1],
        ["sync", 2, 3],  # eval.every=2: the eval section's request (eval.k=3) rides with the weights it evaluates
        ["evaluated", 2, 3, -1],  # of the validation set, when the loop reads the step's result
        ["next_batch", 2],
        ["responses", 2],  # short: the step stops here
        ["evaluated", 2, 2, 2],  # Trainer.evaluate: 2 chosen prompts, the weights last synced
        ["close", True],  # exiting passed on: an engine would skip freeing what the exit frees
    ]
    assert got["tensors"] > 0 and got["weights_changed"] == [True, True]
    steps = got["steps"]
    assert [m["step"] for m in steps] == [1.0, 2.0] and [m["trainer/optimizer_steps"] for m in steps] == [2.0, 4.0]
    assert all(m["trainer/updates"] == 2.0 and m["sampler/bytes_moved"] == 0.0 for m in steps)
    assert [m["stand_in/batch"] for m in steps] == [0.0, 1.0] and all(m["weight_sync/buckets"] >= 1 for m in steps)
    assert "eval/avg_at_k" not in steps[0] and steps[1]["eval/avg_at_k"] == 0.2 and steps[1]["eval/k"] == 3.0
    assert got["chosen"] == {"eval/avg_at_k": 0.2, "eval/k": 2.0}
    assert got["loader"] == {"scheduler": {"stand_in": 3}, "finished": {}, "partial": {}}
    assert (
        "the rollout side delivered no response for 1 of those the train ranks train (this rank: 1 of its 16)"
        in (got["error"])
    )
    assert "Rollout.responses must cover each rank's share" in got["error"]


def test_the_controller_sends_each_train_rank_only_the_responses_it_trains():
    """Asynchronous (placement/controller.py batch_replies): each train rank's reply holds the groups and stats and
    exactly the responses it trains by the trainer's split (TP peers the same share, each data-parallel rank its
    slice of every mini-batch), the loader state on train rank 0 only."""
    from megatron_dapo.placement.controller import batch_replies

    groups = [
        GroupMeta(k, k, 0, 0, [1] * G, [True, False] * (G // 2), [1.0] * G, [1.0] * G, [False] * G, True, [G])
        for k in (5, 6, 9, 11)
    ]
    responses = {g.key: [Response([g.key, j], f"{g.key}/{j}") for j in range(G)] for g in groups}
    batch = StepBatch(groups=groups, local={}, stats={"x": 1.0})
    split = TrainSplit(mini_batch_size=8, dp=2, dp_rank_of=(0, 0, 1, 1))  # TP = 2, DP = 2
    state = {"scheduler": {}, "finished": {}, "partial": {}}
    replies = list(batch_replies(batch, responses, state, split))
    shares = [sorted(r["responses"]) for r in replies]
    first = [
        (5, 0),
        (5, 1),
        (5, 2),
        (5, 3),
        (9, 0),
        (9, 1),
        (9, 2),
        (9, 3),
    ]  # each mini-batch of 8: DP rank 0 the first 4
    second = [(6, 0), (6, 1), (6, 2), (6, 3), (11, 0), (11, 1), (11, 2), (11, 3)]
    assert shares == [first, first, second, second]
    assert all(r["responses"][sid].text == f"{sid[0]}/{sid[1]}" for r in replies for sid in r["responses"])
    assert all(r["groups"] == groups and r["stats"] == {"x": 1.0} for r in replies)
    assert [r["state"] for r in replies] == [state, None, None, None]
