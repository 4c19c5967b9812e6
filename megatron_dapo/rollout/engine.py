"""The rollout engine interface: what the trainer asks of whatever samples responses (vLLM, transformers).

The trainer's cycle per rollout step, colocated on the same devices as the policy:

    groups = engine.generate(prompt_ids, n=G, temperature=T, top_p=p, max_tokens=L_max)   # sample
    engine.sleep()                                                                       # free memory
    ... train the policy ...
    for bucket in bridge.buckets():                                                      # weight sync
        engine.update_weights(bucket)
    engine.finish_weight_update()
    engine.wake()

Weight sync is a stream: update_weights may be called once with every tensor or once per bucket, and
finish_weight_update() closes the stream (it raises if a tensor the model needs never arrived).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from megatron_dapo.data.types import Response


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses from token-id prompts and takes new policy weights between rollout steps."""

    stats: dict[str, float]
    """Cumulative counters: requests, retries, failures, generated_tokens, seconds, tokens_per_s (and engine extras)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[list[Response]]:
        """Sample n responses per prompt.

        prompts: P prompts, each a list of token ids (chat template already applied).
        n: samples per prompt. temperature: 0 means greedy. top_p: nucleus mass in (0, 1].
        max_tokens: the response length limit (rollout.max_response_length).
        stop_token_ids: extra ids that end a response, besides the tokenizer's EOS.
        seed: makes sampling reproducible when given (per-prompt seeds derive from it).
        Returns P lists of n Responses, in prompt order. Each Response has the response token ids (the stop/EOS
        token included when one ended it), the decoded text, the per-token logprobs of the sampled tokens under
        the distribution they were sampled from, and truncated=True exactly when max_tokens (or the engine's
        context length) ended it. Never drops a sample: a failure raises.
        """
        ...

    def sleep(self) -> None:
        """Free the engine's device memory (KV cache, weights) while the trainer trains."""
        ...

    def wake(self) -> None:
        """Restore what sleep() freed; the engine can generate again."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive (part of) new policy weights: Hugging Face-named full (unsharded) tensors."""
        ...

    def finish_weight_update(self) -> None:
        """Close a weight-update stream: from here on the engine generates with the new weights."""
        ...


def validate_generate_args(
    prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float, max_tokens: int
) -> None:
    """Raise ValueError naming the bad argument; shared by every engine so they reject the same inputs."""
    if n < 1:
        raise ValueError(f"n={n}: expected at least 1 sample per prompt")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: expected 0 < top_p <= 1")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: expected at least 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: expected at least one token id")


def new_stats() -> dict[str, float]:
    """The counters every engine keeps in .stats, all zero."""
    return {
        "requests": 0.0,  # sequences asked for: prompts x n
        "retries": 0.0,  # sequences asked for again after a failed or missing output
        "failures": 0.0,  # sequences still failed after the retry (each such call raised)
        "generated_tokens": 0.0,
        "seconds": 0.0,  # wall time inside generate()
        "tokens_per_s": 0.0,
    }
