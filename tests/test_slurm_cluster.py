"""The sbatch scripts under a real Slurm: a private two-node cluster on this machine (tests/slurm/cluster.sh), jobs
submitted with `sbatch` as a user types them (only the node count, and for the tiny CPU run the processes per node,
differ from the 32B recipe; the first by `python -m megatron_dapo.launch slurm`), signals sent with `scancel`, states
read with `scontrol`.

Skipped when Slurm is absent or we are not root; `make test-slurm` installs the Debian packages and runs this file.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import comparable, metrics, python_path, wait_until

from megatron_dapo.data.generator import generate_rows, write_jsonl
from megatron_dapo.launch.procs import free_port_pair

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
pytestmark = [
    pytest.mark.skipif(
        not all(Path(d).exists() for d in DAEMONS) or shutil.which("sbatch") is None or os.geteuid() != 0,
        reason="Slurm is absent (munged, slurmctld, slurmd, sbatch) or not root: `make test-slurm` installs and runs it",
    ),
    pytest.mark.slow,
]
STEPS = 3  # the stall test stalls in step 2, resumes from step 1 and runs to here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running private cluster; yields the environment that talks to it. Afterwards no job or daemon is left."""
    root = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(
        ["bash", str(TESTS / "slurm" / "cluster.sh"), "start", str(root)], capture_output=True, text=True, timeout=120
    )
    assert start.returncode == 0, start.stdout + start.stderr
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf"), "OMP_NUM_THREADS": "1"}
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        pids = [int(f.read_text()) for f in root.glob("*.pid")]  # munged, slurmctld and two slurmd
        subprocess.run(["bash", str(TESTS / "slurm" / "cluster.sh"), "stop", str(root)], timeout=120, check=True)
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        assert not left, f"daemons still running: {left}"


def _rendezvous_port() -> int:
    """A free port (and the next) below the kernel's ephemeral range for torchrun's rendezvous, which binds it later in the job.

    A port the kernel hands out for bind(0) could be given to another process between this check and the bind (the
    parallel tests start torchrun --standalone and servers on port 0 all the time); one below the ephemeral range
    never is, so free now means free then.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(min(20000, low - 1000), low, 2):
        try:
            for p in (port, port + 1):  # an asynchronous job's train side meets at the next one
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        return port
    raise AssertionError(f"no two free ports below the ephemeral range (which starts at {low})")


HOST = socket.gethostname().split(".")[0]  # the cluster's first node; the second, HOST-2, has no address of its own


def submit(env: dict, cwd: Path, script: str, *args: str, nodes: int = 1, **variables: str) -> str:
    """sbatch --parsable SCRIPT ARGS from cwd, with variables added to the job's environment; returns the job id.

    One node: HOST, whose name resolves (a training job's rendezvous address is its first node's name).
    """
    where = ["--nodes=1", f"--nodelist={HOST}"] if nodes == 1 else [f"--nodes={nodes}"]
    proc = subprocess.run(
        ["sbatch", "--parsable", *where, f"--output={cwd}/%x-%j.out", str(REPO / "slurm" / script), *args],
        cwd=cwd,
        env={**env, "REPO_DIR": str(REPO), **variables},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(env: dict, job_id: str) -> dict[str, str]:
    """scontrol show job, as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for(env: dict, job_id: str, states: set[str], timeout: float = 600) -> dict[str, str]:
    """Poll until the job is in one of states (a requeued job waits out its old credential first: 10 s here)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(env, job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {info}")


def batch_log(run: Path, job_id: str, attempt: int = 0) -> str:
    return (run / "logs" / job_id / f"attempt_{attempt}" / "batch.log").read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_qwen2) -> dict:
    """The tiny model and addition problems, and the training variables and overrides of a STEPS-step CPU run."""
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_qwen2()
    data = write_jsonl(root / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=64, seed=0))
    variables = {
        "MODEL_PATH": str(model),
        "DATA_PATH": str(data),
        "VAL_PATH": "none",
        "CONFIG": "examples/tiny_cpu.yaml",
        "GPUS_PER_NODE": "1",  # processes per node: one CPU process
        "SAVE_GRACE_S": "300",
        "PYTHONPATH": python_path(TESTS),  # reward_helpers, for the verifier's workers
    }
    overrides = [
        "data.max_prompt_length=480",
        "rollout.max_response_length=24",
        "algorithm.overlong_buffer_len=8",
        "algorithm.group_size=4",
        "reward.verifier=reward_helpers:one_in_four",  # informative groups at random: dynamic sampling at work
        "sampler.train_batch_size=4",
        "sampler.engine_sequences=40",
        "sampler.tick_steps=2",
        "optim.mini_batch_size=8",
        "optim.lr=1e-3",
        f"trainer.total_steps={STEPS}",
        "trainer.save_every=0",  # only the end, or a stop signal, saves
        "trainer.tensorboard=false",
    ]
    return {"root": root, "variables": variables, "overrides": overrides, "model": model, "data": data}


def train_job(cluster: dict, tiny: dict, run: Path, *extra: str, nodes: int = 1, **variables: str) -> str:
    run.parent.mkdir(parents=True, exist_ok=True)
    return submit(
        cluster,
        run.parent,
        "train_qwen32b.sh",
        *tiny["overrides"],
        *extra,
        nodes=nodes,
        **{**tiny["variables"], "RUN_DIR": str(run), "RDZV_PORT": str(_rendezvous_port()), **variables},
    )


def launch_job(cluster: dict, tiny: dict, run: Path, *extra: str, nodes: int, **variables: str) -> str:
    """train_job's job submitted as a user would with `python -m megatron_dapo.launch slurm` (from run's parent
    folder, not the repository): the config and overrides become the script's variables; the rest of them
    (SAVE_GRACE_S, the ports) and PYTHONPATH come from the environment. Returns the job id."""
    run.parent.mkdir(parents=True, exist_ok=True)
    config = ["--config", str(REPO / tiny["variables"]["CONFIG"]), "--nodes", str(nodes), "--gpus-per-node", "1"]
    sbatch = ["--sbatch-args", f"--parsable --output={run.parent}/%x-%j.out"]
    paths = [f"model.hf_path={tiny['model']}", f"data.train_files=[{tiny['data']}]", f"trainer.run_dir={run}"]
    env = {**cluster, "RDZV_PORT": str(_rendezvous_port()), **{k: tiny["variables"][k] for k in ("SAVE_GRACE_S", "PYTHONPATH")}, **variables}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.launch", "slurm", *config, *sbatch, *paths, *tiny["overrides"], *extra],
        cwd=run.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1].split(";")[0]


def _transport() -> str:
    """The rollout controller's two ports, free now (both slurmd run on this machine)."""
    return str(free_port_pair())


