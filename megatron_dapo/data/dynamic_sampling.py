"""The streaming dynamic-sampling loader (DAPO section 3.2).

Each rollout step it draws prompts in generation rounds of `gen_batch_size` prompts x
`group_size` responses through an injected rollout function, scores them, and keeps the
informative groups (0 < #correct < G, judged on raw correctness) until
`train_batch_size` groups are collected. Surplus informative groups are carried over to
the next step, not thrown away. `max_gen_batches` rounds without filling the batch end in
an error that says what was found. `dynamic_bs` mode (AReaL) instead trains on whatever
one round of `train_batch_size` prompts accepted.

Prompt order: a queue of dataset indices, refilled with a fresh permutation (seeded by
seed and epoch) whenever it runs dry. A prompt already in the current step (drawn this
step or carried over) is passed over and stays queued for a later step, so no prompt
appears twice in a step and none is skipped or repeated across steps. The queue, the
epoch counter and the carried-over groups are the loader's state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from megatron_dapo.algorithm import informative_groups, soft_overlong_punishment
from megatron_dapo.config import SAMPLER_MODES, Config
from megatron_dapo.data.types import Group, Prompt, Response

log = logging.getLogger("megatron_dapo.data")

RolloutFn = Callable[[list[Prompt], int], list[list[Response]]]
"""(prompts, n) -> for each prompt, its n responses."""
GroupFilter = Callable[[Group], bool]
"""A user's replacement for the informative test: True keeps the group for training."""


class Scorer(Protocol):
    """What the loader needs of a reward scorer (megatron_dapo.reward.RewardPool is one)."""

    def score(self, responses: list[str], ground_truths: list[str], data_sources: list[str]) -> Any:
        """Returns an object with .scores: list[float], .acc: list[bool], .metrics: dict[str, float]."""


class DynamicSamplingError(RuntimeError):
    """The loader cannot fill a batch: too few informative groups within the cap, or too few prompts."""


@dataclass
class StepBatch:
    """One rollout step's training groups and what it took to collect them."""

    groups: list[Group]
    stats: dict[str, float]


