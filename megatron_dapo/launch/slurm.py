"""`python -m megatron_dapo.launch slurm`: submit slurm/train_qwen32b.sh with what a config and overrides say.

The batch script reads its run from variables (docs/slurm.md); this turns the config file and the dotted overrides
into them, one mapping (SCRIPT_VARIABLES), and passes every other override on as the script's arguments:

    --config FILE                       CONFIG
    model.hf_path                       MODEL_PATH
    data.train_files (one file)         DATA_PATH
    data.val_files (one file, or none)  VAL_PATH (none: no evaluation, the script sets eval.every=0)
    trainer.run_dir                     RUN_DIR
    --gpus-per-node G                   GPUS_PER_NODE, and sbatch --gpus-per-node=G
    pipeline.mode=async, rollout_gpus   ROLLOUT_NODES = pipeline.rollout_gpus / G (the script adds both keys back)
    --nodes N                           sbatch --nodes=N

Every other variable the script reads (SAVE_GRACE_S, RDZV_PORT, TRANSPORT_PORT, VENV, ...) comes from this
environment as it is. `--print-only` prints the command instead of running it; the script's own `--dry-run` (inside
an allocation: each node's command) is another thing and keeps its meaning.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from megatron_dapo.cli import UserError
from megatron_dapo.config import Config, ConfigError

SCRIPT = Path("slurm") / "train_qwen32b.sh"
CONSUMED_KEYS = ("model.hf_path", "data.train_files", "data.val_files", "trainer.run_dir", "pipeline.mode")
"""Overrides that become the script's variables (pipeline.rollout_gpus too, in an asynchronous job)."""


def repo_root() -> Path:
    """The source checkout this package runs from: the batch script is a file of it, not of the package."""
    root = Path(__file__).resolve().parents[2]
    if not (root / SCRIPT).is_file():
        raise UserError(
            f"{root / SCRIPT} not found: `launch slurm` submits the repository's batch script; run it from a source "
            "checkout (git clone, then pip install -e .)"
        )
    return root


def sbatch_command(
    config: Optional[str],
    overrides: list[str],
    cfg: Config,
    nodes: int,
    gpus_per_node: int,
    sbatch_args: list[str],
    cwd: Path,
) -> tuple[dict[str, str], list[str]]:
    """(the variables the script reads, the sbatch command line). Paths stay as written when cwd is the repository
    root (the script takes them from there); elsewhere they become absolute and REPO_DIR says where the script is."""
    if config is None:
        raise ConfigError("launch slurm: expected --config FILE (the script passes it to every node as CONFIG)")
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: expected both at least 1")
    root = repo_root()
    at_root = cwd.resolve() == root

    def path(p: str) -> str:
        return p if at_root or os.path.isabs(p) else str((cwd / p).resolve())

    if len(cfg.data.train_files) != 1:
        raise ConfigError(
            f"data.train_files={cfg.data.train_files}: the Slurm script takes exactly one file (DATA_PATH); "
            "merge them into one, or submit slurm/train_qwen32b.sh yourself with data.train_files=[...] as an argument"
        )
    if len(cfg.data.val_files) > 1:
        raise ConfigError(f"data.val_files={cfg.data.val_files}: the Slurm script takes one file (VAL_PATH) or none")
    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path is empty: the Slurm script needs the model directory (MODEL_PATH)")
    variables = {
        "CONFIG": path(config),
        "MODEL_PATH": path(cfg.model.hf_path),
        "DATA_PATH": path(cfg.data.train_files[0]),
        "VAL_PATH": path(cfg.data.val_files[0]) if cfg.data.val_files and cfg.eval.every > 0 else "none",
        "RUN_DIR": path(cfg.trainer.run_dir),
        "GPUS_PER_NODE": str(gpus_per_node),
    }
    if cfg.pipeline.mode == "async":
        rollout_nodes, rest = divmod(cfg.pipeline.rollout_gpus, gpus_per_node)
        if rest or not 0 < rollout_nodes < nodes:
            raise ConfigError(
                f"pipeline.rollout_gpus={cfg.pipeline.rollout_gpus}: on Slurm the rollout side takes whole nodes, "
                f"expected a multiple of --gpus-per-node {gpus_per_node} below the job's {nodes * gpus_per_node} GPUs"
            )
        variables["ROLLOUT_NODES"] = str(rollout_nodes)
    if not at_root:
        variables = {"REPO_DIR": str(root), **variables}
    consumed = (*CONSUMED_KEYS, *(("pipeline.rollout_gpus",) if cfg.pipeline.mode == "async" else ()))
    rest = [o for o in overrides if o.split("=", 1)[0].strip() not in consumed]
    script = str(SCRIPT) if at_root else str(root / SCRIPT)
    command = ["sbatch", f"--nodes={nodes}", f"--gpus-per-node={gpus_per_node}", *sbatch_args, script, *rest]
    return variables, command


def shell_line(variables: dict[str, str], command: list[str]) -> str:
    """The command as one shell line: VAR=value ... sbatch ... (quoted where the shell needs it)."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in variables.items()), shlex.join(command)])


def run_slurm(
    config: Optional[str],
    overrides: list[str],
    cfg: Config,
    nodes: int,
    gpus_per_node: int,
    sbatch_args: str,
    print_only: bool,
) -> int:
    """Print the sbatch line (--print-only) or run it: sbatch's own exit status, its output passed through."""
    variables, command = sbatch_command(
        config, overrides, cfg, nodes, gpus_per_node, shlex.split(sbatch_args), Path.cwd()
    )
    if print_only:
        print(shell_line(variables, command), flush=True)
        return 0
    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH: run this on a Slurm login node (--print-only shows the command)")
    return subprocess.run(command, env={**os.environ, **variables}).returncode
