"""Entry point: python -m megatron_dapo.train --config FILE [dotted.overrides=...]  (torchrun for several ranks).

One process of a run: a colocated rank, or (pipeline.mode=async) the side DAPO_ROLE names, which the launchers set
(python -m megatron_dapo.launch local|slurm|ray start both sides).

Runs trainer.total_steps rollout steps, printing one progress line per step and writing every
metric to run_dir/metrics.jsonl, TensorBoard and (when trainer.wandb_project is set) Weights &
Biases. Checkpoints every trainer.save_every steps and at the end. Ctrl-C (SIGINT), SIGTERM or SIGUSR1 (Slurm's
warning before a time limit or preemption) finish the current step, save a checkpoint and exit 0;
the next run resumes from it; a signal during start-up, or a second one, exits at once (status 1). A
user's mistake (config, data, model, checkpoints, a run directory holding another run) is one `error:` line and
status 1 (--debug: the traceback). A stall (launch/watchdog.py) is one line naming the process that stopped, every
process's stacks under run_dir/logs, and status 75. Reaching total_steps writes run_dir/FINISHED (the step), so a
batch script can tell "stopped to be requeued" from "done".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo import progress
from megatron_dapo.cli import (  # light: torch must not load before the log settings
    argument_parser,
    quiet_libraries,
    run_cli,
)

if TYPE_CHECKING:
    from megatron_dapo.config import Config, TrainerConfig

log = logging.getLogger("megatron_dapo.train")
DROPPED_METRICS = "metrics.dropped.jsonl"
"""Where metrics.jsonl's lines of steps a resumed run takes again go (never deleted)."""


class MetricSinks:
    """metrics.jsonl, TensorBoard and W&B on rank 0; nothing elsewhere.

    trainer: the trainer section (run_dir, tensorboard, wandb_project). config_yaml: the run's whole config as YAML
    (config.to_yaml), written to run_dir/config.yaml and given to W&B. active: rank 0.
    resumed_step: the step a resumed run restarts after; metrics.jsonl lines of later steps (written
    by the interrupted run after its last checkpoint) are dropped, so every step appears once.
    """

    def __init__(self, trainer: TrainerConfig, config_yaml: str, active: bool, resumed_step: int = 0) -> None:
        self.active = active
        self.run_dir = Path(trainer.run_dir)
        self.tb = self.wandb = None
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(resumed_step)
        (self.run_dir / "config.yaml").write_text(config_yaml)
        if trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if trainer.wandb_project:
            import wandb  # optional: only when configured
            import yaml

            config = yaml.safe_load(config_yaml)
            self.wandb = wandb.init(project=trainer.wandb_project, dir=str(self.run_dir), config=config)

    def _truncate(self, resumed_step: int) -> None:
        """Lines of steps after resumed_step move to metrics.dropped.jsonl (appended: what the interrupted run
        logged of steps the resumed run takes again)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [x for x in lines if x.strip() and json.loads(x)["step"] <= resumed_step]
        if len(kept) != len(lines):
            dropped = [x for x in lines if x.strip() and json.loads(x)["step"] > resumed_step]
            with open(self.run_dir / DROPPED_METRICS, "a") as f:
                f.write("".join(x if x.endswith("\n") else x + "\n" for x in dropped))
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)  # atomic: a crash here leaves the old file or the new one, never half of one
            log.info(
                "metrics.jsonl: dropped %d lines of steps after the resumed step %d (kept in %s)",
                len(dropped),
                resumed_step,
                DROPPED_METRICS,
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


class StopSignals:
    """Ctrl-C (SIGINT), SIGTERM, SIGUSR1: during a step, finish it, save and exit 0; at start-up or a second time,
    leave now with one line.

    Leaving raises SystemExit in the main thread, so every `finally` closes the reward workers, the engine
    and the process groups; the reward pool also kills its workers at interpreter exit. The same SIGTERM or SIGUSR1
    again within DUPLICATE_S seconds is the same request delivered twice, not a second one: under Slurm, slurmstepd
    signals every process of the step and torchrun forwards the signal to its workers as well. A second Ctrl-C is a
    person's: it always counts.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    DUPLICATE_S = 5.0

    def __init__(self) -> None:
        self.name: str | None = None
        self.at = 0.0  # time.monotonic() of the first signal
        self.running = False
        self.phase = "start-up"
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if name == self.name and now - self.at < self.DUPLICATE_S and signum != signal.SIGINT:
            return
        again = self.name is not None
        if not again:
            self.name, self.at = name, now
        if not self.running or again:
            raise SystemExit(f"{name}: stopping now ({'again' if again else f'during {self.phase}'}), nothing saved")