class DynamicSamplingLoader:
    def __init__(
        self,
        dataset: Sequence[Prompt],
        rollout_fn: RolloutFn,
        scorer: Scorer,
        *,
        group_size: int = 16,
        train_batch_size: int = 512,
        gen_batch_size: int = 1536,
        max_gen_batches: int = 10,
        mode: str = "fill",
        dynamic_sampling: bool = True,
        max_response_length: int = 20480,
        overlong_punishment: bool = True,
        overlong_buffer_len: int = 4096,
        overlong_penalty_factor: float = 1.0,
        shuffle: bool = True,
        seed: int = 42,
        filter_fn: Optional[GroupFilter] = None,
    ) -> None:
        if mode not in SAMPLER_MODES:
            raise ValueError(f"sampler.mode={mode!r}: expected one of {SAMPLER_MODES}")
        if group_size < 2:
            raise ValueError(f"algorithm.group_size={group_size}: expected an integer >= 2")
        if len(dataset) == 0:
            raise ValueError("DynamicSamplingLoader: the dataset is empty")
        self.dataset = dataset
        self.rollout_fn = rollout_fn
        self.scorer = scorer
        self.group_size = group_size
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.max_gen_batches = max_gen_batches
        self.mode = mode
        self.dynamic_sampling = dynamic_sampling
        self.max_response_length = max_response_length
        self.overlong_punishment = overlong_punishment
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.shuffle = shuffle
        self.seed = seed
        self.filter_fn = filter_fn
        self.epoch = 0  # permutations appended to the queue so far
        self.steps = 0  # batches returned so far
        self.queue: list[int] = []
        self.carry: list[Group] = []

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        dataset: Sequence[Prompt],
        rollout_fn: RolloutFn,
        scorer: Scorer,
        filter_fn: Optional[GroupFilter] = None,
    ) -> DynamicSamplingLoader:
        a, s = cfg.algorithm, cfg.sampler
        return cls(
            dataset,
            rollout_fn,
            scorer,
            group_size=a.group_size,
            train_batch_size=s.train_batch_size,
            gen_batch_size=s.gen_batch_size,
            max_gen_batches=s.max_gen_batches,
            mode=s.mode,
            dynamic_sampling=a.dynamic_sampling,
            max_response_length=cfg.rollout.max_response_length,
            overlong_punishment=a.overlong_punishment,
            overlong_buffer_len=a.overlong_buffer_len,
            overlong_penalty_factor=a.overlong_penalty_factor,
            shuffle=cfg.data.shuffle,
            seed=cfg.seed,
            filter_fn=filter_fn,
        )

    # ---------------------------------------------------------------- prompt order

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return np.random.default_rng([self.seed, epoch]).permutation(n).tolist()

    def _draw(self, k: int, in_step: set[int]) -> list[int]:
        """Take up to k queued prompts not yet in this step; fewer only when every prompt is."""
        drawn: list[int] = []
        passed_over: list[int] = []
        i = 0
        while len(drawn) < k:
            if i == len(self.queue):
                if len(in_step) >= len(self.dataset):
                    break
                self.queue.extend(self._permutation(self.epoch))  # a new epoch, reshuffled
                self.epoch += 1
            idx = self.queue[i]
            i += 1
            if idx in in_step:
                passed_over.append(idx)  # stays queued, in order, for a later step
            else:
                drawn.append(idx)
                in_step.add(idx)
        self.queue = passed_over + self.queue[i:]
        return drawn

    # ---------------------------------------------------------------- one round

    def _generate(self, indices: list[int]) -> tuple[list[Group], dict[str, float]]:
        """Roll out, score and shape the rewards of one generation round."""
        prompts = [self.dataset[i] for i in indices]
        t0 = time.perf_counter()
        outputs = self.rollout_fn(prompts, self.group_size)
        t_rollout = time.perf_counter() - t0
        if len(outputs) != len(prompts):
            raise RuntimeError(f"rollout returned {len(outputs)} groups for {len(prompts)} prompts")
        for p, responses in zip(prompts, outputs):
            if len(responses) != self.group_size:
                raise RuntimeError(
                    f"rollout returned {len(responses)} responses for prompt {p.index}, "
                    f"expected algorithm.group_size={self.group_size}"
                )
        flat = [r for responses in outputs for r in responses]
        t0 = time.perf_counter()
        scored = self.scorer.score(
            [r.text for r in flat],
            [p.ground_truth for p in prompts for _ in range(self.group_size)],
            [p.data_source for p in prompts for _ in range(self.group_size)],
        )
        t_reward = time.perf_counter() - t0
        shape = (len(prompts), self.group_size)
        scores = torch.tensor(scored.scores, dtype=torch.float32).view(shape)
        lengths = torch.tensor([len(r.token_ids) for r in flat], dtype=torch.long).view(shape)
        rewards = scores.clone()
        if self.overlong_punishment:
            rewards += soft_overlong_punishment(
                lengths.flatten(), self.max_response_length, self.overlong_buffer_len, self.overlong_penalty_factor
            ).view(shape)
        acc = [bool(a) for a in scored.acc]
        groups = [
            Group(
                prompt=p,
                responses=list(responses),
                scores=scores[i].tolist(),
                acc=acc[i * self.group_size : (i + 1) * self.group_size],
                rewards=rewards[i].tolist(),
                meta={"step": self.steps},
            )
            for i, (p, responses) in enumerate(zip(prompts, outputs))
        ]
        stats = {
            "timing/rollout": t_rollout,
            "timing/reward": t_reward,
            "reward/timeouts": float(scored.metrics.get("reward/timeouts", 0)),
            "reward/errors": float(scored.metrics.get("reward/errors", 0)),
            "response/tokens": float(lengths.sum()),
            "response/length_max": float(lengths.max()) if lengths.numel() else 0.0,
            "response/truncated": float(sum(r.truncated for r in flat)),
            "reward/shaped_sum": float(rewards.sum()),
            "reward/score_sum": float(scores.sum()),
            "reward/correct": float(sum(acc)),
        }
        return groups, stats

    def _accept(self, groups: list[Group]) -> list[bool]:
        if self.filter_fn is not None:
            return [bool(self.filter_fn(g)) for g in groups]
        if not self.dynamic_sampling:
            return [True] * len(groups)
        correct = torch.tensor([g.acc for g in groups], dtype=torch.bool).view(len(groups), self.group_size)
        return informative_groups(correct).tolist()

    # ---------------------------------------------------------------- a step

    def next_batch(self) -> StepBatch:
        """Collect one rollout step's groups. Raises DynamicSamplingError when it cannot."""
        carried_in = len(self.carry)
        batch, self.carry = self.carry, []
        in_step = {g.prompt.index for g in batch}
        totals: dict[str, float] = {}
        counts = {"groups": 0, "accepted": 0, "all_correct": 0, "all_wrong": 0}
        rounds = 0
        target = self.train_batch_size
        round_size = self.train_batch_size if self.mode == "dynamic_bs" else self.gen_batch_size
        while self._needs_round(len(batch), rounds):
            if self.mode == "fill" and self.max_gen_batches and rounds >= self.max_gen_batches:
                self.carry = batch  # keep what was found: a resumed or reconfigured run can use it
                raise DynamicSamplingError(
                    self._shortfall(
                        f"after {rounds} generation rounds (sampler.max_gen_batches={self.max_gen_batches})",
                        len(batch),
                        carried_in,
                        counts,
                    )
                )
            indices = self._draw(round_size, in_step)
            if not indices:
                self.carry = batch
                raise DynamicSamplingError(
                    self._shortfall(
                        f"after every one of the {len(self.dataset)} prompts was tried in this step",
                        len(batch),
                        carried_in,
                        counts,
                    )
                )
            groups, stats = self._generate(indices)
            rounds += 1
            for k, v in stats.items():
                totals[k] = max(totals.get(k, 0.0), v) if k == "response/length_max" else totals.get(k, 0.0) + v
            keep = self._accept(groups)
            for g, ok in zip(groups, keep):
                counts["all_correct"] += g.num_correct == self.group_size
                counts["all_wrong"] += g.num_correct == 0
                if ok:
                    batch.append(g)
            counts["groups"] += len(groups)
            counts["accepted"] += sum(keep)
            log.debug(
                "sampler round %d: %d/%d groups accepted, %d/%d collected",
                rounds,
                sum(keep),
                len(groups),
                len(batch),
                target,
            )
        if self.mode == "fill":
            batch, self.carry = batch[:target], batch[target:]
        self.steps += 1
        return StepBatch(groups=batch, stats=self._step_stats(rounds, carried_in, counts, totals, len(batch)))

    def _needs_round(self, collected: int, rounds: int) -> bool:
        if self.mode == "dynamic_bs":
            return rounds == 0  # one round, whatever it accepted
        return collected < self.train_batch_size

    def _shortfall(self, when: str, found: int, carried_in: int, counts: dict[str, int]) -> str:
        frac = counts["accepted"] / counts["groups"] if counts["groups"] else 0.0
        return (
            f"dynamic sampling: {when}, only {found} of sampler.train_batch_size={self.train_batch_size} "
            f"informative groups were found ({carried_in} carried over; {counts['accepted']} of {counts['groups']} "
            f"groups generated this step were informative, fraction {frac:.3f}; {counts['all_correct']} all correct, "
            f"{counts['all_wrong']} all wrong). Raise sampler.max_gen_batches or sampler.gen_batch_size, lower "
            f"sampler.train_batch_size, or use a dataset whose difficulty suits the policy."
        )

    def _step_stats(
        self, rounds: int, carried_in: int, counts: dict[str, int], totals: dict[str, float], batch_size: int
    ) -> dict[str, float]:
        stats = {
            "sampler/gen_rounds": float(rounds),
            "sampler/groups_generated": float(counts["groups"]),
            "sampler/carried_in": float(carried_in),
            "sampler/carried_out": float(len(self.carry)),
            "sampler/batch_groups": float(batch_size),
            "sampler/epoch": float(self.epoch),
        }
        if not counts["groups"]:
            return stats  # served from the carry: no fresh rollout, so no rates (a 0 would read as a collapse)
        groups = counts["groups"]
        responses = groups * self.group_size
        return stats | {
            "sampler/informative": float(counts["accepted"]),
            "sampler/informative_frac": counts["accepted"] / groups,
            "sampler/all_correct": float(counts["all_correct"]),
            "sampler/all_wrong": float(counts["all_wrong"]),
            "reward/mean": totals.get("reward/shaped_sum", 0.0) / responses,
            "reward/score_mean": totals.get("reward/score_sum", 0.0) / responses,
            "reward/acc": totals.get("reward/correct", 0.0) / responses,
            "reward/timeouts": totals.get("reward/timeouts", 0.0),
            "reward/errors": totals.get("reward/errors", 0.0),
            "response/length_mean": totals.get("response/tokens", 0.0) / responses,
            "response/length_max": totals.get("response/length_max", 0.0),
            "response/truncated_frac": totals.get("response/truncated", 0.0) / responses,
            "timing/rollout": totals.get("timing/rollout", 0.0),
            "timing/reward": totals.get("timing/reward", 0.0),
        }

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue without repeating or skipping prompts (plain containers)."""
        return {
            "version": 1,
            "dataset_size": len(self.dataset),
            "seed": self.seed,
            "epoch": self.epoch,
            "steps": self.steps,
            "queue": list(self.queue),
            "carry": [g.to_dict() for g in self.carry],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"dynamic-sampling loader state: unknown version {state.get('version')!r}, expected 1")
        if state["dataset_size"] != len(self.dataset):
            raise ValueError(
                f"dynamic-sampling loader state was saved with a dataset of {state['dataset_size']} prompts, "
                f"but this dataset has {len(self.dataset)}: resuming would repeat or skip prompts"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"dynamic-sampling loader state was saved with seed {state['seed']}, this run has {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
        self.queue = [int(i) for i in state["queue"]]
        self.carry = [Group.from_dict(g) for g in state["carry"]]
