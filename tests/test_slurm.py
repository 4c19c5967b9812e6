"""The Slurm scripts (slurm/*.sh) without Slurm: their --dry-run output under a synthetic job
environment, their errors, and the training script's stop/requeue logic with a fake srun.

Only Slurm's own commands are faked: `scontrol` (expands node lists such as gpu[001-004],
records `requeue`) and, for the requeue tests, `srun` (acts out one job step). The scripts run in
a scratch repository that links the real megatron_dapo/, slurm/ and conversion tools, so the
paths they print are known exactly.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
SCRIPTS = ["train_qwen32b.sh", "torchrun_node.sh", "convert_checkpoint.sh", "eval.sh"]
CONFIG = "examples/dapo_math_qwen2.5_32b.yaml"
JOB_ID = "31337"

FAKE_SCONTROL = f"""#!{sys.executable}
# fake scontrol: `show hostnames LIST` expands prefix[a-b,c] lists; `show node NAME --oneliner` gives its address
# ip-NAME; `requeue JOB` is recorded
import os, re, sys

args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", args[2]):
        m = re.fullmatch(r"(.*)\\[(.*)\\]", part)
        if not m:
            print(part)
            continue
        for span in m.group(2).split(","):
            lo, _, hi = span.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                print(f"{{m.group(1)}}{{i:0{{len(lo)}}d}}")
elif args[:2] == ["show", "node"] and args[3:] == ["--oneliner"]:
    print(f"NodeName={{args[2]}} Arch=x86_64 NodeAddr=ip-{{args[2]}} NodeHostName={{args[2]}} State=ALLOCATED")
elif args[:1] == ["requeue"]:
    with open(os.environ["FAKE_DIR"] + "/requeued", "a") as f:
        f.write(" ".join(args[1:]) + "\\n")
else:
    sys.exit(f"fake scontrol: unexpected arguments {{args}}")
