"""Launch a training run on this machine, a Slurm cluster or a Ray cluster: one command, the same config.

  python -m megatron_dapo.launch local --config FILE [--nproc-per-node N] [overrides]
  python -m megatron_dapo.launch slurm --config FILE --nodes N [--gpus-per-node G] [--print-only] [overrides]
  python -m megatron_dapo.launch ray   --config FILE --nodes N [--gpus-per-node G] [--address HOST:PORT] [overrides]

local: the trainer in one process, or under torchrun with --nproc-per-node > 1 (pipeline.mode=async: both sides, the
rollout side's pipeline.rollout_gpus processes among them; default pipeline.rollout_gpus + 1). slurm: sbatch slurm/train_qwen32b.sh, the config and overrides turned
into the variables the script reads (docs/slurm.md gives the mapping); --print-only prints the command. ray: on an
existing Ray cluster, one actor per GPU, restarts from the newest checkpoint when a worker or node dies (docs/ray.md).
Overrides are the trainer's dotted KEY=VALUE (docs/config.md). Stop signals (SIGTERM, SIGINT, SIGUSR1) reach the
trainer processes, which save and exit 0: a later launch resumes.
"""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.cli import argument_parser, quiet_libraries, run_cli

LAUNCHERS = ("local", "slurm", "ray")


def parser(launcher: str) -> argparse.ArgumentParser:
    """One launcher's options (argparse's subcommands cannot take options between the overrides)."""
    ap = argument_parser(__doc__, prog=f"python -m megatron_dapo.launch {launcher}")
    ap.add_argument("--config", default=None, help="YAML config file (defaults: the paper's values)")
    ap.add_argument("--debug", action="store_true", help="tracebacks for user errors, and every library's log")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=200")
    if launcher == "local":
        ap.add_argument(
            "--nproc-per-node",
            type=int,
            default=None,
            help="processes (GPUs) on this machine (default 1; pipeline.mode=async: both sides', default "
            "pipeline.rollout_gpus + 1)",
        )
        return ap
    ap.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (trainer processes) per node (default 8)")
    if launcher == "slurm":
        ap.add_argument("--sbatch-args", default="", help='more sbatch options, one string: "-p gpu -A proj"')
        ap.add_argument("--print-only", action="store_true", help="print the sbatch command; submit nothing")
        return ap
    ap.add_argument("--address", default="auto", help="the Ray head's HOST:PORT (default auto: RAY_ADDRESS, or "
                    "the cluster this machine belongs to)")  # fmt: skip
    ap.add_argument("--gpu-resource", default="GPU", help="the Ray resource one worker takes one of (default GPU)")
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts from the newest checkpoint after a "
                    "worker or node dies (default 3)")  # fmt: skip
    ap.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for busy resources (default 600)")
    ap.add_argument("--print-only", action="store_true", help="place the workers, print each one's world; run nothing")
    return ap


def launch(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config

    cfg = load_config(args.config, args.overrides)  # a config error is one line before anything starts
    if not getattr(args, "print_only", False):
        from megatron_dapo.launch.run_dir import check_run_dir

        check_run_dir(cfg, mover=True)  # another run's data in run_dir: refused (or moved aside) before anything
    if args.launcher == "local":
        from megatron_dapo.launch.local import run_local

        return run_local(args.config, args.overrides, cfg, args.nproc_per_node)
    if args.launcher == "slurm":
        from megatron_dapo.launch.slurm import run_slurm

        return run_slurm(
            args.config, args.overrides, cfg, args.nodes, args.gpus_per_node, args.sbatch_args, args.print_only
        )
    from megatron_dapo.launch.ray_cluster import Options, run_ray

    opts = Options(
        address=args.address,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_resource=args.gpu_resource,
        max_restarts=args.max_restarts,
        wait_s=args.wait_s,
        print_only=args.print_only,
    )
    return run_ray(args.config, args.overrides, cfg, opts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in LAUNCHERS:
        print(__doc__.strip() if argv[:1] in (["-h"], ["--help"]) else f"error: expected a launcher first, one of "
              f"{', '.join(LAUNCHERS)} (python -m megatron_dapo.launch --help)", file=sys.stderr)  # fmt: skip
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    launcher = argv[0]
    args = parser(launcher).parse_intermixed_args(argv[1:])
    args.launcher = launcher
    quiet_libraries(args.debug)
    return run_cli(lambda: launch(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
