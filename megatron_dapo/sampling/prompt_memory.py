"""Prompt memory: a record of every prompt's past groups, and the skip policy that reads it (sampler.skip).

A prompt's outcome is consistent from one visit to the next: one solved by every sample is likely to be
solved by every sample again, one never solved likely stays so, and neither group is trained (dynamic
sampling drops zero-variance groups after paying for them). The record predicts that before any token is
generated (GRESO, Zheng et al. 2025, arXiv 2506.02177, skips such prompts with probability 1 - e^z).

The record, numpy arrays indexed by prompt (about 40 bytes a prompt: millions fit):
- the last HISTORY visits in a ring: the step, #correct of G, the mean response length (tokens);
- visits; streak = +z after z all-correct groups in a row, -z after z all-wrong ones, 0 after an informative
  one (or none yet); skipped = deferrals in a row since it was last generated; draws = times it came up.

The policy, when a prompt comes up in the queue (SamplingScheduler._draw):
- streak 0 (no evidence): generate;
- skipped == max_consecutive: generate (the exploration floor: every prompt is generated at least once
  every max_consecutive + 1 times it comes up, i.e. epochs);
- else skip with probability 1 - e^|streak|, decided by a hash of (seed, prompt, draws): the same on every
  rank and after a resume, whatever else happened in the step. A skipped prompt is consumed from this epoch's
  pass of the queue and comes up again in the next epoch's.
The exploration probability e starts at 1 (no skipping) and moves by `adapt` after each step: down when the
informative fraction of the step's generated groups was below `target`, up when above, within [min_explore, 1].

Everything here is a function of the observed groups and the seed: no wall clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from megatron_dapo.config import SamplerConfig

HISTORY = 4
"""Visits kept per prompt (a ring): enough to read a trend, small enough for millions of prompts."""

_MASK = (1 << 64) - 1


def hash_uniform(seed: int, prompt: int, draw: int) -> float:
    """A uniform number in [0, 1) from (seed, prompt, draw) alone (splitmix64's finaliser on a mixed key)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt * 0xBF58476D1CE4E5B9 + draw * 0x94D049BB133111EB + 1) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def next_streak(z: int, num_correct: int, group_size: int) -> int:
    """The streak after a visit with num_correct of group_size right: +z all-correct in a row, -z all-wrong, 0 after an
    informative group."""
    if num_correct == group_size:
        return z + 1 if z > 0 else 1
    if num_correct == 0:
        return z - 1 if z < 0 else -1
    return 0


@dataclass(frozen=True)
class Decision:
    """What the policy said when a prompt came up."""

    skip: bool
    predicted: bool
    """The record predicted an uninformative group (streak != 0): a generated one is an exploration visit."""
    p_generate: float
    """The probability that the prompt was generated, given its record: weights the before-skipping estimate."""
    tokens: float
    """skip: the tokens its last visit generated (G x mean length), an estimate of what was saved."""


class PromptMemory:
    """The per-prompt record and the skip policy; see the module docstring.

    num_prompts: dataset size. group_size: G. sampler: the config's sampler section, whose skip fields are the
    policy (sampler.skip, skip_target, skip_adapt, skip_min_explore, skip_max_consecutive). seed: the loader's seed
    (skip decisions hash it).
    """

    def __init__(
        self, num_prompts: int, group_size: int, sampler: Optional[SamplerConfig] = None, seed: int = 42
    ) -> None:
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.sampler = sampler or SamplerConfig()
        self.seed = seed
        n = num_prompts
        self.step = np.full((n, HISTORY), -1, dtype=np.int32)
        self.correct = np.full((n, HISTORY), -1, dtype=np.int16)
        self.length = np.zeros((n, HISTORY), dtype=np.float32)
        self.visits = np.zeros(n, dtype=np.int32)
        self.streak = np.zeros(n, dtype=np.int16)
        self.skipped = np.zeros(n, dtype=np.int16)
        self.draws = np.zeros(n, dtype=np.int32)
        self.explore = 1.0

    ARRAYS = ("step", "correct", "length", "visits", "streak", "skipped", "draws")

    # ---------------------------------------------------------------- the record

    def record(self, prompt: int, step: int, num_correct: int, mean_length: float) -> None:
        """One finished group of `prompt` (a visit)."""
        slot = self.visits[prompt] % HISTORY
        self.step[prompt, slot] = step
        self.correct[prompt, slot] = num_correct
        self.length[prompt, slot] = mean_length
        self.visits[prompt] += 1
        z = next_streak(int(self.streak[prompt]), num_correct, self.group_size)
        self.streak[prompt] = max(-32767, min(32767, z))

    def last(self, prompt: int) -> tuple[int, int, float] | None:
        """(step, #correct, mean length) of the prompt's latest visit, or None if it has none."""
        if self.visits[prompt] == 0:
            return None
        slot = (self.visits[prompt] - 1) % HISTORY
        return int(self.step[prompt, slot]), int(self.correct[prompt, slot]), float(self.length[prompt, slot])

    # ---------------------------------------------------------------- the policy

    def decide(self, prompt: int) -> Decision:
        """The prompt came up in the queue: generate it now, or defer it to a later epoch."""
        self.draws[prompt] += 1
        z = abs(int(self.streak[prompt]))
        if not self.sampler.skip or z == 0:
            self.skipped[prompt] = 0
            return Decision(skip=False, predicted=False, p_generate=1.0, tokens=0.0)
        if self.skipped[prompt] >= self.sampler.skip_max_consecutive:  # the floor: this one is generated
            self.skipped[prompt] = 0
            return Decision(skip=False, predicted=True, p_generate=1.0, tokens=0.0)
        p_skip = 1.0 - self.explore**z
        if hash_uniform(self.seed, prompt, int(self.draws[prompt])) < p_skip:
            self.skipped[prompt] += 1
            _, _, mean_length = self.last(prompt)
            return Decision(skip=True, predicted=True, p_generate=1.0 - p_skip, tokens=self.group_size * mean_length)
        self.skipped[prompt] = 0
        return Decision(skip=False, predicted=True, p_generate=1.0 - p_skip, tokens=0.0)

    def adapt(self, informative_frac: float) -> None:
        """After a step that generated groups: move the exploration probability toward the target fraction."""
        if not self.sampler.skip:
            return
        step = self.sampler.skip_adapt if informative_frac > self.sampler.skip_target else -self.sampler.skip_adapt
        self.explore = min(1.0, max(self.sampler.skip_min_explore, self.explore + step))

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The record (numpy arrays: a checkpoint pickles them) and the exploration probability."""
        return {"explore": self.explore, **{name: getattr(self, name).copy() for name in self.ARRAYS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.ARRAYS:
            want = getattr(self, name)
            got = np.asarray(state.get(name))
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(
                    f"sampler state: prompt memory field '{name}' has shape {got.shape} and dtype {got.dtype}, "
                    f"expected {want.shape} {want.dtype} (a dataset of {self.num_prompts} prompts)"
                )
        for name in self.ARRAYS:
            setattr(self, name, np.array(state[name], copy=True))
        self.explore = float(state["explore"])

    def update_digest(self, h: Any) -> None:
        """Feed the record's bytes to a hashlib object (the scheduler's fingerprint)."""
        h.update(repr(self.explore).encode())
        for name in self.ARRAYS:
            h.update(np.ascontiguousarray(getattr(self, name)).tobytes())


def persistence(state: dict[str, Any], group_size: int, since_step: int = 0) -> dict[tuple[str, int], tuple[int, int]]:
    """How well a record predicts: for every recorded visit at step >= since_step that has an earlier visit in the
    ring, its prompt's streak before it -> (visits, uninformative ones). Keys: ("correct" | "wrong", z) for a streak
    of z >= 1 (3 stands for 3 or more: the ring holds 4 visits), ("none", 0) after an informative visit.

    state: PromptMemory.state_dict() (as a checkpoint holds it under the loader's scheduler state).
    """
    out: dict[tuple[str, int], list[int]] = {}
    for steps, correct in zip(state["step"], state["correct"]):
        visits = sorted((int(s), int(c)) for s, c in zip(steps, correct) if s >= 0)
        z = 0  # the streak over the ring's visits so far, as PromptMemory.record counts it
        for i, (step, c) in enumerate(visits):
            if i and step >= since_step:
                kind = "correct" if z > 0 else "wrong" if z < 0 else "none"
                counts = out.setdefault((kind, min(abs(z), 3)), [0, 0])
                counts[0] += 1
                counts[1] += c in (0, group_size)
            z = next_streak(z, c, group_size)
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}
