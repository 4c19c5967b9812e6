"""`python -m megatron_dapo.launch {local,slurm,ray}`: what each launcher computes, checked without running a job.

The runs themselves: `launch local` and `launch ray` on a real two-raylet Ray cluster in tests/test_trainer.py (beside
the torchrun runs they are compared with), `launch slurm` on a real two-node Slurm cluster in
tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.launch.ray_cluster import Slot, forwarded_env, node_devices, slots_for, world_env
from megatron_dapo.launch.slurm import sbatch_command, shell_line

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


def test_a_launcher_is_named_first():
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.launch", "--config", "x.yaml"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: expected a launcher first, one of local, slurm, ray (python -m megatron_dapo.launch --help)"
    )
