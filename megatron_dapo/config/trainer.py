"""The trainer section: the outer loop (steps, checkpoints, logs, deadlines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.config.base import check


@dataclass
class TrainerConfig:
    """The outer loop: steps, checkpoints, logs."""

    run_dir: str = "runs/dapo"
    """Checkpoints (run_dir/checkpoints), TensorBoard events and the metrics log go here."""
    total_steps: int = 100
    """Rollout steps to run (each: one dynamic-sampling batch, then its optimizer steps)."""
    save_every: int = 10
    """Checkpoint every this many rollout steps (and at the end); 0 = only at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Continue from the newest usable checkpoint in run_dir when there is one."""
    max_nan_in_a_row: int = 3
    """A rollout step whose loss is not finite skips its updates and is counted; this many in a
    row stop the run with an error."""
    tensorboard: bool = True
    """Write every metric to TensorBoard under run_dir/tensorboard."""
    wandb_project: Optional[str] = None
    """Also log to this Weights & Biases project (needs the wandb package); null = off."""
    progress_bar: bool = True
    """Show a progress bar over each generation call on rank 0 (only on a terminal)."""
    overwrite: bool = False
    """With resume=false, a run_dir that holds another run's checkpoints or metrics is refused before anything is
    written; true moves that run aside (to run_dir's name plus `.replaced-` and the time) and starts a new one."""
    collective_timeout_s: float = 3600.0
    """Every process group the run creates (the world, Megatron's groups, vLLM's, the weight transport and the
    asynchronous sides' channel) and every wait between processes gives up after this many seconds. It must exceed
    the longest legitimate wait between ranks: the asynchronous train side waits for a whole batch, and a
    colocated rank for its peers' generation round; for the 32B example (512 x 16 responses of up to 20k tokens) a
    step's generation was estimated at up to ~25 minutes, hence an hour. The stall detector (stall_timeout_s) fires
    first and names the rank that stopped."""
    stall_timeout_s: float = 900.0
    """A stall: no process of the run has reached a progress point (an engine step, a micro-batch, a weight bucket,
    a checkpoint stage) for this many seconds. Each process's watchdog then names the process that stopped (its
    phase, rank, host), writes every thread's stack under run_dir/logs and exits with status 75; the launchers wake
    and dump a process that cannot run, and Slurm requeues (stall_requeues). Start-up (model load, engine start) is
    bounded by collective_timeout_s instead. 15 minutes: the longest stretch without a progress point in the 32B
    example is one checkpoint write of a rank's ~4 GB share or a vLLM engine step of a 512-sequence batch (seconds);
    a generation of 20k tokens passes a progress point every engine step. Must be below collective_timeout_s, so
    that on NCCL (whose timeout aborts the process without a stack) the detector always speaks first."""
    stall_requeues: int = 2
    """On Slurm, a job whose run stalled is requeued from its newest checkpoint this many times (any other failure
    ends the job). Ray restarts a stalled run as it restarts any failure (launch ray --max-restarts)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.total_steps >= 1, "trainer.total_steps", self.total_steps, "an integer >= 1")
        check(self.save_every >= 0, "trainer.save_every", self.save_every, "an integer >= 0 (0 = only at the end)")
        check(self.keep_last >= 1, "trainer.keep_last", self.keep_last, "an integer >= 1")
        check(self.max_nan_in_a_row >= 1, "trainer.max_nan_in_a_row", self.max_nan_in_a_row, "an integer >= 1")
        check(self.collective_timeout_s > 0, "trainer.collective_timeout_s", self.collective_timeout_s, "seconds > 0")
        check(
            0 < self.stall_timeout_s < self.collective_timeout_s,
            "trainer.stall_timeout_s",
            self.stall_timeout_s,
            f"seconds > 0 and below trainer.collective_timeout_s={self.collective_timeout_s!r} (the stall detector "
            "must speak before a collective times out)",
        )
        check(self.stall_requeues >= 0, "trainer.stall_requeues", self.stall_requeues, "an integer >= 0")
