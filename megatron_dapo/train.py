"""Entry point: python -m megatron_dapo.train --config FILE [dotted.overrides=...]  (torchrun for several ranks).

Runs trainer.total_steps rollout steps, printing one progress line per step and writing every
metric to run_dir/metrics.jsonl, TensorBoard and (when trainer.wandb_project is set) Weights &
Biases. Checkpoints every trainer.save_every steps and at the end. SIGTERM or SIGUSR1 (Slurm's
warning before a time limit or preemption) finish the current step, save a checkpoint and exit 0;
the next run resumes from it. Reaching total_steps writes run_dir/FINISHED (the step), so a
batch script can tell "stopped to be requeued" from "done".
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path
from typing import Any

from megatron_dapo.config import Config, load_config, to_yaml

log = logging.getLogger("megatron_dapo.train")


class MetricSinks:
    """metrics.jsonl, TensorBoard and W&B on rank 0; nothing elsewhere.

    resumed_step: the step a resumed run restarts after; metrics.jsonl lines of later steps (written
    by the interrupted run after its last checkpoint) are dropped, so every step appears once.
    """

    def __init__(self, cfg: Config, active: bool, resumed_step: int = 0) -> None:
        self.active = active
        self.run_dir = Path(cfg.trainer.run_dir)
        self.tb = self.wandb = None
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(resumed_step)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        if cfg.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if cfg.trainer.wandb_project:
            import wandb  # optional: only when configured

            self.wandb = wandb.init(project=cfg.trainer.wandb_project, dir=str(self.run_dir), config=_plain(cfg))

    def _truncate(self, resumed_step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [x for x in lines if x.strip() and json.loads(x)["step"] <= resumed_step]
        if len(kept) != len(lines):
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)  # atomic: a crash here leaves the old file or the new one, never half of one
            log.info(
                "metrics.jsonl: dropped %d lines of steps after the resumed step %d",
                len(lines) - len(kept),
                resumed_step,
            )

    def write(self, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        step = int(metrics["step"])
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(cfg: Config) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML config file (defaults: the paper's values)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.eps_high=0.28")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(args.config, args.overrides)

    stop = {"signal": None}

    def request_stop(signum, frame):  # finish the step in flight, then save and leave
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGUSR1, request_stop)

    import torch
    import torch.distributed as dist

    from megatron_dapo.trainer import Trainer, progress_line

    trainer = Trainer(cfg)
    rank0 = dist.get_rank() == 0
    sinks = MetricSinks(cfg, rank0, resumed_step=trainer.step)
    try:
        while trainer.step < cfg.trainer.total_steps:
            metrics = trainer.train_step()
            e = cfg.eval.every
            if e and (trainer.step % e == 0 or trainer.step == cfg.trainer.total_steps):
                metrics.update(trainer.evaluate_from_config())
            if rank0:
                print(progress_line(metrics), flush=True)
            sinks.write(metrics)
            every = cfg.trainer.save_every
            # stop together: a signal that reached only some ranks must not leave the others waiting
            flag = torch.tensor([1.0 if stop["signal"] else 0.0], device=trainer.layout.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                path = trainer.save()
                if rank0:
                    print(f"{stop['signal'] or 'stop'}: saved {path} at step {trainer.step}; exiting", flush=True)
                return
            if (every and trainer.step % every == 0) or trainer.step == cfg.trainer.total_steps:
                trainer.save()
        if rank0:  # tells a requeueing batch script the run is done
            (Path(cfg.trainer.run_dir) / "FINISHED").write_text(f"{trainer.step}\n")
    finally:
        sinks.close()
        trainer.close()


if __name__ == "__main__":
    main()
