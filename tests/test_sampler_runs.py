"""End-to-end runs whose sampler carries state from step to step (dynamic sampling, partial rollout's paused groups,
informative groups carried to the next batch, the prompt memory, truncated IS, KL to the reference as a loss term):
an uninterrupted 5-step run, the same run split into its asynchronous sides and killed -9 in the middle of a weight
update then resumed colocated, the asynchronous pipeline ahead of training through a side's kill -9, its launcher's
kill -9 (nothing of the run outlives it) and SIGTERM, and two engines in two processes with partial rollout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_helpers import (
    comparable,
    metrics,
    newest_complete,
    python_path,
    run_train,
    stalled_and_gone,
    tagged,
    wait_until,
)

from megatron_dapo.convert.resolve import read_rank_state
from megatron_dapo.data.generator import generate_rows, write_jsonl
from megatron_dapo.launch.lifeline import RUN_TAG_ENV
from megatron_dapo.launch.watchdog import HOST
from megatron_dapo.launch.writer_lock import LOCK_NAME


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


def _informative_at_random(root: Path, tiny_model) -> list[str]:
    """Overrides for a run on a tiny model (tiny_model: the tiny_qwen2 fixture or another of its kind; ends early,
    see _ends_early) whose groups are informative at random: a verifier right for a quarter of all texts, groups of
    4, batches of 4, decisions every 2 engine steps."""
    model = _ends_early(tiny_model(copy_to=root / "model"))
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
def test_a_rollout_side_stopped_mid_update_then_resume_split_reproduces_the_uninterrupted_run(
    uninterrupted, tmp_path, tiny_qwen2
):
    """python -m's resume end to end, every kind of sampler state in the checkpoints (the state round trips of each
    part in one process are tests/test_dynamic_sampling.py's and tests/test_prompt_memory.py's), asynchronous DAPO at
    eta = 0 taking the colocated run's steps, and a rollout process that stops in the middle of a weight update:

    1. asynchronous (pipeline.mode=async: a rollout process and a train process), eta = 0, small deadlines from the
       config (stall 15 s, collectives 300 s): its rollout process stops itself (DAPO_FAULT, SIGSTOP) in the middle of
       taking update 3, once its engine has taken the update's second bucket. The train side's watchdog finds it no
       longer running and ends the run: status 75 within the deadline plus 30 s, one line naming its phase, rank and
       host, its stack (woken for it) in the log, nothing of the run left (its tag); the newest complete checkpoint
       step 2's or 3's (update 3 follows step 3's training; its buckets may fit in the socket's buffer);
    2. colocated: resumes from the asynchronous run's newest checkpoint and finishes. The metrics of both, step for
       step (the rollout side's held-out evaluation after step 2 included), and the prompt memory saved at the end
       are the uninterrupted colocated run's. (An asynchronous run resuming an asynchronous checkpoint step for step
       is the Slurm stall test's, tests/test_slurm_cluster.py; a rank stopped inside a checkpoint save and SIGTERM to
       an asynchronous run are the next test's, at eta = 1.)
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
    small = ["trainer.stall_timeout_s=15", "trainer.collective_timeout_s=300"]
    split = [*launch_local(cmd), f"trainer.run_dir={cut}", "pipeline.mode=async", *small]
    tag = f"rollout-stop-{os.getpid()}"
    stop = {**env, "DAPO_FAULT": "stop:receive:3:1@rollout0", RUN_TAG_ENV: tag}
    proc = subprocess.Popen(split, env=stop, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err, took = stalled_and_gone(proc, tag, timeout=600)
    assert proc.returncode == 75 and took < 15 + 30, err[-4000:]
    [line] = [x for x in err.splitlines() if x.startswith(f"error: stall: rollout 0 (host {HOST}, pid ")]
    assert " in phase weight update of step 3" in line and "its process is not running (stopped" in line, line
    assert " in fault\n" in err and " in tensors\n" in err  # the rollout process's stack, where it stopped
    saved = newest_complete(cut)
    assert saved in (2, 3) and not (ckpt / "step_00000004").exists() and len(metrics(cut)) >= 2
    assert metrics(cut)[1]["weight_transport/buckets"] >= 3  # so bucket 1 was the middle of an update

    # a resume whose model.hf_path (the KL reference) is not the weights the run started from: refused
    other = [*cmd, f"trainer.run_dir={cut}", f"model.hf_path={tiny_qwen2()}"]  # the model before _ends_early
    refused = subprocess.run(other, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and refused.stderr.splitlines()[-1].startswith(
        f"error: {ckpt}: the run trained with KL to reference weights "
    ), refused.stderr[-3000:]
    assert newest_complete(cut) == saved and not (ckpt / "step_00000004").exists()

    resumed = subprocess.run([*cmd, f"trainer.run_dir={cut}"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from step {saved}" in resumed.stderr
    got = [comparable(m) for m in metrics(cut)]
    assert [m["step"] for m in got] == [1.0, 2.0, 3.0, 4.0, 5.0]  # each step once: lines past a checkpoint dropped
    assert got == want
    # the loss term, token-mean: kl_coef x the mean k over the loss's tokens; k3 >= 0, and > 0 once an update moved
    assert all(m["actor/kl"] > 0 and m["actor/kl_loss"] == pytest.approx(0.1 * m["actor/kl"], rel=1e-6) for m in lines)
    assert [("weight_transport/gb" in m) for m in metrics(cut)] == [k < saved for k in range(5)]  # which mode
    assert (cut / "FINISHED").read_text().strip() == "5"

    def memory(run: Path) -> dict:  # the record after step 5, as saved by both runs
        state = read_rank_state(run / "checkpoints" / "step_00000005" / "state" / "rank00000.pt")
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
def test_async_ahead_of_training_survives_a_stalled_save_a_killed_launcher_and_sigterm_each_visit_once(
    uninterrupted, tmp_path
):
    """Asynchronous DAPO at eta = 1 (the controller collects batch k + 1 while batch k trains, applying each update
    in flight) with two train ranks (launch local --nproc-per-node 3: torchrun for the train side):

    1. small deadlines from the config (stall 15 s, collectives 300 s); train rank 1 stops itself (DAPO_FAULT,
       SIGSTOP) inside step 2's checkpoint save, its shards written: rank 0 waits at the save's barrier, the rollout
       side at eta. A watchdog finds it no longer running and ends the run: status 75 within the deadline plus 30 s,
       one line naming the phase, the rank and the host, its stack (woken for it) in the log, no process of the
       run left (torchrun's ranks run in sessions of their own; found by the run's tag), step 1's checkpoint the
       newest complete one;
    2. resumed, and the launcher's process group killed -9 (a terminal's hang-up, an OOM kill of the launcher)
       once the next step is saved and a reward worker and both ranks run: torchrun's agent dies with the launcher
       (parent-death signal), the ranks and the rollout process see the launcher gone, and with their workers all
       stop within 10 s (found by the run's tag, as orphans are adopted by init);
    3. resumed again, taking the dead writer's lock over where it was left, and SIGTERM to the launcher once it has
       saved a step: the train side saves, stops the controller, exits 0 and releases the lock.

    When an update lands depends on timing, so no run equals another step for step; what must hold is checked from
    the run's own record: each step trained once, each batch by the weights of its index (an update is applied
    before the batch that needs it is handed out), tokens were trained a version after they were sampled (the
    overlap happened), each step's generated tokens are counted once, and the prompt memory in the last checkpoint
    counts exactly the groups the surviving steps generated: every visit trained or rejected once, none from the
    killed runs' lost steps and none of the batch collected after the last one leaked into the saved state.
    """
    cmd, env, _, _ = uninterrupted
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    ahead = [f"trainer.run_dir={run}", "pipeline.mode=async", "sampler.max_staleness=1", "--nproc-per-node", "3"]
    ahead.append("trainer.total_steps=9")  # never reached: the last launch is stopped by SIGTERM
    tag = f"save-stop-{os.getpid()}"
    stop = {**env, "DAPO_FAULT": "stop:save:2:0@train1", RUN_TAG_ENV: tag}
    small = ["trainer.stall_timeout_s=15", "trainer.collective_timeout_s=300"]
    proc = subprocess.Popen(
        [*launch_local(cmd), *ahead, *small], env=stop, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _, err, took = stalled_and_gone(proc, tag, timeout=600)
    assert proc.returncode == 75 and took < 15 + 30, err[-4000:]
    [line] = [x for x in err.splitlines() if x.startswith(f"error: stall: train 1 (host {HOST}, pid ")]
    assert " in phase save of step 2" in line and "its process is not running (stopped" in line, line
    assert " in fault\n" in err and " in _write\n" in err  # train rank 1's stack, where it stopped
    saved = newest_complete(run)
    assert saved == 1 and not (ckpt / "step_00000002").exists()  # step_00000002.tmp, never taken, may stay

    killed = _kill_launcher(launch_local(cmd) + ahead, env, run, tmp_path / "killed.log", after=saved + 1)
    assert killed > saved
    left = (run / LOCK_NAME).is_file()  # rank 0 went with its own watch (the lock stays) or out through `finally`

    proc = subprocess.Popen(
        [*launch_local(cmd), *ahead], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_until((ckpt / f"step_{killed + 1:08d}" / "COMPLETE").is_file, what=f"step {killed + 1}", proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert f"resumed from step {killed}" in err and "SIGTERM: saved" in out
    took_over = "took over the writer lock of pid " in err
    assert took_over == left and (not left or "(it is not running on this host)" in err), err[-3000:]
    assert not (run / LOCK_NAME).exists()  # released at the clean exit
    lines = metrics(run)
    stopped_at = len(lines)
    assert killed < stopped_at < 9 and (ckpt / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    assert [m["step"] for m in lines] == [float(k) for k in range(1, stopped_at + 1)]  # each step once
    assert [m["pipeline/weights_version"] for m in lines] == [float(k) for k in range(stopped_at)]
    # evaluated after every second step by the rollout side, at the batch boundary after those weights landed
    assert [("eval/avg_at_k" in m) for m in lines] == [k % 2 == 0 for k in range(1, stopped_at + 1)]
    assert all(m["eval/k"] == 3 and m["eval/problems"] == 5 for m in lines if "eval/k" in m)
    assert all(m["pipeline/updates"] >= 1 and m["pipeline/update_pause_s"] > 0 for m in lines)
    assert max(m["staleness/max"] for m in lines) >= 1  # sampled by the weights before the ones training it
    # a step's tokens are counted by the step that generated them, whatever weights did: each lands in one bin
    parts = ("trained", "wasted", "carried", "paused", "uninformative")
    assert all(m["tokens/generated"] == sum(m[f"tokens/{p}"] for p in parts) > 0 for m in lines)
    last = read_rank_state(ckpt / f"step_{stopped_at:08d}" / "state" / "rank00000.pt")
    visits = last["trainer"]["loader"]["scheduler"]["memory"]["visits"]
    assert int(visits.sum()) == int(sum(m["sampler/groups_generated"] for m in lines)) > 0


@pytest.mark.slow
def test_two_engines_in_two_processes_agree_with_partial_rollout(tmp_path, tiny_qwen3_moe):
    """`launch local --nproc-per-node 2` (torchrun), DP=2, a Qwen3-MoE policy whose experts are split over the two
    ranks (EP 2) with Rollout Routing Replay: each rank's engine streams its groups, pauses them at the sync and
    continues them; the schedulers' fingerprints are compared after every step (a disagreement raises), and
    responses a rank did not generate reach it as tensors, their routes with them; the trainer replays the engines'
    routes, which are its own at fp32 until an update moves them."""
    overrides = [
        *_informative_at_random(tmp_path, tiny_qwen3_moe),
        "parallel.ep=2",
        "model.router_replay=r3",
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
    # `launch local`'s torchrun for a colocated run; PYTHONPATH: the verifier, for every worker
    run_train([*overrides, "--nproc-per-node", "2"], launcher="local", PYTHONPATH=python_path(Path(__file__).parent))
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1.0, 2.0]
    assert sum(m["sampler/paused"] for m in lines) > 0 and sum(m["sampler/resumed"] for m in lines) > 0
    assert sum(m["sampler/bytes_moved"] for m in lines) > 0
    busy = [m["timing/engine_busy_frac"] for m in lines]
    assert all(0 <= b <= 1 for b in busy) and max(busy) > 0  # a step served from the carry generates nothing
    for m in lines:  # the phases are timed apart and within the step
        phases = [m[f"timing/{p}"] for p in ("generate", "old_logp", "train", "sync")]
        assert all(t > 0 for t in phases) and sum(phases) <= m["timing/step"]
        assert 0.95 < m["moe/router_agreement"] <= 1.0 and m["moe/load_imbalance"] >= 1.0, m
    # step 1 samples with the weights it trains from: the engines' routes are the trainer's own, the rollout KL
    # float32 noise (step 2 holds continued samples, partly sampled by the weights before the sync); each update
    # then moves the routers a little under the replayed routes (the metric is the updates' mean)
    assert lines[0]["rollout/kl"] < 1e-6 and "moe/load_imbalance/layer2" in lines[0]


def launch_local(cmd: list[str]) -> list[str]:
    """The trainer's command `cmd` (python -m megatron_dapo.train ARGS) as python -m megatron_dapo.launch local ARGS:
    the one way to start both sides of an asynchronous job on one machine."""
    return [sys.executable, "-m", "megatron_dapo.launch", "local", *cmd[3:]]


def _kill_launcher(cmd: list[str], env: dict[str, str], run: Path, log: Path, after: int) -> int:
    """Start cmd (`launch local`, two torchrun ranks) in a session of its own, kill -9 its process group once step
    `after` is saved and a reward worker and both ranks run, check that every process of the run is gone within
    10 s; returns the newest complete checkpoint's step."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until((run / "checkpoints" / f"step_{after:08d}" / "COMPLETE").is_file, what=f"step {after}", proc=proc)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        environ = Path(f"/proc/{children[0]}/environ").read_text().split("\0")
        tag = next(e.split("=", 1)[1] for e in environ if e.startswith(f"{RUN_TAG_ENV}="))  # the launcher's
        wait_until(lambda: any("multiprocessing" in c for c in tagged(tag).values()), what="a reward worker")
        under = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        before = tagged(tag)
        assert under <= set(before) and len(before) >= 3, before  # every descendant tagged: sides, ranks, workers
        assert sum("megatron_dapo.launch.torchrun" in c for c in before.values()) == 1, before  # torchrun's agent
        assert sum("LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_text() for pid in before) >= 2, before
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    try:
        wait_until(lambda: not tagged(tag), timeout=10, what="no process of the run left")
    finally:
        for pid in tagged(tag):  # never leave them running for the rest of the suite
            os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - killed_at < 10
    return newest_complete(run)
