"""A finished group's summary (GroupMeta): shaped rewards, the informative test or sampler.filter, token versions."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_dapo.algorithm.filters import informative_groups
from megatron_dapo.algorithm.overlong import excess_overlong_penalty, soft_overlong_punishment
from megatron_dapo.config import AlgorithmConfig, ConfigError
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.types import Group, Response

GroupFilter = Callable[[Group], bool]
"""A user's replacement for the informative test: True keeps the group for training."""


def load_group_filter(spec: str) -> GroupFilter:
    """'package.module:function' -> the function; ConfigError naming sampler.filter when it cannot be used."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"config field sampler.filter={spec!r}: expected 'package.module:function'")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix: say which
        raise ConfigError(f"config field sampler.filter={spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"config field sampler.filter={spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def token_versions(responses: list[Response], current: int) -> list[int]:
    """The policy version of every token of `responses`, in order; a response without versions is all `current`'s."""
    return [v for r in responses for v in (r.versions or [current] * len(r.token_ids))]


@dataclass(frozen=True)
class GroupShaping:
    """How a finished group's scores become its rewards and its informative flag: the config's algorithm section
    (overlong punishment, dynamic sampling), rollout.max_response_length, the excess shape's soft maximum and
    sampler.filter (imported)."""

    algorithm: AlgorithmConfig
    max_response_length: int
    soft_max: int
    """Where overlong_shape=excess starts punishing: Config.overlong_soft_max()."""
    filter_fn: Optional[GroupFilter] = None

    def summarise(self, key: int, group: Group, engine: int, scored: Any, version: int) -> GroupMeta:
        """Fill group.scores/acc/rewards from `scored` (.scores, .acc, .status: one per response) and summarise it.

        key: the group's submission number; engine: the engine that made it; version: the policy version now.
        """
        responses = group.responses
        lengths = [len(r.token_ids) for r in responses]
        scores = [float(x) for x in scored.scores]
        rewards = torch.tensor(scores, dtype=torch.float64)
        a = self.algorithm
        if a.overlong_punishment and a.overlong_shape == "excess":
            rewards += excess_overlong_penalty(torch.tensor(lengths), self.soft_max, a.overlong_penalty_factor).double()
        elif a.overlong_punishment:
            rewards += soft_overlong_punishment(
                torch.tensor(lengths), self.max_response_length, a.overlong_buffer_len, a.overlong_penalty_factor
            ).double()
        group.scores, group.acc, group.rewards = scores, [bool(a) for a in scored.acc], rewards.tolist()
        if self.filter_fn is not None:
            informative = bool(self.filter_fn(group))
        elif a.dynamic_sampling:
            informative = bool(informative_groups(torch.tensor([group.acc]))[0])
        else:
            informative = True
        versions = token_versions(responses, version)
        first = min(versions, default=version)
        counts = [0] * (max(versions, default=first) - first + 1)
        for v in versions:
            counts[v - first] += 1
        status = list(scored.status)
        return GroupMeta(
            key=key,
            index=group.prompt.index,
            engine=engine,
            version=first,
            lengths=lengths,
            acc=group.acc,
            scores=scores,
            rewards=group.rewards,
            truncated=[bool(r.truncated) for r in responses],
            informative=informative,
            version_tokens=counts,
            reward_timeouts=status.count("timeout"),
            reward_errors=status.count("error"),
        )
