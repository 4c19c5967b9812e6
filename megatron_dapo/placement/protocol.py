"""What the trainer needs of the rollout side, in either pipeline.mode, and the function that builds it.

`Rollout` is the trainer's whole view of generation: the next batch (collected by the dynamic-sampling loader), the
responses this rank trains (by the `TrainSplit`, split.py, that both sides know), the weight sync, evaluations (each asked for
with an EvalRequest and answered through its `Evaluation`), the loader state a checkpoint holds, and closing. A
Rollout is ready when built: make_rollout hands it the loader state to resume from and syncs the first weights, so
no method waits for another to have been called first. Its two implementations: ColocatedRollout (colocated.py:
the engines in the train processes) and RemoteRollout (remote.py: the train side's end of the asynchronous rollout
processes, controller.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional, Protocol

from megatron_dapo.config import Config
from megatron_dapo.model.comm import Comm
from megatron_dapo.placement.evaluation import Evaluation, Synced
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.rollout.engine import WeightSource
from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.loader import LoaderState, StepBatch
from megatron_dapo.types import EvalRequest, Prompt, Response

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Rollout(Protocol):
    """The rollout side as the trainer uses it, ready from construction (make_rollout); every method is collective
    over the train world."""

    def next_batch(self) -> StepBatch:
        """The next rollout step's groups (every rank the same list)."""
        ...

    def responses(self, batch: StepBatch) -> tuple[dict[SampleId, Response], float]:
        """(key, j) -> Response for at least every id this rank trains of batch (TrainSplit.wanted_by), and the bytes
        this rank sent for them."""
        ...

    def sync(self, weights: WeightSource, version: int, evaluate: Optional[EvalRequest] = None) -> Synced:
        """Stream weights into the engines (version: rollout steps they have trained); evaluate: an evaluation of
        these weights, which the rollout side runs before its engines generate with any other."""
        ...

    def evaluate(self, request: EvalRequest) -> Evaluation:
        """An evaluation of the weights last synced."""
        ...

    def state_dict(self) -> Optional[LoaderState]:
        """The loader state after the last batch (what this rank's checkpoint holds; None where it holds none)."""
        ...

    def close(self, *, exiting: bool = False) -> None:
        """Stop the engines (or the rollout processes); safe to call once, whatever state they are in. exiting: this
        process ends next, so an engine here skips freeing memory the exit frees (VLLMEngine.close)."""
        ...


RolloutFactory = Callable[
    [Config, "PreTrainedTokenizerBase", Sequence[Prompt], Comm, TrainSplit, WeightSource, int, Optional[LoaderState]],
    Rollout,
]
"""make_rollout's signature: what the trainer builds its Rollout with (a test passes a stand-in's)."""


def make_rollout(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Sequence[Prompt],
    comm: Comm,
    split: TrainSplit,
    weights: WeightSource,
    version: int,
    state: Optional[LoaderState],
) -> Rollout:
    """pipeline.mode's Rollout for this train rank (comm: the train world's), ready: resuming from the loader state
    `state` (None: a fresh run), its engines holding `weights` as version `version` (they start from dummy ones).
    Asynchronous: the end of the rollout processes, which the launcher told this process where to meet
    (transport.py). What started is closed if a later part fails."""
    if cfg.pipeline.mode == "async":
        from megatron_dapo.placement.remote import RemoteRollout
        from megatron_dapo.placement.transport import Transport, transport_backend

        rollout = RemoteRollout(
            Transport.from_env(),
            comm.rank,
            cfg.pipeline.rollout_gpus,
            transport_backend(cfg),
            cfg.trainer.collective_timeout_s,
            split,
        )
    else:
        from megatron_dapo.placement.colocated import colocated_rollout

        rollout = colocated_rollout(cfg, tokenizer, dataset, comm, split)
    try:
        rollout.start(state, weights, version)
    except BaseException:
        rollout.close()
        raise
    return rollout