def _reference(cluster: dict, tiny: dict, run: Path) -> subprocess.Popen:
    """The same training in one local process, colocated (an asynchronous run at eta = 0 takes a colocated run's
    steps: tests/test_sampler_runs.py), started now to run beside the job; the job's metrics are compared with it."""
    run.parent.mkdir(parents=True, exist_ok=True)
    config = ["--config", str(REPO / tiny["variables"]["CONFIG"])]
    paths = [f"model.hf_path={tiny['model']}", f"data.train_files=[{tiny['data']}]", f"trainer.run_dir={run}"]
    cmd = [sys.executable, "-m", "megatron_dapo.train", *config, *paths, "eval.every=0", *tiny["overrides"]]
    env = {**cluster, "PYTHONPATH": tiny["variables"]["PYTHONPATH"]}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=(run.parent / "reference.err").open("w"))


def test_two_nodes_a_stall_is_requeued_and_the_next_attempt_resumes_step_for_step(cluster, tiny):
    """ROLLOUT_NODES=1 of a 2-node job submitted by `launch slurm`: two srun steps, one torchrun each, meeting at the
    rollout controller (pipeline.mode=async, eta = 0), a checkpoint every step.

    Attempt 0: the train process stops itself (DAPO_FAULT, SIGSTOP) in step 2's train step, step 1 saved; with the
    deadlines small through the config (stall 10 s), a watchdog names it, its stacks are written and collected, and
    the batch script requeues the stalled job (trainer.stall_requeues). Attempt 1 (the fault fires once per run)
    resumes from step 1 and runs to the end, step for step the uninterrupted run (sbatch's one resume end to end; a
    USR1 save and requeue is tests/test_slurm.py's, the same script under a stand-in srun, and USR1 reaching a real
    job's batch shell the next test's)."""
    run, ref = tiny["root"] / "jobs" / "two_nodes_stall", tiny["root"] / "jobs" / "reference"
    reference = _reference(cluster, tiny, ref)
    try:
        split = ["pipeline.mode=async", "pipeline.rollout_gpus=1", "sampler.max_staleness=0"]  # ROLLOUT_NODES=1
        small = ["trainer.stall_timeout_s=10", "trainer.collective_timeout_s=300", "trainer.save_every=1"]
        stop = {"DAPO_FAULT": "stop:micro_batch:2:0@train0"}
        job_id = launch_job(cluster, tiny, run, *split, *small, nodes=2, TRANSPORT_PORT=_transport(), **stop)
        info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
        assert reference.wait(timeout=600) == 0, (ref.parent / "reference.err").read_text()[-3000:]
    finally:
        reference.kill()
        reference.wait()
    out = (run.parent / f"dapo-qwen32b-{job_id}.out").read_text()
    if (info["JobState"], info["ExitCode"], info["Restarts"]) != ("COMPLETED", "0:0", "1"):  # what each attempt said
        said = [f"== {p}\n{p.read_text()[-1500:]}" for p in sorted((run / "logs" / job_id).rglob("*.log"))]
        raise AssertionError(f"{info}\n{out[-3000:]}\n" + "\n".join(said)[-8000:])
    assert info["NodeList"] == f"{HOST},{HOST}-2", info
    stalled = batch_log(run, job_id, 0)
    assert f"the run stalled (stall: train 0 (host {socket.gethostname()}, pid " in stalled, stalled
    assert (
        " in phase train of step 2" in stalled
        and "requeue 1 of trainer.stall_requeues=2, from step_00000001" in stalled
    )
    stacks = (run / "logs" / job_id / "attempt_0" / "stacks.txt").read_text()
    assert " in fault\n" in stacks and " in forward_step\n" in stacks  # the stopped process's, woken for them
    last = batch_log(run, job_id, 1)
    assert "latest checkpoint: step_00000001" in last and f"run finished at step {STEPS}" in last, last
    attempt = run / "logs" / job_id / "attempt_1"
    rollout, train = (attempt / "rollout_node0.log").read_text(), (attempt / "train_node0.log").read_text()
    assert "[default0]:" in rollout and "step 2 |" in train and "step 2 |" not in rollout  # the train side reports
    # the trainer itself resumed (a run that started again from scratch would end with the same metrics)
    assert "resumed from step 1" in train and "step 1 |" not in train, train[-3000:]
    assert (run / "FINISHED").read_text().strip() == str(STEPS)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    got = [comparable(m) for m in metrics(run)]
    assert [m["step"] for m in got] == [float(s) for s in range(1, STEPS + 1)]  # each step once
    assert got == [comparable(m) for m in metrics(ref)]
    assert all(m["weight_transport/gb"] > 0 for m in metrics(run))  # the weights went over the transport