def progress_line(m: dict[str, Any]) -> str:
    """The one line a person reads per rollout step."""
    if "reward/mean" in m:
        if m.get("sampler/gen_rounds"):  # fill / dynamic_bs
            generated = f"rounds {int(m['sampler/gen_rounds'])}"
        else:  # stream: groups generated, and the share of this step's tokens thrown away
            wasted = m["tokens/wasted"] / m["tokens/generated"] if m.get("tokens/generated") else 0.0
            generated = f"groups {int(m['sampler/groups_generated'])} wasted {wasted:.0%}"
        if "skip/skipped" in m:  # prompt memory: prompts deferred before generation
            generated += f" skipped {int(m['skip/skipped'])}"
        rollout = (
            f"reward {m['reward/mean']:+.3f} acc {m['reward/acc']:.3f} "
            f"informative {m['sampler/informative_frac']:.2f} {generated} | "
            f"len {m['response/length_mean']:.0f}/{m['response/length_max']:.0f}"
        )
    else:  # a step trained entirely on groups carried over from the last one
        rollout = f"no generation: {int(m['sampler/batch_groups'])} carried-over groups"
    if "rollout/corrected_frac" in m:  # a rollout correction on (FP8 rollouts, partial rollout): how far off they are
        rollout += f" | kl {m['rollout/kl']:.1e} corrected {m['rollout/corrected_frac']:.2%}"
    if m.get("staleness/max"):  # partial rollout: some trained tokens were sampled versions ago
        rollout += f" | stale max {int(m['staleness/max'])} p99 {int(m['staleness/p99'])}"
    if "actor/kl" in m:  # KL to the reference policy (algorithm.kl_coef > 0)
        rollout += f" | ref kl {m['actor/kl']:.2e}"
    if "moe/load_imbalance" in m:  # a mixture of experts: how busy the busiest expert is, and replay's agreement
        rollout += f" | moe imbalance {m['moe/load_imbalance']:.2f}"
        if "moe/router_agreement" in m:
            rollout += f" agree {m['moe/router_agreement']:.3f} kl {m['rollout/kl']:.1e}"
    evaluation = ""
    if "eval/avg_at_k" in m:
        k = int(m["eval/k"])
        evaluation = f" | eval avg@{k} {m['eval/avg_at_k']:.3f} pass@{k} {m['eval/pass_at_k']:.3f}"
    return (
        f"step {int(m['step'])} | {rollout} | "
        f"clip lo/hi {m.get('actor/clip_frac_low', 0):.3f}/{m.get('actor/clip_frac_high', 0):.3f} "
        f"entropy {m.get('actor/entropy', 0):.3f} | {m['perf/tokens_per_s']:.0f} tok/s | "
        f"gen {m['timing/generate']:.1f}s old {m['timing/old_logp']:.1f}s "
        + (f"ref {m['timing/ref_logp']:.1f}s " if "timing/ref_logp" in m else "")
        + f"train {m['timing/train']:.1f}s "
        f"sync {m['timing/sync']:.1f}s{evaluation}"
    )


