"""The rollout engine interface: what the trainer asks of whatever samples responses (vLLM, transformers).

Two ways to sample. generate() is one blocking call over a batch of prompts: held-out evaluation
(rollout/held_out.py) and the tools use it. Training rollouts stream (below). Around them, colocated on the
same devices as the policy, each rollout step ends with a weight sync:

    engine.sleep()                                                                       # free memory
    ... train the policy ...
    for bucket in bridge.buckets():                                                      # weight sync
        engine.update_weights(bucket, digest)                          # digest: the bytes' checksum as sent
    engine.finish_weight_update()
    engine.wake()

Weight sync is a stream: update_weights may be called once with every tensor or once per bucket, and
finish_weight_update() closes the stream (it raises if a tensor the model needs never arrived).

Streaming (what the dynamic-sampling loader uses for training rollouts): instead of one blocking
generate() per round, the loader submits prompt groups whenever it wants more, advances the engine
one step at a time, receives each group the moment its last sample finishes, and at the end of a
rollout step aborts what is still generating, getting back every sample's tokens so far:

    engine.submit([GroupRequest(key, prompt_ids, n=G, seed=s, version=v)], temperature, top_p, max_tokens)
    while ...:
        for key, responses in engine.step(): ...       # groups finished during this step
    partial = engine.abort(keys_still_running)         # {key: n Responses, unfinished ones finished=False}
    ... weight sync ...
    engine.submit([GroupRequest(key, prompt_ids, n=G, seed=s, version=v + 1, prefixes=partial[key])], ...)

A continued sample keeps its earlier tokens (and their logprobs and versions) and is sampled on from
there under the current weights; the engine re-reads its context (prefill) first.

Asynchronous DAPO does not stop the groups for a weight update: VLLMEngine.update_weights_in_flight(tensors,
version, recompute_kv) applies a complete set between two step() calls; the groups go on, their later tokens tagged
`version`, with their context re-read under the new weights (recompute_kv) or over the KV cache the old weights
computed (then a later token's logprob, the behaviour logprob, is that mixture's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from megatron_dapo.types import Response


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

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], digest: str | None = None) -> None:
        """Receive (part of) new policy weights: Hugging Face-named full (unsharded) tensors; digest: the sender's
        weight_transport.bucket_digest of them, checked before anything is loaded (None: unchecked)."""
        ...

    def finish_weight_update(self) -> None:
        """Close a weight-update stream: from here on the engine generates with the new weights."""
        ...


class WeightSink(Protocol):
    """What a weight sync streams into: a RolloutEngine, or the asynchronous train side's WeightSender
    (rollout/weight_transport.py), which sends the buckets on to the rollout processes' engines."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], digest: str | None = None) -> None: ...

    def finish_weight_update(self) -> None: ...


class WeightSource(Protocol):
    """Where a weight sync comes from: the policy's weights as Hugging Face tensors (rollout/weight_bridge.py)."""

    def sync(self, engine: WeightSink, version: int = 0) -> dict[str, float]:
        """Every bucket into engine.update_weights(bucket, digest), then engine.finish_weight_update(); version: the
        policy version these weights are (rollout steps trained). Returns the sync's metrics."""
        ...


@dataclass
class GroupRequest:
    """One prompt group to stream: n samples of one prompt."""

    key: int
    """The caller's id for the group: unique among the groups in flight on an engine; step() and abort() use it."""
    prompt_ids: list[int]
    """The prompt's token ids (chat template applied)."""
    n: int
    """Samples in the group."""
    seed: int
    """Sample j is seeded seed + j (as generate(..., seed) seeds sample j of its first prompt); a continued sample
    is seeded continuation_seed(seed + j, tokens it already has)."""
    version: int = 0
    """The policy version generating now: every token sampled for this request is tagged with it (Response.versions)."""
    prefixes: Optional[list[Response]] = None
    """Partial rollout: the n samples as abort() returned them. A finished one is kept as it is; an unfinished
    one is continued from its tokens, within the same max_tokens for the whole response."""


@runtime_checkable
class StreamingEngine(Protocol):
    """Generates prompt groups as a stream: submit any time, one engine step at a time, abort with tokens kept."""

    def submit(
        self,
        groups: list[GroupRequest],
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        """Queue the groups' samples; the engine starts them as it has room (continuous batching), in order.

        max_tokens bounds each whole response (a continued sample's earlier tokens count). Raises ValueError for a
        key already in flight or a bad argument (as generate does), RuntimeError when the engine cannot generate.
        """
        ...

    def step(self) -> list[tuple[int, list[Response]]]:
        """Run one engine step; return (key, the group's n Responses in sample order, text decoded) for each group
        whose last sample finished during it, in the order they finished. A no-op returning [] when idle."""
        ...

    def abort(self, keys: list[int]) -> dict[int, list[Response]]:
        """Stop these groups and forget them; return each one's n samples as they stand: a finished sample whole,
        the others with their tokens so far (possibly none) and finished=False. Raises KeyError for a key not in
        flight."""
        ...

    def in_flight(self) -> int:
        """Groups submitted and neither returned by step() nor aborted."""
        ...

    def unfinished(self) -> int:
        """Samples of the groups in flight that are still generating or queued: the engine's load. A function of
        what was submitted and the steps taken, never of time, so every rank can decide on it."""
        ...


CONTINUATION_SEED_STRIDE = 7_919
"""continuation_seed: a continued sample's seed moves by this per token it already has."""


def continuation_seed(sample_seed: int, tokens_so_far: int) -> int:
    """The seed of a sample continued after tokens_so_far tokens: a function of the sample's own seed and
    where it resumes, so a resumed run continues it exactly as the uninterrupted one did."""
    return (sample_seed + CONTINUATION_SEED_STRIDE * tokens_so_far) % 2**31


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