def test_usr1_before_any_checkpoint_is_not_requeued(cluster, tiny):
    """USR1 while the trainer is still starting: nothing can be saved, so no requeue and a non-zero exit."""
    run = tiny["root"] / "jobs" / "usr1_early"
    job_id = train_job(cluster, tiny, run)
    wait_until(lambda: (run / "logs" / job_id / "attempt_0" / "node0.log").is_file(), what="the job step")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=cluster, check=True, timeout=30)
    info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "1:0", "0"), info
    assert "no checkpoint was saved in this job" in batch_log(run, job_id) and not (run / "checkpoints").exists()


def test_scancel_sigterm_saves_within_the_grace_and_is_not_requeued(cluster, tiny):
    """The colocated recipe on two nodes (one torchrun per node, data parallel 2 over gloo, rank 0 printing the
    progress) until `scancel`: SIGTERM to every process, the ranks save within KillWait, no requeue."""
    run = tiny["root"] / "jobs" / "sigterm"
    job_id = train_job(cluster, tiny, run, nodes=2)
    wait_until(lambda: len(metrics(run)) >= 1, what="the first step of the job")
    subprocess.run(["scancel", job_id], env=cluster, check=True, timeout=30)  # SIGTERM to every process
    info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info
    wait_until(lambda: "terminated by SIGTERM" in batch_log(run, job_id), timeout=60, what="the batch log line")
    latest = (run / "checkpoints" / "latest").read_text().strip()  # a tiny step fits KillWait's 30 s
    assert latest == f"step_{len(metrics(run)):08d}", (latest, len(metrics(run)))
    logs = [(run / "logs" / job_id / "attempt_0" / f"node{n}.log").read_text() for n in (0, 1)]
    assert all("[default0]:" in log for log in logs)  # one agent per node, each with its one worker
    assert sum("step 1 |" in log for log in logs) == 1  # rank 0 prints the progress lines


def test_a_failing_job_exits_nonzero_and_is_never_requeued(cluster, tiny):
    """The batch script's own input check fails the job (the script's other failure paths, a trainer that crashes
    and USR2's save-and-stop among them, are tests/test_slurm.py's: the same script under a stand-in srun)."""
    run = tiny["root"] / "jobs" / "bad_data_path"
    job_id = train_job(cluster, tiny, run, DATA_PATH=str(tiny["root"] / "missing.jsonl"))
    info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0" and info["ExitCode"] != "0:0", info
    out = (run.parent / f"dapo-qwen32b-{job_id}.out").read_text()
    assert f"error: DATA_PATH={tiny['root'] / 'missing.jsonl'}: no such file" in out, out[-2000:]


def test_convert_and_eval_jobs(cluster, tiny):
    work = tiny["root"] / "jobs" / "convert"
    work.mkdir(parents=True)
    mcore = work / "mcore"
    job_id = submit(
        cluster, work, "convert_checkpoint.sh", "hf-to-megatron", "--hf", str(tiny["model"]), "--out", str(mcore)
    )
    info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "COMPLETED", (work / f"dapo-convert-{job_id}.out").read_text()[-3000:]
    assert (mcore / "megatron_dapo.json").is_file()
    results = work / "eval.jsonl"
    job_id = submit(
        cluster,
        work,
        "eval.sh",
        "--max-tokens",
        "8",
        "--verifier",
        "reward_helpers:one_in_four",
        "reward.num_workers=1",
        MODEL_PATH=str(mcore),
        EVAL_DATA=str(tiny["data"]),
        EVAL_OUT=str(results),
        K="2",
        TP="1",  # vLLM on CPU: one process
        PYTHONPATH=python_path(TESTS),
    )
    info = wait_for(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    out = (work / f"dapo-eval-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", out[-3000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert len(rows) == 64 and all(len(r["responses"]) == 2 for r in rows)
    assert "avg@2 " in out and "64 problems, 128 responses" in out