"""

# The job step: FAKE_SIGNAL goes to the batch shell (Slurm's --signal=B:...), then the step waits
# up to 1 s for the shell to pass a SIGUSR1 on, does FAKE_ACTION and exits with FAKE_RC.
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun_args"
got=""
trap 'got=1; echo USR1 >> "$FAKE_DIR/srun_signals"' USR1
if [[ $FAKE_SIGNAL != none ]]; then
    kill -"$FAKE_SIGNAL" "$PPID"
    # signalled at once, as early as the batch shell can be (before it knew srun's pid, once in a loaded make test,
    # when the script then never passed it on). USR1/USR2 come back: wait up to 10 s; TERM must not: 1 s to see
    tries=100; [[ $FAKE_SIGNAL == TERM ]] && tries=10
    for _ in $(seq "$tries"); do [[ -n $got ]] && break; sleep 0.1; done
fi
save() { mkdir -p "$RUN_DIR/checkpoints"; echo step_00000007 > "$RUN_DIR/checkpoints/latest"; }
stall() { # what a run's watchdog leaves in the attempt's log folder when it ends a stalled run
    mkdir -p "$DAPO_LOG_DIR/stacks"
    echo '{"line": "stall: rank 3 (host gpu002, pid 77) made no progress for 901 s in phase train", "at": 1}' \
        > "$DAPO_LOG_DIR/stall.json"
    printf 'Thread 0x1 (most recent call first):\n  File "x.py", line 1 in train_step\n' \
        > "$DAPO_LOG_DIR/stacks/rank3-gpu002-77.txt"
}
case $FAKE_ACTION in
    save) save ;;
    finish) save; echo 7 > "$RUN_DIR/FINISHED" ;;
    stall) save; stall ;;
esac
exit "$FAKE_RC"
"""


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def job(tmp_path: Path) -> dict:
    """A scratch repository, model, data and fake Slurm commands; returns the paths and a clean environment."""
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    (repo / CONFIG).write_text("# the 32B recipe\n")
    (repo / "megatron_dapo").symlink_to(REPO / "megatron_dapo")
    (repo / "slurm").symlink_to(SLURM)
    (repo / "tools").mkdir()
    for tool in ("convert_hf_to_megatron.py", "convert_megatron_to_hf.py"):
        (repo / "tools" / tool).symlink_to(REPO / "tools" / tool)
    (repo / "tools" / "eval.py").write_text("# stands in for tools/eval.py\n")
    venv = tmp_path / "venv"
    for name in ("python", "torchrun"):
        _executable(venv / "bin" / name, "#!/bin/sh\nexit 99\n")  # a dry run never runs them
    model = tmp_path / "models" / "Qwen2.5-32B"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    data = tmp_path / "data" / "dapo-math-17k.parquet"
    val = tmp_path / "data" / "aime-2024.parquet"
    data.parent.mkdir()
    data.write_bytes(b"")
    val.write_bytes(b"")
    fake = tmp_path / "fake"
    _executable(fake / "bin" / "scontrol", FAKE_SCONTROL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(
        PATH=f"{fake / 'bin'}:{env['PATH']}",
        FAKE_DIR=str(fake),
        REPO_DIR=str(repo),
        VENV=str(venv),
        MODEL_PATH=str(model),
        DATA_PATH=str(data),
        VAL_PATH=str(val),
        RUN_DIR=str(tmp_path / "run"),
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NODELIST="gpu[001-004]",
        SLURM_NNODES="4",
        SLURM_NODEID="0",
        SLURM_PROCID="0",
        SLURM_CPUS_ON_NODE="96",
        SLURM_SUBMIT_DIR=str(repo),
    )
    settings = ("GPUS_PER_NODE", "RDZV_PORT", "SAVE_GRACE_S", "LOG_DIR", "CONFIG", "EVAL_DATA", "EVAL_OUT")
    for name in (*settings, "K", "TP", "TEMPERATURE", "TOP_P"):  # a developer's own settings must not leak in
        env.pop(name, None)
    return dict(
        env=env, repo=repo, venv=venv, model=model, data=data, val=val, run=tmp_path / "run", fake=fake, tmp=tmp_path
    )


def run(script: str, *args: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM / script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def blocks(stdout: str) -> list[tuple[str, list[str]]]:
    """(comment line, command words) pairs of a dry run's output."""
    lines = stdout.strip().splitlines()
    assert len(lines) % 2 == 0, stdout
    for header in lines[::2]:
        assert header.startswith("# "), stdout
    return [(h, shlex.split(c)) for h, c in zip(lines[::2], lines[1::2])]


def train_words(job: dict, *overrides: str) -> list[str]:
    """What every node's torchrun runs after its launcher options."""
    return [
        "-m",
        "megatron_dapo.train",
        "--config",
        CONFIG,
        f"trainer.run_dir={job['run']}",
        f"model.hf_path={job['model']}",
        f"data.train_files=[{job['data']}]",
        f"data.val_files=[{job['val']}]",
        *overrides,
    ]


def torchrun_common(
    nnodes: int, head: str, port: int = 29500, gpus: int = 8, grace: int = 2400, rdzv_id: str = JOB_ID
) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={gpus}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={head}:{port}",
        f"--rdzv-id={rdzv_id}",
        "--max-restarts=0",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        f"--shutdown-timeout={grace}",
        "--tee=3",
    ]


# ---------------------------------------------------------------- train_qwen32b.sh --dry-run


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[001-004]", ["gpu001", "gpu002", "gpu003", "gpu004"]),
        ("node[7,9-10],login5", ["node7", "node9", "node10", "login5"]),
        ("gpu[001-002]", ["gpu001", "gpu002"]),
    ],
)
def test_train_dry_run_prints_srun_and_every_node(job, nodelist, hosts):
    env = dict(job["env"], SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts)))
    overrides = ["trainer.total_steps=200", "trainer.wandb_project=dapo 32b", "sampler.max_gen_batches=12"]
    p = run("train_qwen32b.sh", "--dry-run", *overrides, env=env)
    assert p.returncode == 0, p.stderr
    out = blocks(p.stdout)
    assert len(out) == 1 + len(hosts)  # the srun line, then one block per node

    n = len(hosts)
    logs = job["run"] / "logs" / JOB_ID / "attempt_0"
    # the rendezvous at the first node's address as Slurm knows it (NodeAddr): its name may not resolve
    torchrun = [
        str(job["venv"] / "bin" / "torchrun"),
        *torchrun_common(n, f"ip-{hosts[0]}"),
        *train_words(job, *overrides),
    ]
    header, srun = out[0]
    assert header == f"# srun, run once by the batch script on {hosts[0]}:"
    assert srun == [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--cpus-per-task=96",
        "--kill-on-bad-exit=1",
        f"--chdir={job['repo']}",
        f"--output={logs}/node%n.log",
        "bash",
        f"{job['repo']}/slurm/torchrun_node.sh",
        f"{logs}/torchrun",
        *torchrun,
    ]
    for rank, (header, words) in enumerate(out[1:]):
        assert header == f"# node {rank} of {n}: {hosts[rank]}" + (" (rendezvous host)" if rank == 0 else "")
        assert words == [
            torchrun[0],
            f"--rdzv-conf=is_host={int(rank == 0)},read_timeout=300",
            f"--log-dir={logs}/torchrun/node{rank}",
            *torchrun[1:],
        ]
    assert not job["run"].exists()  # a dry run writes nothing