def train(config: str | None, overrides: list[str]) -> int | None:
    from megatron_dapo.config import load_config
    from megatron_dapo.launch.run_dir import check_run_dir
    from megatron_dapo.launch.watchdog import start_watchdog
    from megatron_dapo.placement.transport import process_role

    cfg = load_config(config, overrides)
    role, rank = process_role(cfg), os.environ.get("RANK", "0")
    t = cfg.trainer
    if role == "rollout":  # DAPO_ROLE, set by the launchers (launch/): the asynchronous rollout side
        from megatron_dapo.placement.controller import run_rollout

        for sig in StopSignals.SIGNALS:  # stop signals are the train side's: it saves, then stops the controller
            signal.signal(sig, signal.SIG_IGN)
        watchdog = start_watchdog(t.run_dir, f"rollout {rank}", t.stall_timeout_s, t.collective_timeout_s)
        try:
            run_rollout(cfg)
        finally:
            watchdog.stop()
        return None
    check_run_dir(cfg, mover=rank == "0")  # before anything is written
    stop = StopSignals()
    lock = None
    if rank == "0":  # the writer of checkpoints and metrics: one per run directory
        from megatron_dapo.launch.writer_lock import WriterLock

        lock = WriterLock.acquire(cfg.trainer.run_dir, log=log.warning)
        log.info("starting: config %s, run directory %s", config or "(defaults)", t.run_dir)
    label = f"train {rank}" if role == "train" else f"rank {rank}"
    watchdog = None
    try:
        watchdog = start_watchdog(t.run_dir, label, t.stall_timeout_s, t.collective_timeout_s)
        return _train(cfg, stop)
    finally:
        if watchdog is not None:
            watchdog.stop()
        if lock is not None:
            lock.release()


def _train(cfg: Config, stop: StopSignals) -> None:
    from megatron_dapo.config import to_yaml
    from megatron_dapo.trainer import Trainer

    trainer = Trainer(cfg)  # closes what it started if it raises
    sinks = None
    try:
        rank0 = trainer.layout.rank == 0
        sinks = MetricSinks(cfg.trainer, to_yaml(cfg), rank0, resumed_step=trainer.step)
        stop.running = True
        t_start = time.perf_counter()
        while trainer.step < cfg.trainer.total_steps:
            metrics = trainer.train_step()
            if trainer.evaluation is not None:  # the step's sync asked for one (eval.every)
                with progress.phase("evaluate"):
                    metrics.update(trainer.evaluation.result())
            # wall time since this process's first step began, its evaluations included (time to an accuracy)
            metrics["timing/elapsed"] = time.perf_counter() - t_start
            if rank0:
                print(progress_line(metrics), flush=True)
            sinks.write(metrics)
            # stop together: a signal that reached only some ranks must not leave the others waiting
            if trainer.comm.max([1.0 if stop.name else 0.0], what="whether a stop signal came")[0] > 0:
                stop.running = False  # saving: a second signal leaves at once
                path = trainer.save()
                if rank0:
                    print(f"{stop.name or 'stop'}: saved {path} at step {trainer.step}; exiting", flush=True)
                return
            if trainer.save_due():
                trainer.save()
        if rank0:  # tells a requeueing batch script the run is done
            (Path(cfg.trainer.run_dir) / "FINISHED").write_text(f"{trainer.step}\n")
    finally:
        stop.running, stop.phase = False, "shut-down"
        if sinks is not None:
            sinks.close()
        trainer.close(exiting=True)  # main() returns next and the process ends


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--config", default=None, help="YAML config file (defaults: the paper's values)")
    ap.add_argument("--debug", action="store_true", help="tracebacks for user errors, and every library's log")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.eps_high=0.28")
    args = ap.parse_intermixed_args(argv)  # options before, between or after the overrides
    quiet_libraries(args.debug)
    from megatron_dapo.launch.lifeline import watch_launcher

    watch_launcher()  # a process started by a launcher stops when the launcher is gone
    return run_cli(lambda: train(args.config, args.overrides), args.debug)


if __name__ == "__main__":
    sys.exit(main())
