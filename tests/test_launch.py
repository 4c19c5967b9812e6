"""`python -m megatron_dapo.launch {local,slurm,ray}`: what each launcher computes, checked without running a job.

Then the runs themselves, `launch ray` on a real two-raylet Ray cluster against the one-process run: DP = 2 through a
worker killed -9, the asynchronous sides through a driver killed -9 and SIGTERM (slow). `launch local` runs in
tests/test_sampler_runs.py and tests/test_trainer.py, `launch slurm` on a real two-node Slurm cluster in
tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_helpers import RESOURCE, start_cluster, stop_cluster
from run_helpers import (
    comparable,
    metrics,
    newest_complete,
    python_path,
    same_up_to_fp32_sums,
    session_survivors,
    wait_until,
)

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.launch.ray_cluster import Slot, forwarded_env, node_devices, slots_for, world_env
from megatron_dapo.launch.slurm import sbatch_command, shell_line
from megatron_dapo.launch.writer_lock import LOCK_NAME

REPO = Path(__file__).resolve().parent.parent


def _placed(nodes: int, per_node: int, rollout: int, gpus: list[list[str]]) -> list[Slot]:
    """slots_for's slots put on Ray nodes n0, n1, ... (bundle b on node b) with the GPU ids Ray gave each."""
    slots = slots_for(nodes, per_node, rollout)
    for s, g in zip(slots, gpus):
        s.node_id, s.ip, s.gpus = f"n{s.bundle}", f"10.0.0.{s.bundle + 1}", g
    return slots


def test_each_worker_gets_its_world_and_the_gpu_ray_gave_it_at_cuda_local_rank():
    # 2 nodes x 2 GPUs; Ray gave node 0's workers GPUs 3 and 1 (in that order), node 1's 0 and 2
    slots = _placed(2, 2, 0, [["3"], ["1"], ["0"], ["2"]])
    world_env(slots, {"all": 29000})
    env = [s.env for s in slots]
    assert [e["RANK"] for e in env] == ["0", "1", "2", "3"] and {e["WORLD_SIZE"] for e in env} == {"4"}
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "0", "1"] and {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env} == {("10.0.0.1", "29000")}  # rank 0's node
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["3,1", "3,1", "0,2", "0,2"]
    for s in slots:  # the one property that matters: cuda:LOCAL_RANK is the worker's own GPU
        assert s.env["CUDA_VISIBLE_DEVICES"].split(",")[int(s.env["LOCAL_RANK"])] == s.gpus[0]
    assert [s.label for s in slots] == ["rank 0", "rank 1", "rank 2", "rank 3"]


def test_asynchronous_sides_are_worlds_of_their_own():
    # 2 nodes x 2: rollout_gpus=3 puts the rollout side on node 0 and the first GPU of node 1
    slots = _placed(2, 2, 3, [["0"], ["1"], ["0"], ["1"]])
    world_env(slots, {"rollout": 30000, "train": 31000})
    side = {s.label: s.env for s in slots}
    assert list(side) == ["rollout 0", "rollout 1", "rollout 2", "train 0"]
    assert [side[f"rollout {i}"]["RANK"] for i in range(3)] == ["0", "1", "2"]
    assert {side[f"rollout {i}"]["WORLD_SIZE"] for i in range(3)} == {"3"}
    assert side["rollout 2"]["LOCAL_RANK"] == "0" and side["rollout 2"]["LOCAL_WORLD_SIZE"] == "1"
    assert side["rollout 2"]["CUDA_VISIBLE_DEVICES"] == "0"  # node 1's rollout worker sees its own GPU only
    assert (side["train 0"]["RANK"], side["train 0"]["WORLD_SIZE"], side["train 0"]["LOCAL_RANK"]) == ("0", "1", "0")
    assert (side["train 0"]["MASTER_ADDR"], side["train 0"]["MASTER_PORT"]) == ("10.0.0.2", "31000")
    assert side["train 0"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert {side[f"rollout {i}"]["MASTER_ADDR"] for i in range(3)} == {"10.0.0.1"}


def test_a_custom_resource_leaves_the_node_s_devices_alone():
    slots = _placed(1, 2, 0, [[], []])
    world_env(slots, {"all": 29000})
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in slots) and node_devices(slots) is None