def test_train_dry_run_settings_from_the_environment(job):
    (job["repo"] / "examples" / "other.yaml").write_text("{}\n")
    env = dict(job["env"], SLURM_JOB_NODELIST="a[1-2]", SLURM_NNODES="2", SLURM_RESTART_COUNT="3", VAL_PATH="none")
    env.update(GPUS_PER_NODE="4", RDZV_PORT="31000", SAVE_GRACE_S="3600", CONFIG="examples/other.yaml")
    env.update(RUN_DIR="runs/mine", LOG_DIR=str(job["tmp"] / "logs"))
    del env["SLURM_CPUS_ON_NODE"]
    p = run("train_qwen32b.sh", "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    (_, srun), (_, node0), (_, node1) = blocks(p.stdout)
    run_dir = job["repo"] / "runs" / "mine"  # relative paths are taken from the repository
    logs = job["tmp"] / "logs" / JOB_ID / "attempt_3"
    assert not any(w.startswith("--cpus-per-task") for w in srun)
    assert f"--output={logs}/node%n.log" in srun
    assert node1[1:3] == ["--rdzv-conf=is_host=0,read_timeout=300", f"--log-dir={logs}/torchrun/node1"]
    assert node1[3:] == [
        *torchrun_common(2, "ip-a1", port=31000, gpus=4, grace=3600),
        "-m",
        "megatron_dapo.train",
        "--config",
        "examples/other.yaml",
        f"trainer.run_dir={run_dir}",
        f"model.hf_path={job['model']}",
        f"data.train_files=[{job['data']}]",
        "eval.every=0",
        "trainer.resume=true",  # attempt 3: a requeued attempt resumes whatever the config says
    ]


def test_train_dry_run_async_splits_the_nodes_into_two_steps(job):
    """ROLLOUT_NODES=1 of 4: a rollout step on the first node, a train step on the other three, each with its role,
    the controller's address and the train side's size in its environment, a rendezvous and logs of its own; the
    trainer's overrides end with the split (the engines' processes: the rollout nodes' GPUs)."""
    env = dict(job["env"], ROLLOUT_NODES="1", TRANSPORT_PORT="29700")
    p = run("train_qwen32b.sh", "--dry-run", "trainer.total_steps=200", env=env)
    assert p.returncode == 0, p.stderr
    out = blocks(p.stdout)
    assert [h for h, _ in out] == [
        "# srun (rollout side), run once by the batch script on gpu001:",
        "# rollout node 0 of 1: gpu001 (rendezvous host)",
        "# srun (train side), run once by the batch script on gpu001:",
        "# train node 0 of 3: gpu002 (rendezvous host)",
        "# train node 1 of 3: gpu003",
        "# train node 2 of 3: gpu004",
    ]
    logs = job["run"] / "logs" / JOB_ID / "attempt_0"
    words = train_words(job, "trainer.total_steps=200", "pipeline.mode=async", "pipeline.rollout_gpus=8")
    meet = "DAPO_TRANSPORT=ip-gpu001:29700,DAPO_TRAIN_PROCS=24"
    for (_, srun), side, nodes, head, port in [
        (out[0], "rollout", ["gpu001"], "ip-gpu001", 29500),
        (out[2], "train", ["gpu002", "gpu003", "gpu004"], "ip-gpu002", 29501),
    ]:
        n = len(nodes)
        assert srun[:6] == [
            "srun",
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}",
            f"--export=ALL,DAPO_ROLE={side},{meet}",
        ]
        assert f"--output={logs}/{side}_node%n.log" in srun
        torchrun = torchrun_common(n, head, port=port, rdzv_id=f"{JOB_ID}-{side}")
        assert srun[-len(torchrun) - len(words) :] == [*torchrun, *words]
    assert out[5][1][1:3] == ["--rdzv-conf=is_host=0,read_timeout=300", f"--log-dir={logs}/train_torchrun/node2"]


