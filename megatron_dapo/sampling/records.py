"""The records the sampling scheduler exchanges with the loader, the rank exchange and the simulator."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass
class GroupMeta:
    """What every rank knows of a finished, scored group. Its tokens stay on the rank of the engine that made it."""

    key: int
    """Submission number: groups are numbered in the order they were first submitted, over the whole run."""
    index: int
    """The prompt's position in the dataset."""
    engine: int
    """The engine that generated it (its tokens live there)."""
    version: int
    """The policy version that sampled its first token."""
    lengths: list[int]
    """Response lengths in tokens, one per sample."""
    acc: list[bool]
    """Raw correctness per sample (the verifier's), what the informative test judges."""
    scores: list[float]
    """Verifier scores per sample."""
    rewards: list[float]
    """Shaped rewards (score + soft overlong punishment) per sample: advantages come from these."""
    truncated: list[bool]
    """Per sample: stopped at rollout.max_response_length."""
    informative: bool
    """Kept for training: 0 < #correct < G (or the user's sampler.filter, or always without dynamic sampling)."""
    version_tokens: list[int]
    """Tokens of the group sampled under version + i, i = 0, 1, ... (several only when paused and continued)."""
    reward_timeouts: int = 0
    reward_errors: int = 0
    finished_in: Optional[int] = None
    """The rollout step (batches handed out before it) in which it finished; None: its last token's version, which
    is that step wherever the engines are synced before every step (colocated)."""
    fresh_tokens: Optional[int] = None
    """Tokens generated in that step (the rest were generated in earlier steps and continued); None: those of its
    last token's version. Asynchronous DAPO sets both: there a step's tokens come from the weights of several
    versions, and one version's from several steps."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_correct(self) -> int:
        return sum(self.acc)

    def tokens_of_step(self, v: int) -> int:
        """Tokens generated in rollout step v (what a step's token accounting counts): 0 unless it finished in v."""
        last = self.version + len(self.version_tokens) - 1
        if v != (last if self.finished_in is None else self.finished_in):
            return 0
        return self.version_tokens[-1] if self.fresh_tokens is None else self.fresh_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GroupMeta:
        return GroupMeta(**d)


@dataclass
class Submission:
    """A group for an engine to generate: a new one, or a paused one to continue from its tokens so far."""

    key: int
    index: int
    engine: int
    seed: int
    """Sample j is seeded seed + j: a function of the submission number only, so samples never depend on
    how many engines there are or when the group went out."""
    resume: bool = False


@dataclass
class Paused:
    """A partial-rollout group stopped at a weight sync, to continue on its engine (which holds its tokens)."""

    key: int
    index: int
    engine: int
    seed: int
    version: int
    """The policy version of its oldest token."""
    tokens: int
    """Tokens generated so far."""
    predicted: bool = False
    """Its prompt's record predicted an uninformative group (see Flight)."""
    p_generate: float = 1.0


@dataclass
class Stopped:
    """What an engine had of a group it stopped at the end of a step (gathered from the engines' ranks)."""

    tokens: int
    """Tokens generated so far, all samples together."""
    tokens_now: int
    """Of those, the ones generated in this step."""
    first_version: Optional[int]
    """The version of its oldest token; None when it had none (never started: nothing is lost)."""


@dataclass
class StepResult:
    """One step's outcome: the groups to train on, what to keep for later, and the step's statistics."""

    batch: list[GroupMeta]
    keep: set[int]
    """Keys whose tokens the engines' ranks must keep: the batch, the carry and the paused groups."""
    stats: dict[str, float]
    shortfall: Optional[str] = None
    """Why the batch is short, with on_shortfall=train (None when it is full)."""


@dataclass
class Flight:
    """A group the scheduler sent out (or resumed) whose finish it has not observed yet."""

    key: int
    index: int
    engine: int
    seed: int
    resumed: bool
    predicted: bool = False
    """Its prompt's record predicted an uninformative group when it came up (prompt memory): an exploration visit."""
    p_generate: float = 1.0
    """The probability that the skip policy let it through (weights the before-skipping informative fraction)."""