def test_the_driver_passes_on_settings_never_a_world():
    env = {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "INFO",
        "WANDB_API_KEY": "k",
        "PYTHONPATH": "/x",
        "HF_HOME": "/h",
        "RANK": "3",
        "MASTER_PORT": "1",
        "CUDA_VISIBLE_DEVICES": "0",
        "DAPO_ROLE": "train",
        "HOME": "/root",
        "PATH": "/bin",
    }
    assert forwarded_env(env) == {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "INFO",
        "WANDB_API_KEY": "k",
        "PYTHONPATH": "/x",
        "HF_HOME": "/h",
    }


def _docs_slurm_example() -> tuple[list[str], str]:
    """The `launch slurm ... --print-only` example of docs/slurm.md: (its arguments, the line it shows)."""
    text = (REPO / "docs" / "slurm.md").read_text()
    block = re.search(r"\n    \$ (python -m megatron_dapo\.launch slurm .*?)\n    (CONFIG=.*?)\n", text, re.S)
    assert block, "docs/slurm.md: the launch slurm --print-only example is missing"
    command = " ".join(part.strip().rstrip("\\") for part in block.group(1).splitlines())
    return shlex.split(command)[3:], block.group(2)


def test_launch_slurm_print_only_prints_the_command_the_docs_show():
    args, shown = _docs_slurm_example()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.launch", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == shown


def test_the_slurm_mapping():
    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml",
        ["model.hf_path=m", "data.train_files=[d.jsonl]", "trainer.run_dir=r", "pipeline.mode=async",
         "pipeline.rollout_gpus=2", "optim.lr=1e-3"],
    )  # fmt: skip
    overrides = ["model.hf_path=m", "pipeline.mode=async", "pipeline.rollout_gpus=2", "optim.lr=1e-3"]
    variables, cmd = sbatch_command("examples/tiny_cpu.yaml", overrides, cfg, 3, 2, ["-p", "gpu"], REPO)
    assert variables == {
        "CONFIG": "examples/tiny_cpu.yaml",
        "MODEL_PATH": "m",
        "DATA_PATH": "d.jsonl",
        "VAL_PATH": "none",
        "RUN_DIR": "r",
        "GPUS_PER_NODE": "2",
        "ROLLOUT_NODES": "1",
    }
    assert cmd == ["sbatch", "--nodes=3", "--gpus-per-node=2", "-p", "gpu", "slurm/train_qwen32b.sh", "optim.lr=1e-3"]
    # from elsewhere: absolute paths and REPO_DIR, so the script finds itself and the files
    variables, cmd = sbatch_command("examples/tiny_cpu.yaml", [], cfg, 3, 2, [], REPO / "docs")
    assert variables["REPO_DIR"] == str(REPO) and variables["CONFIG"] == str(REPO / "docs" / "examples/tiny_cpu.yaml")
    assert variables["RUN_DIR"] == str(REPO / "docs" / "r") and cmd[3] == str(REPO / "slurm" / "train_qwen32b.sh")
    assert shell_line({"A": "x y"}, ["sbatch", "k=[1]"]) == "A='x y' sbatch 'k=[1]'"
    with pytest.raises(ConfigError, match=r"pipeline.rollout_gpus=2: on Slurm the rollout side takes whole nodes"):
        sbatch_command("examples/tiny_cpu.yaml", [], cfg, 3, 4, [], REPO)
    two = load_config(None, ["data.train_files=[a,b]", "model.hf_path=m"])
    with pytest.raises(ConfigError, match=r"data.train_files=\['a', 'b'\]: the Slurm script takes exactly one file"):
        sbatch_command("examples/tiny_cpu.yaml", [], two, 1, 8, [], REPO)


def test_launch_local_splits_its_processes_between_the_two_sides(tmp_path, run_main):
    """`launch local` is the one way to start an asynchronous job here: --nproc-per-node counts both sides, so one
    that leaves the train side nothing is one error line, before anything starts."""
    from megatron_dapo.launch.__main__ import main

    split = [f"trainer.run_dir={tmp_path}", "pipeline.mode=async", "sampler.max_staleness=0"]
    code, lines = run_main(main, ["local", "--nproc-per-node", "1", *split])
    assert code == 1 and lines == [
        "error: --nproc-per-node 1: expected more than pipeline.rollout_gpus=1 (the rest train)"
    ], lines


