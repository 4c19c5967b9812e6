"""Evaluation on the rollout engines, in either pipeline.mode: asked for with a request, answered through a handle.

The trainer asks a Rollout for an evaluation of the weights it syncs (Rollout.sync(..., evaluate=request): the
periodic eval.every one) or of the weights it last synced (Rollout.evaluate(request): chosen prompts, the demo's),
and gets an `Evaluation` for one weight version. The Rollout settles every evaluation it was asked for before its
engines generate anything else (the next batch, the next weights), so result() is right whenever it is called, once
or never. The side that holds the engines runs each request with an `Evaluator` (rollout/held_out.py's loop over the
request's prompts, or the validation set, loaded once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from megatron_dapo.config import Config
from megatron_dapo.rollout.held_out import HeldOutEval
from megatron_dapo.types import EvalRequest, Prompt


def held_out_request(cfg: Config) -> EvalRequest:
    """The eval section's evaluation of the validation set (data.val_files)."""
    e = cfg.eval
    return EvalRequest(k=e.k, temperature=e.temperature, top_p=e.top_p, max_tokens=cfg.eval_response_length())


class Evaluation:
    """An evaluation of weights `version` by `request`, asked of a Rollout; settle(self) makes the Rollout settle
    every evaluation it was asked for up to this one (each one's resolve())."""

    def __init__(self, version: int, request: EvalRequest, settle: Callable[[Evaluation], None]) -> None:
        self.version, self.request = version, request
        self._settle = settle
        self._metrics: Optional[dict[str, float]] = None

    @property
    def done(self) -> bool:
        return self._metrics is not None

    def resolve(self, metrics: dict[str, float]) -> None:
        """The Rollout's: the evaluation's metrics, once."""
        if self._metrics is not None:
            raise RuntimeError(f"the evaluation of weights {self.version} was resolved twice")
        self._metrics = metrics

    def result(self) -> dict[str, float]:
        """eval/avg_at_k, eval/pass_at_k, eval/k, eval/problems (HeldOutEval.evaluate); waits for the rollout side.
        Collective over the train world, as every Rollout method."""
        if self._metrics is None:
            self._settle(self)
        if self._metrics is None:
            raise RuntimeError(f"the rollout side did not settle the evaluation of weights {self.version}")
        return self._metrics


@dataclass
class Synced:
    """What Rollout.sync returns: the sync's metrics, and the evaluation it was asked for (None: none)."""

    metrics: dict[str, float]
    evaluation: Optional[Evaluation] = None


class Evaluator:
    """Runs EvalRequests on this world's engines (HeldOutEval, collective over the world); val_prompts() loads the
    validation set, once, when a request first asks for it."""

    def __init__(self, held_out: HeldOutEval, val_prompts: Callable[[], list[Prompt]]) -> None:
        self.held_out, self._load_val = held_out, val_prompts
        self._val: Optional[list[Prompt]] = None

    def run(self, request: EvalRequest) -> dict[str, float]:
        prompts = request.prompts
        if prompts is None:
            if self._val is None:
                self._val = self._load_val()
            prompts = self._val
        return self.held_out.evaluate(prompts, request.k, request.temperature, request.top_p, request.max_tokens)
