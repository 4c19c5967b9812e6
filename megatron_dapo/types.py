"""The records that flow from the dataset through rollout and reward to the trainer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Prompt:
    """One de-duplicated dataset row, rendered with the tokenizer's chat template."""

    index: int
    """Position in the PromptDataset (0..len-1): the loader's unit of bookkeeping."""
    messages: list[dict[str, str]]
    """Chat messages [{"role": ..., "content": ...}] as in the dataset."""
    text: str
    """The chat-templated prompt (with the generation prompt appended)."""
    token_ids: list[int]
    """text tokenized: what the rollout engine is given."""
    ground_truth: str
    """The reference answer the verifier compares against."""
    data_source: str
    """Where the row came from (e.g. 'math_dapo', 'openai/gsm8k'); picks the verifier."""


@dataclass
class Response:
    """One sampled response to a prompt."""

    token_ids: list[int]
    """Response tokens (the prompt excluded)."""
    text: str
    """Decoded response: what the verifier reads."""
    logprobs: Optional[list[float]] = None
    """The rollout engine's per-token logprobs, len == len(token_ids), if it reports them."""
    truncated: bool = False
    """True when generation stopped at rollout.max_response_length instead of a stop token."""
    versions: Optional[list[int]] = None
    """The policy version (weight syncs so far) that sampled each token, len == len(token_ids); None when not
    tracked. A response paused at a weight sync and continued after it holds tokens of two versions."""
    finished: bool = True
    """False for a sample stopped mid-generation (StreamingEngine.abort): token_ids are its tokens so far."""
    routes: Optional[Any] = None
    """Mixture-of-experts models with model.router_replay=r3: the experts the engine routed each position to, a
    torch tensor [len(prompt) + len(token_ids) - 1, moe layers, top k] of small integers (model/routing.py); None
    when not captured."""


@dataclass
class Group:
    """A prompt and its G responses, scored. Lists are indexed by response."""

    prompt: Prompt
    responses: list[Response]
    scores: list[float]
    """Raw verifier scores: +1 correct, -1 otherwise."""
    acc: list[bool]
    """Raw correctness, kept apart from the shaped reward: dynamic sampling judges on this."""
    rewards: list[float]
    """Shaped rewards: score + soft overlong punishment. Advantages come from these."""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_correct(self) -> int:
        return sum(self.acc)

    def to_dict(self) -> dict[str, Any]:
        """Plain containers only, for checkpoints."""
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Group:
        return Group(
            prompt=Prompt(**d["prompt"]),
            responses=[Response(**r) for r in d["responses"]],
            scores=list(d["scores"]),
            acc=list(d["acc"]),
            rewards=list(d["rewards"]),
            meta=dict(d.get("meta", {})),
        )


@dataclass(frozen=True)
class EvalRequest:
    """An evaluation to run on the rollout engines: avg@k and pass@k of k samples per prompt at temperature and top_p,
    responses up to max_tokens."""

    k: int
    temperature: float
    top_p: float
    max_tokens: int
    prompts: Optional[list[Prompt]] = None
    """The problems; None: the validation set (data.val_files), which the side that evaluates loads once."""