def test_a_launcher_is_named_first():
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.launch", "--config", "x.yaml"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: expected a launcher first, one of local, slurm, ray (python -m megatron_dapo.launch --help)"
    )


def test_a_ray_restart_resumes_even_where_the_config_does_not():
    """examples/tiny_cpu.yaml says trainer.resume: false. `launch ray`'s first attempt runs it as asked; a restart after
    a dead worker must continue from the newest checkpoint (as the Slurm requeue's dry run checks), not train from
    step 0 again: the trainers' argv of each attempt (run_ray passes attempt_args to the job), read by the config.
    The restart on a real cluster is the slow test below, whose own overrides resume anyway."""
    import argparse

    from megatron_dapo.launch.ray_cluster import attempt_args

    config = str(REPO / "examples" / "tiny_cpu.yaml")
    args = ["--config", config, "trainer.total_steps=3"]
    trainer_argv = argparse.ArgumentParser()  # python -m megatron_dapo.train's arguments
    trainer_argv.add_argument("--config")
    trainer_argv.add_argument("overrides", nargs="*")
    got = [trainer_argv.parse_intermixed_args(attempt_args(args, attempt)) for attempt in range(3)]
    assert [load_config(a.config, a.overrides).trainer.resume for a in got] == [False, True, True]
    assert all(a.config == config and "trainer.total_steps=3" in a.overrides for a in got)
    assert "resume: false" in (REPO / "examples" / "tiny_cpu.yaml").read_text()


@pytest.fixture(scope="module")
def ray_cluster():
    """A real Ray cluster of two nodes on this machine (tests/ray_helpers.py): each with one `test_gpu`; the second
    also declares two GPUs it does not have. Stopped after this module's tests, with nothing left to kill."""
    cluster = start_cluster({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(Path(__file__).parent)})
    yield cluster
    assert stop_cluster(cluster) == [], "Ray processes outlived their `ray start` and had to be killed"


