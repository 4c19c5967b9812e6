"""A scripted StreamingEngine for the sampler's tests: every response's length and answer are set by the test.

Prompt p's sample j, seeded s, is `script(p, j, s) -> (length, correct)`: a script that uses the seed
gives a re-submitted prompt new responses, as a real engine does (seeds follow the submission number). The engine runs like vLLM's continuous
batching reduced to its timing: at most `capacity` samples run at once, started in submission order,
and each step gives every running sample one token, so a sample of length L finishes L steps after it
starts: completion time grows with response length, which is what the length-bias tests need. Texts
are real "Answer: N" responses, scored by the real reward pool.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_dapo.config import Config, SamplerConfig
from megatron_dapo.placement.colocated import loader_options
from megatron_dapo.rollout.engine import GroupRequest
from megatron_dapo.sampling.loader import DynamicSamplingLoader
from megatron_dapo.types import Prompt, Response

Script = Callable[[int, int, int], tuple[int, bool]]
"""(prompt index, sample index, sample seed) -> (response length in tokens, correct?)."""


def make_dataset(n: int, data_source: str = "synthetic_dapo") -> list[Prompt]:
    """Prompt i asks for i * 7; its token ids end with i, so the engine knows which prompt it got."""
    return [
        Prompt(
            index=i,
            messages=[{"role": "user", "content": f"What is {i} * 7?"}],
            text=f"What is {i} * 7?",
            token_ids=[1, 2, 3, i],
            ground_truth=str(i * 7),
            data_source=data_source,
        )
        for i in range(n)
    ]


LOADER_SECTIONS = ("algorithm", "sampler", "rollout", "data")
"""The config sections the loader reads, in the order a field name is looked up (rollout before eval)."""


def loader_config(sampler: Optional[SamplerConfig] = None, **fields) -> Config:
    """The Config a loader test runs: `sampler` as its sampler section (default: the shipped one), then each named
    field set in the first of LOADER_SECTIONS that has it (`seed` at the top level). A name no section has fails."""
    cfg = Config()
    if sampler is not None:
        cfg.sampler = dataclasses.replace(sampler)
    for name, value in fields.items():
        if name == "seed":
            cfg.seed = value
            continue
        section = next(s for s in LOADER_SECTIONS if name in {f.name for f in dataclasses.fields(getattr(cfg, s))})
        setattr(getattr(cfg, section), name, value)
    return cfg


def make_loader(cfg: Config, dataset: list[Prompt], engines: dict, scorer: Any, **kw: Any) -> DynamicSamplingLoader:
    """A DynamicSamplingLoader over cfg's settings (placement/colocated.py loader_options, as build_rollout_parts
    makes one); kw: its other keyword arguments (num_engines, owned, comm, ...)."""
    return DynamicSamplingLoader(dataset, engines, scorer, **loader_options(cfg), **kw)


def answer_text(prompt: int, correct: bool) -> str:
    return f"Some steps.\nAnswer: {prompt * 7 if correct else prompt * 7 + 1}"


@dataclass
class _Sample:
    key: int
    j: int
    length: int
    correct: bool
    prompt: int
    version: int
    """The policy version now generating it."""
    tokens: int = 0
    versions: list[int] = field(default_factory=list)
    done: bool = False


class ScriptedEngine:
    """StreamingEngine (see megatron_dapo.rollout.engine) driven by a script; capacity = running samples at most."""

    def __init__(self, script: Script, capacity: int = 1 << 30) -> None:
        self.script = script
        self.capacity = capacity
        self.groups: dict[int, list[_Sample]] = {}
        self.waiting: deque[_Sample] = deque()
        self.running: list[_Sample] = []
        self.steps = 0
        self.stats = {"stream_steps": 0.0, "stream_busy_steps": 0.0, "generated_tokens": 0.0, "seconds": 0.0}
        self.submitted: list[tuple[int, int]] = []  # (key, prompt index) of every fresh group, in submission order
        self.max_tokens = 0

    def submit(self, groups: list[GroupRequest], temperature, top_p, max_tokens, stop_token_ids=None) -> None:
        self.max_tokens = max_tokens
        for g in groups:
            if g.key in self.groups:
                raise ValueError(f"group {g.key} is already in flight")
            prompt = g.prompt_ids[-1]
            samples = []
            for j in range(g.n):
                length, correct = self.script(prompt, j, g.seed + j)  # a continued sample keeps its plan
                s = _Sample(g.key, j, min(length, max_tokens), correct, prompt, g.version)
                if g.prefixes is not None:
                    prefix = g.prefixes[j]
                    s.tokens, s.versions, s.done = len(prefix.token_ids), list(prefix.versions or []), prefix.finished
                samples.append(s)
                if not s.done:
                    self.waiting.append(s)
            self.groups[g.key] = samples
            if g.prefixes is None:
                self.submitted.append((g.key, prompt))

    def step(self) -> list[tuple[int, list[Response]]]:
        t0 = time.perf_counter()
        self.steps += 1
        self.stats["stream_steps"] += 1
        while self.waiting and len(self.running) < self.capacity:
            self.running.append(self.waiting.popleft())
        if self.running:  # a step that ran something: busy time, as the vLLM engine counts it
            self.stats["stream_busy_steps"] += 1
            out = self._advance()
            self.stats["seconds"] += time.perf_counter() - t0
            return out
        return self._advance()

    def _advance(self) -> list[tuple[int, list[Response]]]:
        for s in self.running:
            s.tokens += 1
            s.versions.append(s.version)
            self.stats["generated_tokens"] += 1
            if s.tokens >= s.length:
                s.done = True
        self.running = [s for s in self.running if not s.done]
        out = []
        for key in [k for k, samples in self.groups.items() if all(s.done for s in samples)]:
            out.append((key, [self._response(s) for s in self.groups.pop(key)]))
        return out

    def abort(self, keys: list[int]) -> dict[int, list[Response]]:
        out = {}
        for key in keys:
            samples = self.groups.pop(key)  # KeyError for an unknown key, as the protocol says
            out[key] = [self._response(s) for s in samples]
        gone = set(keys)
        self.running = [s for s in self.running if s.key not in gone]
        self.waiting = deque(s for s in self.waiting if s.key not in gone)
        return out

    def in_flight(self) -> int:
        return len(self.groups)

    def unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def _response(self, s: _Sample) -> Response:
        return Response(
            token_ids=[7] * s.tokens,
            text=answer_text(s.prompt, s.correct) if s.done else "",
            logprobs=[-0.5] * s.tokens,
            truncated=s.done and s.tokens >= self.max_tokens,
            versions=list(s.versions),
            finished=s.done,
        )
