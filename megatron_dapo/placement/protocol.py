"""What the trainer needs of the rollout side, in either pipeline.mode, and the function that picks it.

`Rollout` is the trainer's whole view of generation: the next batch (collected by the dynamic-sampling loader), the
responses this rank trains, the weight sync, held-out evaluation, the loader state a checkpoint holds, and closing.
Its two implementations: ColocatedRollout (colocated.py: the engines in the train processes) and RemoteRollout
(remote.py: the train side's end of the asynchronous rollout processes, controller.py). make_rollout picks one by
pipeline.mode.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from megatron_dapo.config import Config
from megatron_dapo.model.comm import Comm
from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.loader import StepBatch
from megatron_dapo.types import Prompt, Response


class Rollout(Protocol):
    """The rollout side as the trainer uses it; every method is collective over the train world."""

    def start(self) -> None:
        """Begin serving: after load_state_dict (a resumed run), before the first sync."""

    def next_batch(self) -> StepBatch:
        """The next rollout step's groups (every rank the same list), with the responses this rank holds."""

    def responses(
        self, batch: StepBatch, wanted_by: Callable[[int], list[SampleId]]
    ) -> tuple[dict[SampleId, Response], float]:
        """(key, j) -> Response for at least every id wanted_by(this rank) (wanted_by(rank): the ids rank trains);
        and the bytes this rank sent for it."""

    def sync(self, bridge: Any, version: int, evaluate: bool = False) -> dict[str, float]:
        """Stream the bridge's weights (version: rollout steps they have trained) into the engines; evaluate: these
        weights are the ones held_out() evaluates next. Returns the sync's metrics."""

    def evaluate(
        self, prompts: list[Prompt], k: int, temperature: float, top_p: float, max_tokens: int
    ) -> dict[str, float]:
        """avg@k and pass@k on prompts with the engines' current weights (HeldOutEval)."""

    def held_out(self) -> dict[str, float]:
        """The eval section's evaluation on data.val_files of the weights last synced with evaluate=True."""

    def state_dict(self) -> Any:
        """The loader state after the last batch (what the trainer's checkpoint holds)."""

    def load_state_dict(self, state: Any) -> None: ...

    def close(self) -> None:
        """Stop the engines (or the rollout processes); safe to call once whatever start() reached."""


def make_rollout(cfg: Config, tokenizer: Any, dataset: Any, comm: Comm) -> Rollout:
    """pipeline.mode's Rollout for this train rank (comm: the train world's): colocated, or the end of the
    asynchronous rollout processes, which the launcher told this process where to meet (transport.py)."""
    if cfg.pipeline.mode == "async":
        from megatron_dapo.placement.remote import RemoteRollout
        from megatron_dapo.placement.transport import Transport, transport_backend

        return RemoteRollout(
            Transport.from_env(),
            comm.rank,
            cfg.pipeline.rollout_gpus,
            transport_backend(cfg),
            cfg.trainer.collective_timeout_s,
        )
    from megatron_dapo.placement.colocated import ColocatedRollout

    return ColocatedRollout(cfg, tokenizer, dataset, comm)