def _launch_ray(cluster, out: Path, *args: str, **env: str) -> subprocess.Popen:
    """`python -m megatron_dapo.launch ray` on the cluster (env added to the driver's environment, which it passes on
    to the workers), its output to the file out (a pipe nobody reads while it runs would fill and stop it), in a
    session of its own."""
    cmd = [sys.executable, "-m", "megatron_dapo.launch", "ray", "--address", cluster.address, *args]
    return subprocess.Popen(cmd, env={**cluster.env, **env}, stdout=out.open("w"), stderr=subprocess.STDOUT,
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


def _stopped(pid) -> bool:
    """pid is a stopped process (SIGSTOP: /proc/<pid>/stat's state T); False for None."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "T"


def _worker_nodes(text: str) -> list[tuple[str, str]]:
    """(label, Ray node id) of each worker's first line, in the order printed."""
    return re.findall(r"^\[([a-z]+ \d+)\] worker [a-z]+ \d+: Ray node ([0-9a-f]+) ", text, re.M)


@pytest.mark.slow
def test_ray_dp2_across_two_nodes_restarts_a_stalled_run_and_matches_the_one_process_run(
    ray_cluster, two_steps, tmp_path
):
    """`launch ray --nodes 2 --gpus-per-node 1`: one worker on each Ray node (one placement group, a bundle per node),
    DP = 2 with two vLLM engines, fed groups on demand by the scheduler. Small deadlines from the config (stall 15 s,
    collectives 300 s). Rank 1's trainer stops itself (DAPO_FAULT, SIGSTOP) inside step 2's train step (its second
    micro-batch), after step 1 is saved: rank 0's watchdog names it (phase, rank, host) and the run ends within the
    deadline plus 30 s, rank 1's stack written (woken for it) and collected; the launcher says why, stops every
    worker and starts both again from step 1 (a resume is bit for bit: tests/test_checkpoint.py; the fault fires once
    per run), and the finished run is two_steps' one-process run step for step, held-out evaluation included.

    Groups are seeded by their submission number and stream mode trains the first informative groups in submission
    order, so the trained samples do not depend on the number of engines; without dynamic sampling nothing is
    requeued either, so rewards and every count are those of the 1-process run exactly, and each response crosses to
    the rank that trains it. The losses, ratios, grad norm and logprob mismatch agree within fp32 rounding, not bit
    for bit: each rank sums its half of a mini-batch (in its own micro-batch shapes) before the DP all-reduce adds the
    halves, so the sums are associated differently, and step 2 then starts from weights that differ in the last
    bits. (`launch local`'s torchrun at DP = 2 is tests/test_sampler_runs.py's two-engine run.)
    """
    from megatron_dapo.launch.watchdog import HOST

    overrides, ref_run, _ = two_steps
    run, out = tmp_path / "run", tmp_path / "launch.out"
    args = ["--nodes", "2", "--gpus-per-node", "1", "--gpu-resource", RESOURCE, "--max-restarts", "1"]
    small = ["trainer.stall_timeout_s=15", "trainer.collective_timeout_s=300"]
    stop = {"DAPO_FAULT": "stop:micro_batch:2:1@rank1"}
    proc = _launch_ray(ray_cluster, out, *args, *overrides, *small, f"trainer.run_dir={run}", **stop)
    wait_until(lambda: _stopped(_trainers(run).get("1")), what="rank 1 stopped", proc=proc)
    stopped_at = time.monotonic()
    wait_until(lambda: "[launch] restart 1 of 1: " in out.read_text(), what="the restart", proc=proc)
    assert time.monotonic() - stopped_at < 15 + 30
    text = _ray_finished(proc, out, run)
    assert proc.returncode == 0, text[-4000:]
    nodes = _worker_nodes(text)
    assert [label for label, _ in nodes] == ["rank 0", "rank 1"] * 2  # two attempts
    assert len({node for _, node in nodes[:2]}) == 2, nodes  # one worker on each node
    why = (
        rf"^\[launch\] restart 1 of 1: rank [01] on Ray node [0-9a-f]{{12}} \([0-9.]+\) stalled \(the stall's line "
        rf"and stacks follow\); every worker was stopped, starting again from the newest checkpoint in "
        rf"{re.escape(str(run))}/checkpoints$"
    )
    assert re.search(why, text, re.M), text[-4000:]
    stall = rf"^\[launch\] error: stall: rank 1 \(host {HOST}, pid \d+\) made no progress for \d+ s in phase train of step 2"
    assert re.search(stall, text, re.M), text[-4000:]
    collected = (run / "logs").glob("*/attempt_0/stacks.txt")
    assert any(" in fault\n" in c.read_text() and " in forward_step\n" in c.read_text() for c in collected)
    assert "resumed from step 1" in text and text.count("[rank 0] step 2 | reward") == 1
    assert "[rank 1] step " not in text  # rank 0 alone reports
    assert all(m["sampler/bytes_moved"] == 0 for m in metrics(ref_run))
    # the summaries reach both ranks; here each DP rank's share happens to come from its own engine (tested apart)
    assert all(m["sampler/bytes_gathered"] > 0 for m in metrics(run))
    want, got = [comparable(m) for m in metrics(ref_run)], [comparable(m) for m in metrics(run)]
    assert [m["step"] for m in got] == [1.0, 2.0] and got[1]["eval/problems"] == 5
    same_up_to_fp32_sums(want, got)
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000002" / "state").iterdir()) == [
        "rank00000.pt",
        "rank00001.pt",
    ]