@pytest.mark.parametrize("value", ["4", "-1", "two"])
def test_train_rollout_nodes_must_leave_nodes_to_train(job, value):
    p = run("train_qwen32b.sh", "--dry-run", env=dict(job["env"], ROLLOUT_NODES=value))
    assert p.returncode == 2
    assert p.stderr.startswith(f"error: ROLLOUT_NODES='{value}': expected 0 (colocated) or the number of nodes"), (
        p.stderr
    )


@pytest.mark.parametrize(
    "name", ["SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "MODEL_PATH", "DATA_PATH", "VAL_PATH"]
)
def test_train_missing_variable_is_named(job, name):
    env = dict(job["env"])
    del env[name]
    p = run("train_qwen32b.sh", "--dry-run", env=env)
    assert p.returncode == 2
    assert p.stderr.startswith(f"error: {name} is not set: expected "), p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize(
    "change, args, message",
    [
        ({"SLURM_NNODES": "3"}, [], "SLURM_NNODES=3 but SLURM_JOB_NODELIST=gpu[001-004] holds 4 hosts"),
        ({"GPUS_PER_NODE": "eight"}, [], "GPUS_PER_NODE='eight': expected a positive integer"),
        ({"SAVE_GRACE_S": "0"}, [], "SAVE_GRACE_S='0': expected a positive integer"),
        ({"DATA_PATH": "/nonexistent/train.parquet"}, [], "DATA_PATH=/nonexistent/train.parquet: no such file"),
        ({"VAL_PATH": "/nonexistent/aime.parquet"}, [], "VAL_PATH=/nonexistent/aime.parquet: no such file"),
        ({"MODEL_PATH": "/nonexistent"}, [], "MODEL_PATH=/nonexistent has no config.json"),
        ({"CONFIG": "examples/missing.yaml"}, [], "CONFIG=examples/missing.yaml: no such file"),
        ({"REPO_DIR": "/"}, [], "REPO_DIR=/ has no slurm/lib.sh"),
        ({}, ["trainer.total_steps=5", "--dry-run"], "argument '--dry-run': expected a dotted config override"),
        ({}, ["total_steps"], "argument 'total_steps': expected a dotted config override key=value"),
    ],
)
def test_train_bad_input_is_named(job, change, args, message):
    p = run("train_qwen32b.sh", *(args or ["--dry-run"]), env=dict(job["env"], **change))
    assert p.returncode == 2
    assert p.stderr.startswith(f"error: {message}"), p.stderr


def test_train_without_scontrol_says_so(job, tmp_path):
    # a PATH of every command but scontrol (a real Slurm may be installed beside the fake one)
    bare = tmp_path / "no_scontrol"
    bare.mkdir()
    for d in job["env"]["PATH"].split(os.pathsep):
        if "fake" in d or not Path(d).is_dir():
            continue
        for exe in Path(d).iterdir():
            if exe.name != "scontrol" and not (bare / exe.name).exists():
                (bare / exe.name).symlink_to(exe)
    env = dict(job["env"], PATH=str(bare))
    assert shutil.which("scontrol", path=env["PATH"]) is None
    p = run("train_qwen32b.sh", "--dry-run", env=env)
    assert p.returncode == 2
    assert p.stderr.startswith("error: scontrol not found on PATH: it expands SLURM_JOB_NODELIST"), p.stderr


def test_node_launcher_needs_the_node_id(job):
    env = dict(job["env"])
    del env["SLURM_NODEID"]
    p = run("torchrun_node.sh", "--print", "/logs", "torchrun", "--nnodes=2", env=env)
    assert p.returncode == 2
    assert "error: SLURM_NODEID='': expected this node's index in the job (srun sets it)" in p.stderr


# ---------------------------------------------------------------- train_qwen32b.sh: stop, save, requeue


def run_job(job: dict, signal: str, action: str, rc: int) -> tuple[subprocess.CompletedProcess, dict]:
    """The training script for real, with a fake srun acting out one job step."""
    _executable(job["fake"] / "bin" / "srun", FAKE_SRUN)
    env = dict(job["env"], FAKE_SIGNAL=signal, FAKE_ACTION=action, FAKE_RC=str(rc))
    p = run("train_qwen32b.sh", "trainer.total_steps=7", env=env)
    fake = job["fake"]
    seen = {
        "requeued": (fake / "requeued").read_text() if (fake / "requeued").exists() else None,
        "forwarded": (fake / "srun_signals").read_text() if (fake / "srun_signals").exists() else None,
        "srun_args": (fake / "srun_args").read_text().splitlines(),
    }
    return p, seen


def test_usr1_saved_then_requeued(job):
    p, seen = run_job(job, signal="USR1", action="save", rc=1)  # torchrun exits 1 after a handled signal
    assert p.returncode == 0, p.stdout + p.stderr
    assert seen["forwarded"] == "USR1\n"  # the batch shell passed the signal on to the step
    assert seen["requeued"] == f"{JOB_ID}\n"
    assert "requeueing job 31337, the next attempt resumes from it" in p.stdout
    batch_log = (job["run"] / "logs" / JOB_ID / "attempt_0" / "batch.log").read_text()
    assert "got SIGUSR1" in batch_log and "requeueing" in batch_log
    # the step it launched is the one --dry-run prints
    dry = run("train_qwen32b.sh", "--dry-run", "trainer.total_steps=7", env=job["env"])
    assert seen["srun_args"] == blocks(dry.stdout)[0][1][1:]


def test_usr1_without_a_new_checkpoint_is_not_requeued(job):
    p, seen = run_job(job, signal="USR1", action="none", rc=1)
    assert p.returncode == 1
    assert seen["forwarded"] == "USR1\n" and seen["requeued"] is None
    assert "no checkpoint was saved in this job" in p.stdout


def test_usr1_when_the_run_is_finished_is_not_requeued(job):
    p, seen = run_job(job, signal="USR1", action="finish", rc=1)
    assert p.returncode == 0
    assert seen["requeued"] is None
    assert "run finished at step 7" in p.stdout


def test_usr2_saves_and_stops(job):
    p, seen = run_job(job, signal="USR2", action="save", rc=1)
    assert p.returncode == 0
    assert seen["forwarded"] == "USR1\n" and seen["requeued"] is None
    assert "stopped by SIGUSR2 after saving step_00000007; not requeued" in p.stdout


def test_sigterm_is_not_passed_on_nor_requeued(job):
    p, seen = run_job(job, signal="TERM", action="save", rc=1)
    assert p.returncode == 143
    assert seen["forwarded"] is None and seen["requeued"] is None


def test_finished_run_exits_zero(job):
    p, seen = run_job(job, signal="none", action="finish", rc=0)
    assert p.returncode == 0 and seen["requeued"] is None
    assert "run finished at step 7" in p.stdout


@pytest.mark.parametrize("rc, expected", [(3, 3), (0, 1)])
def test_failure_without_signal_exits_nonzero_and_is_not_requeued(job, rc, expected):
    job["run"].mkdir()
    (job["run"] / "FINISHED").write_text("5\n")  # left by an earlier launch: must not hide this failure
    p, seen = run_job(job, signal="none", action="save", rc=rc)
    assert p.returncode == expected
    assert seen["requeued"] is None and seen["forwarded"] is None
    assert f"training failed with srun status {rc}" in p.stdout
    assert not (job["run"] / "FINISHED").exists()


def test_a_stall_is_requeued_up_to_the_config_s_limit_then_ends_the_job(job):
    """The run's watchdog ended it (stall.json in the attempt's log folder, which every process of the job is told
    through DAPO_LOG_DIR): requeued from latest while trainer.stall_requeues (read from the config and overrides)
    allows, counting across the job's attempts; then exit 75. The stacks are collected into stacks.txt."""
    (job["repo"] / CONFIG).write_text("trainer:\n  stall_requeues: 2\n")
    _executable(job["venv"] / "bin" / "python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the real one
    seen = []
    for attempt in (0, 1):  # the override wins over the config file's 2
        job["env"]["SLURM_RESTART_COUNT"] = str(attempt)
        (job["fake"] / "requeued").unlink(missing_ok=True)
        _executable(job["fake"] / "bin" / "srun", FAKE_SRUN)
        env = dict(job["env"], FAKE_SIGNAL="none", FAKE_ACTION="stall", FAKE_RC="1")
        p = run("train_qwen32b.sh", "trainer.stall_requeues=1", env=env)
        log = job["run"] / "logs" / JOB_ID / f"attempt_{attempt}"
        seen.append((p, (job["fake"] / "requeued").read_text() if (job["fake"] / "requeued").exists() else None, log))
    (first, requeued, log), (second, again, log2) = seen
    assert first.returncode == 0 and requeued == f"{JOB_ID}\n", first.stdout + first.stderr
    line = "stall: rank 3 (host gpu002, pid 77) made no progress for 901 s in phase train"
    assert f"the run stalled ({line}): requeue 1 of trainer.stall_requeues=1, from step_00000007" in first.stdout
    assert (log / "stacks.txt").read_text().startswith("==== rank3-gpu002-77 ====\nThread 0x1")
    assert second.returncode == 75 and again is None, second.stdout + second.stderr
    assert f"the run stalled ({line}); no requeue left (trainer.stall_requeues=1): see {log2}/stacks.txt" in (
        second.stdout
    )


FAKE_SRUN_TWO_STEPS = """#!{python}
import os, signal, sys, time
# ROLLOUT_NODES: the rollout step fails after half a second; the train step runs until srun is interrupted twice
if any("DAPO_ROLE=rollout" in a for a in sys.argv):
    time.sleep(0.5)
    sys.exit(9)
ints = []
def interrupted(signum, frame):  # srun: the second Ctrl-C within a second cancels the step
    ints.append(signum)
    with open(os.path.join(os.environ["FAKE_DIR"], "train_signals"), "a") as f:
        f.write("INT\\n")
    if len(ints) == 2:
        sys.exit(130)
signal.signal(signal.SIGINT, interrupted)  # a background job starts with SIGINT ignored; srun installs its own
time.sleep(60)
"""


def test_async_a_failed_rollout_step_stops_the_train_step(job):
    """ROLLOUT_NODES: the two sides are two srun steps; when the rollout step fails first, the batch script stops the
    train step (srun's two interrupts) instead of leaving it waiting for batches that never come."""
    _executable(job["fake"] / "bin" / "srun", FAKE_SRUN_TWO_STEPS.format(python=sys.executable))
    env = dict(job["env"], ROLLOUT_NODES="1")
    p = run("train_qwen32b.sh", "trainer.total_steps=7", env=env)
    assert (job["fake"] / "train_signals").read_text() == "INT\nINT\n"
    assert "the rollout step exited with status 9: stopping the train step" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 130 and "training failed with srun status 130" in p.stdout


# ---------------------------------------------------------------- convert_checkpoint.sh, eval.sh


@pytest.mark.parametrize(
    "direction, tool, args",
    [
        ("hf-to-megatron", "convert_hf_to_megatron.py", ["--hf", "/m/Qwen2.5-32B", "--out", "/c/mcore", "--tp", "8"]),
        ("megatron-to-hf", "convert_megatron_to_hf.py", ["--megatron", "/c/mcore", "--out", "/m/my model"]),
    ],
)
def test_convert_dry_run(job, direction, tool, args):
    p = run("convert_checkpoint.sh", "--dry-run", direction, *args, env=job["env"])
    assert p.returncode == 0, p.stderr
    [(header, words)] = blocks(p.stdout)
    assert header.startswith(f"# run in {job['repo']} on ")
    assert words == [str(job["venv"] / "bin" / "python"), f"tools/{tool}", *args]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "DIRECTION is missing: expected hf-to-megatron or megatron-to-hf"),
        (["hf2mcore", "--hf", "x"], "DIRECTION 'hf2mcore': expected hf-to-megatron or megatron-to-hf"),
    ],
)
def test_convert_bad_direction_is_named(job, args, message):
    p = run("convert_checkpoint.sh", "--dry-run", *args, env=job["env"])
    assert p.returncode == 2
    assert p.stderr.startswith(f"error: {message}"), p.stderr