@pytest.mark.slow
def test_ray_async_sides_on_two_nodes_die_with_a_killed_driver_and_save_on_sigterm(ray_cluster, two_steps, tmp_path):
    """pipeline.mode=async on the Ray cluster: one rollout worker and one train worker, each on a node of its own,
    meeting at the rollout node's ports. The driver is killed -9 once step 1 is saved: Ray ends the job's actors and
    each trainer dies with its actor, so within 30 s no trainer of the run is left (found by its command line, as
    orphans are adopted by init). The next launch takes the dead trainer's writer lock over (where it was left) and
    resumes; SIGTERM to it once it saved a step: the train side saves the step in flight and stops the controller,
    every worker exits 0, so does the launcher. At eta = 0 its first two steps are two_steps' one-process steps."""
    overrides, ref_run, _ = two_steps
    run, out = tmp_path / "run", tmp_path / "launch.out"
    split = ["pipeline.mode=async", "sampler.max_staleness=0", "trainer.total_steps=6", f"trainer.run_dir={run}"]
    args = ["--nodes", "2", "--gpus-per-node", "1", "--gpu-resource", RESOURCE, *overrides, *split]
    proc = _launch_ray(ray_cluster, out, *args)
    wait_until((run / "checkpoints" / "step_00000001" / "COMPLETE").is_file, what="step 1's checkpoint", proc=proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: not _trainers(run), timeout=30, what="no trainer of the killed driver's job left")
    nodes = dict(_worker_nodes(out.read_text()))
    assert list(nodes) == ["rollout 0", "train 0"] and nodes["rollout 0"] != nodes["train 0"], nodes
    saved = newest_complete(run)
    left = (run / LOCK_NAME).is_file()  # killed with its actor (the lock stays), or out through its `finally` first

    out2 = tmp_path / "launch2.out"
    proc = _launch_ray(ray_cluster, out2, *args)
    wait_until((run / "checkpoints" / f"step_{saved + 1:08d}" / "COMPLETE").is_file, what="a step saved", proc=proc)
    proc.send_signal(signal.SIGTERM)
    text = _ray_finished(proc, out2, run)
    assert proc.returncode == 0 and f"resumed from step {saved}" in text, text[-4000:]
    assert ("took over the writer lock of pid " in text) == left  # a lock the killed job's trainer left is taken over
    assert "[launch] SIGTERM: asking the trainers to save and exit" in text
    saved_at = rf"^\[train 0\] SIGTERM: saved {re.escape(str(run))}/checkpoints/step_(\d+) at step (\d+); exiting$"
    stopped = re.search(saved_at, text, re.M)
    assert stopped and int(stopped.group(1)) == int(stopped.group(2)) > saved, text[-4000:]
    assert "[launch] SIGTERM: every trainer saved and exited; launch again to resume" in text
    lines = metrics(run)
    assert [m["step"] for m in lines] == [float(k) for k in range(1, int(stopped.group(2)) + 1)]  # each step once
    assert not (run / "FINISHED").exists() and not (run / LOCK_NAME).exists()
    assert all(m["weight_transport/gb"] > 0 for m in lines)
    same_up_to_fp32_sums([comparable(m) for m in metrics(ref_run)], [comparable(m) for m in lines[:2]])


def _refused(env: dict[str, str], address: str, *args: str, message: str) -> None:
    """`launch ray` at address exits 1 within 30 s with the one line message (and whatever follows it on that line)."""
    import time

    start = time.time()
    cmd = [sys.executable, "-m", "megatron_dapo.launch", "ray", "--address", address, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert time.time() - start < 30 and done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_ray_without_a_cluster_at_the_address_is_one_error_line():
    with socket.socket() as s:  # a port nobody listens on once this is closed
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    _refused({**os.environ}, closed, "--nodes", "1", message=f"error: --address {closed}: no Ray cluster answers there")


@pytest.mark.slow  # the two-raylet cluster's start (~17 s) is most of it
def test_ray_binds_each_worker_to_its_gpu_and_refuses_more_nodes_than_the_cluster_has(ray_cluster, tmp_path):
    """--print-only on the node that declares two GPUs: Ray gives each worker one; each trainer would see both in
    local-rank order, so its cuda:LOCAL_RANK is the one Ray gave it. More nodes than the cluster has: one error line
    within 30 s, nothing started."""
    out = tmp_path / "print.out"
    proc = _launch_ray(ray_cluster, out, "--nodes", "1", "--gpus-per-node", "2", "--print-only")
    text = _ray_finished(proc, out, tmp_path / "none", timeout=120)
    assert proc.returncode == 0, text[-3000:]
    workers = re.findall(r"LOCAL_RANK (\d) of 2, .*Ray GPU ids \['(\d)'\], CUDA_VISIBLE_DEVICES ([\d,]+)", text)
    assert len(workers) == 2 and {gpu for _, gpu, _ in workers} == {"0", "1"}, text[-3000:]
    for local, gpu, visible in workers:
        assert visible.split(",")[int(local)] == gpu and len(visible.split(",")) == 2
    assert "[launch] every worker runs: python -m megatron_dapo.train" in text
    args = ["--nodes", "3", "--gpus-per-node", "1", "--gpu-resource", RESOURCE]
    message = f"error: --nodes 3 --gpus-per-node 1: the Ray cluster has 2 node(s) with 1 {RESOURCE} (per node: "
    _refused(ray_cluster.env, ray_cluster.address, *args, message=message)