def test_eval_dry_run(job):
    env = dict(job["env"], EVAL_DATA=str(job["val"]))
    p = run("eval.sh", "--dry-run", "--hf-config", "/m/base", "model.dtype=bf16", env=env)
    assert p.returncode == 0, p.stderr
    [(header, words)] = blocks(p.stdout)
    assert header.startswith(f"# run in {job['repo']} on ")
    out = job["repo"] / "runs" / "eval" / f"Qwen2.5-32B-aime-2024-{JOB_ID}.jsonl"
    assert words == [
        str(job["venv"] / "bin" / "python"),
        "tools/eval.py",
        "--model",
        str(job["model"]),
        "--data",
        str(job["val"]),
        "--k",
        "32",
        "--temperature",
        "1.0",
        "--top-p",
        "0.7",
        "--tp",
        "8",
        "--out",
        str(out),
        "--hf-config",
        "/m/base",
        "model.dtype=bf16",
    ]


@pytest.mark.parametrize("name", ["MODEL_PATH", "EVAL_DATA"])
def test_eval_missing_variable_is_named(job, name):
    env = dict(job["env"], EVAL_DATA=str(job["val"]))
    del env[name]
    p = run("eval.sh", "--dry-run", env=env)
    assert p.returncode == 2
    assert p.stderr.startswith(f"error: {name} is not set: expected "), p.stderr


# ---------------------------------------------------------------- the scripts as files


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck():
    # -x follows the `source slurm/lib.sh` lines (paths relative to the repository root)
    scripts = [str(SLURM / s) for s in SCRIPTS]
    p = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=SLURM.parent)
    assert p.returncode == 0, p.stdout


def test_signal_lead_and_torchrun_grace_agree():
    """torchrun must wait for the workers at least as long as the lead the trainer gets before the time limit."""
    text = (SLURM / "train_qwen32b.sh").read_text()
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=B:USR1@2400\n" in text
    assert "SAVE_GRACE_S=${SAVE_GRACE_S:-2400}" in text
