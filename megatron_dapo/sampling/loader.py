"""The dynamic-sampling loader (DAPO section 3.2): prompt groups stream through the engines until the batch is full.

Each rollout step, in ticks of `sampler.tick_steps` engine steps:

1. the scheduler (scheduler.py, the same on every rank) says which new groups to submit and to
   which engine; each rank submits those for its own engine;
2. every engine runs the tick's steps (continuous batching keeps it full; with fill, until its share
   of the round is done; with sampler.lockstep off, on until every rank has run its steps); a group whose last
   sample finishes is shaped (soft overlong punishment), filtered (0 < #correct < G on raw
   correctness, or the user's sampler.filter) and handed to the reward pool right away, so
   scoring overlaps generation;
3. the groups that finished in the previous tick (scored meanwhile) are summarised (GroupMeta,
   group_summary.py) and gathered on every rank, in one order, and the scheduler observes them.

When the batch is full the scheduler stops what is still generating: aborted (prompts back to
the head of the queue), or with partial rollout paused, their tokens kept on their engine's
rank to continue after the weight sync. The loader returns the batch's summaries (every rank)
and this rank's own responses; exchange.deliver then moves each trained response to the ranks
that train it. Asynchronous DAPO's controller (placement/controller.py) drives the same steps through a
TickDriver: the weights its engines hold, and its service between two ticks.

A group's responses live only on the rank of the engine that made it (its "owner"). With
sampler.mode=fill or dynamic_bs the same machinery generates whole rounds (other trainers'
samplers, for comparison). Every decision is a function of what was observed at tick
boundaries, never of wall-clock time, so every rank takes the same decisions and a resumed run
repeats an uninterrupted one (with sampler.lockstep off, what a tick observes depends on how fast
each engine ran; every rank still takes the same decisions on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol, TypedDict

from megatron_dapo import progress
from megatron_dapo.choices import ROUND_SAMPLER_MODES
from megatron_dapo.config import AlgorithmConfig, RolloutConfig, SamplerConfig
from megatron_dapo.model.comm import Comm
from megatron_dapo.rollout.engine import GroupRequest, StreamingEngine
from megatron_dapo.sampling.exchange import gather_metas, gather_stopped
from megatron_dapo.sampling.group_summary import GroupShaping, load_group_filter, token_versions
from megatron_dapo.sampling.records import GroupMeta, Stopped, Submission
from megatron_dapo.sampling.scheduler import DynamicSamplingError, SamplingScheduler
from megatron_dapo.types import Group, Prompt, Response

log = logging.getLogger("megatron_dapo.sampling")

__all__ = ["DynamicSamplingError", "DynamicSamplingLoader", "LoaderState", "StepBatch", "TickDriver"]


class AsyncScorer(Protocol):
    """What the loader needs of a reward scorer (megatron_dapo.reward.RewardPool is one)."""

    def submit(self, responses: list[str], ground_truths: list[str], data_sources: list[str]) -> int: ...

    def poll(self) -> None: ...

    def result(self, ticket: int) -> Any:
        """An object with .scores: list[float], .acc: list[bool], .status: list[str]."""


class TickDriver(Protocol):
    """What drives a step from outside the loader: the asynchronous rollout controller, whose engines take weight
    updates while they generate (None: colocated, the engines synced to the batch count before each step)."""

    def weights(self) -> int:
        """The version of the weights the engines hold now (rollout steps trained): asked before the step and after
        every tick. Tokens are tagged with it; admission counts the batches collected and not trained as started."""
        ...

    def between_ticks(self) -> None:
        """Called after every tick of a step: the controller hands out batches and applies weight updates there, so
        generation never stops for them."""
        ...


class LoaderState(TypedDict):
    """The loader's checkpoint state, one shape wherever it was taken: the scheduler's (the same on every rank) and
    the responses of groups that outlive the step, by group key: one rank's own (state_dict()) or several ranks'
    (merge_states). A rank loading it keeps those of the groups it owns."""

    scheduler: dict[str, Any]
    finished: dict[int, dict[str, Any]]
    """Carried-over groups, as Group.to_dict()."""
    partial: dict[int, list[dict[str, Any]]]
    """Paused groups' samples as their engine left them, as asdict(Response)."""


@dataclass
class StepBatch:
    """One rollout step's training groups and what it took to collect them."""

    groups: list[GroupMeta]
    """The batch, in training order (every rank has the same list)."""
    local: dict[int, list[Response]]
    """The responses of the batch's groups this rank owns, by group key."""
    stats: dict[str, float]


class DynamicSamplingLoader:
    """Collects each rollout step's groups; see the module docstring.

    dataset: the prompts (every rank holds the same dataset). engines: {engine id: engine} this rank
    drives (one on CPU; on GPU every rank of an engine's tensor-parallel group drives it and only
    the first one owns its groups: `owned`). scorer: the reward pool. algorithm: the group size, dynamic sampling
    and the overlong shaping; sampler: the sampler section (scheduler.py); rollout: the sampling parameters
    (temperature, top_p, max_response_length). seed: the run's seed (the prompt order, each group's sampling seeds);
    shuffle: data.shuffle. lockstep: Config.lockstep(), whether the engines wait for each other at every tick;
    overlong_soft_max: Config.overlong_soft_max(). num_engines: engines in the world. comm: the collectives (None:
    one process). stop_token_ids: the tokens that end a response.
    """

    def __init__(
        self,
        dataset: Sequence[Prompt],
        engines: Mapping[int, StreamingEngine],
        scorer: AsyncScorer,
        *,
        algorithm: AlgorithmConfig,
        sampler: SamplerConfig,
        rollout: RolloutConfig,
        seed: int,
        shuffle: bool,
        lockstep: bool,
        overlong_soft_max: int,
        num_engines: int = 1,
        owned: Optional[set[int]] = None,
        comm: Optional[Comm] = None,
        stop_token_ids: Optional[list[int]] = None,
    ) -> None:
        a, s, r = algorithm, sampler, rollout
        self.dataset = dataset
        self.engines = dict(engines)
        self.owned = set(self.engines) if owned is None else set(owned)
        self.scorer = scorer
        self.comm = comm or Comm()
        filter_fn = load_group_filter(s.filter) if s.filter else None
        self.scheduler = SamplingScheduler(
            s,
            len(dataset),
            num_engines,
            group_size=a.group_size,
            seed=seed,
            dynamic_sampling=a.dynamic_sampling or filter_fn is not None,
            shuffle=shuffle,
        )
        self.group_size = a.group_size
        self.tick_steps = s.tick_steps
        # sampler.lockstep off: engines that have run their tick's steps go on generating until every rank has
        self.free = not lockstep and s.mode == "stream" and self.comm.world > 1
        # the ranks that drive one engine (rollout.tp) must step it together: its first rank decides for them
        self._everyone, self._engine_ranks = (
            self.comm.host_groups(self.comm.world // num_engines) if self.free else (None, None)
        )
        self.free_steps = 0  # this rank's engine steps past tick_steps, this rollout step
        self.sampling = dict(
            temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_length, stop_token_ids=stop_token_ids
        )
        self.max_response_length = r.max_response_length
        self.shaping = GroupShaping(a, r.max_response_length, overlong_soft_max, filter_fn)
        # this rank's share of the state: responses of the groups it owns that outlive a step
        self.finished: dict[int, Group] = {}  # carried-over groups (and, during a step, finished ones)
        self.partial: dict[int, list[Response]] = {}  # paused groups' samples as their engine left them
        self._pending: list[tuple[int, int, Group, int, int, int]] = []  # (ticket, key, group, engine, tick, fresh)
        self._base: dict[int, int] = {}  # key -> tokens it had when (re)submitted this step: the rest are this step's
        self._tick = 0  # ticks of the step in progress
        self._engine_of: dict[int, int] = {}  # key -> engine, for the groups in flight on this rank's engines
        self.sampling_version = 0
        """The version of the weights generating now (the tag of every token sampled now): the batch count, or the
        TickDriver's weights()."""

    @property
    def version(self) -> int:
        """Batches handed out so far: the weight version that will train the batch being collected."""
        return self.scheduler.version

    # ---------------------------------------------------------------- a step

    def next_batch(self, driver: Optional[TickDriver] = None) -> StepBatch:
        """Collect one rollout step's groups; driver: the asynchronous controller's (None: colocated). Raises
        DynamicSamplingError when it cannot (sampler.on_shortfall)."""
        sched = self.scheduler
        self._weights_from(driver)
        t0 = time.perf_counter()
        engine_t0 = {e: dict(eng.stats) for e, eng in self.engines.items()} if self._has_stats() else {}
        gathered0 = self.comm.bytes_gathered
        self.free_steps = 0
        self._submit(sched.begin_step())
        self._tick = 0
        t_scoring = 0.0
        while not sched.step_done:
            self._submit(sched.plan())
            self._generate()
            t1 = time.perf_counter()
            scored = self._collect_scored()
            t_scoring += time.perf_counter() - t1
            sched.observe(gather_metas(self.comm, scored, self.group_size), self._engine_load())
            self._tick += 1
            if driver is not None:
                driver.between_ticks()
                self._weights_from(driver)
        t_full = time.perf_counter() - t0
        stop = sched.close_step()
        stopped = gather_stopped(self.comm, self._stop(stop))
        try:
            result = sched.settle(stopped)
        except DynamicSamplingError:
            self._forget(keep={g.key for g in sched.carry} | {p.key for p in sched.paused})
            raise
        if result.shortfall is not None:
            log.warning("training on a short batch (sampler.on_shortfall=train): %s", result.shortfall)
        local = {g.key: self.finished[g.key].responses for g in result.batch if g.key in self.finished}
        self._forget(keep=result.keep)
        for g in result.batch:
            self.finished.pop(g.key, None)  # trained now: the caller holds them (local)
        self._check_agreement()
        stats = dict(result.stats)
        stats.update(self._timing_stats(t_full, self._tick, t_scoring, engine_t0))
        stats["sampler/bytes_gathered"] = float(self.comm.sum([self.comm.bytes_gathered - gathered0])[0])
        return StepBatch(groups=result.batch, local=local, stats=stats)

    def _weights_from(self, driver: Optional[TickDriver]) -> None:
        """The weights generating from now on: the driver's (admission counts the batches collected and not trained
        as started, sampler.max_staleness), or without one the batch count's."""
        if driver is None:
            self.sampling_version = self.version
            return
        self.sampling_version = driver.weights()
        self.scheduler.untrained_batches = max(0, self.version - self.sampling_version)

    def _check_agreement(self) -> None:
        """Every rank must have taken the same decisions: compare the schedulers' fingerprints (two floats)."""
        if self.comm.world == 1:
            return
        d = float(self.scheduler.digest())
        low, high = self.comm.max([-d, d])
        if -low != high:
            raise RuntimeError(
                f"dynamic sampling: the ranks' schedulers disagree after step {self.version} (rank {self.comm.rank}: "
                f"state fingerprint {int(d)}); every rank must be given the same dataset, seed, config and "
                "observations"
            )

    def _generate(self) -> None:
        """One tick: stream, tick_steps engine steps; fill and dynamic_bs, until this rank's engines have finished
        their share of the round (a round is observed only once complete, so no rank need wait for another
        before that, as with a batch generate() per engine)."""
        rounds = self.scheduler.cfg.mode in ROUND_SAMPLER_MODES
        steps = 0
        while steps < self.tick_steps or (rounds and self._in_flight()):
            self._step_engines()
            steps += 1
        if self.free:
            self._generate_until_every_rank_arrives()

    def _generate_until_every_rank_arrives(self) -> None:
        """sampler.lockstep off: instead of waiting at the tick for the slowest rank, this rank's engine steps on
        while it has work, until every rank has run its tick_steps (what finishes meanwhile is this tick's)."""
        arrived = self.comm.arrive(self._everyone)
        while True:
            go = not arrived.is_completed() and self._in_flight()
            if self._engine_ranks is not None:  # every rank of an engine takes the same steps
                go = self.comm.broadcast_flag(go, self._engine_ranks)
            if not go:
                break
            self._step_engines()
            self.free_steps += 1
        with progress.waiting("the other ranks (the end of their tick)"):
            arrived.wait()

    def _in_flight(self) -> bool:
        return any(e.in_flight() for e in self.engines.values())

    def _step_engines(self) -> None:
        """One engine step of each of this rank's engines; what finished goes to scoring."""
        for e, engine in self.engines.items():
            for key, responses in engine.step():
                self._finished(e, key, responses)
        self.scorer.poll()

    def _engine_load(self) -> list[int]:
        """Every engine's unfinished samples, as its owning rank counts them (the same numbers on every rank)."""
        load = [0.0] * self.scheduler.num_engines
        for e in self.owned:
            load[e] = float(self.engines[e].unfinished())
        return [int(x) for x in self.comm.sum(load)]

    def _has_stats(self) -> bool:
        return all("seconds" in getattr(eng, "stats", {}) for eng in self.engines.values())

    def _submit(self, submissions: list[Submission]) -> None:
        """Hand this rank's engines their share of the scheduler's submissions."""
        per_engine: dict[int, list[GroupRequest]] = {}
        for sub in submissions:
            if sub.engine not in self.engines:
                continue  # another rank's engine
            prompt = self.dataset[sub.index]
            self._engine_of[sub.key] = sub.engine
            prefixes = self.partial.pop(sub.key, None) if sub.resume else None
            self._base[sub.key] = _num_tokens(prefixes or [])
            request = GroupRequest(
                key=sub.key,
                prompt_ids=list(prompt.token_ids),
                n=self.group_size,
                seed=sub.seed,
                version=self.sampling_version,
                prefixes=prefixes,
            )
            per_engine.setdefault(sub.engine, []).append(request)
        for e, requests in per_engine.items():
            self.engines[e].submit(requests, **self.sampling)

    def _finished(self, engine: int, key: int, responses: list[Response]) -> None:
        """A group's last sample finished: shape its rewards and start scoring it (owner only)."""
        self._engine_of.pop(key, None)
        fresh = self._fresh_tokens(key, responses)
        if engine not in self.owned:
            return
        prompt = self.dataset[self.scheduler.flight[key].index]
        if len(responses) != self.group_size:
            raise RuntimeError(
                f"engine {engine} returned {len(responses)} responses for group {key} (prompt {prompt.index}), "
                f"expected algorithm.group_size={self.group_size}"
            )
        group = Group(prompt=prompt, responses=responses, scores=[], acc=[], rewards=[], meta={"key": key})
        ticket = self.scorer.submit(
            [r.text for r in responses], [prompt.ground_truth] * len(responses), [prompt.data_source] * len(responses)
        )
        self._pending.append((ticket, key, group, engine, self._tick, fresh))

    def _fresh_tokens(self, key: int, responses: list[Response]) -> int:
        """Tokens of `responses` generated since group `key` was (re)submitted this step; forgets that mark."""
        return _num_tokens(responses) - self._base.pop(key, 0)

    def _collect_scored(self) -> list[GroupMeta]:
        """The groups that finished in an earlier tick: wait for their scores (the pool had a whole tick of
        generation to work on them), summarise them. Those of this tick wait for the next: what is observed when
        depends on engine steps only, never on how fast the pool was."""
        ready = [p for p in self._pending if p[4] < self._tick]
        self._pending = [p for p in self._pending if p[4] == self._tick]
        return [
            self._summarise(key, group, engine, self.scorer.result(ticket), fresh)
            for ticket, key, group, engine, _, fresh in ready
        ]

    def _summarise(self, key: int, group: Group, engine: int, scored: Any, fresh: int) -> GroupMeta:
        meta = self.shaping.summarise(key, group, engine, scored, self.sampling_version)
        meta.finished_in, meta.fresh_tokens = self.version, fresh
        self.finished[key] = group
        return meta

    def _stop(self, stop: dict[int, bool]) -> dict[int, Stopped]:
        """Abort (keep=False) or pause (keep=True) the groups still generating; report what this rank had of them."""
        out: dict[int, Stopped] = {}
        # finished in the last tick but not observed yet: the scheduler counts them as still generating
        still_scoring = {key: (group, fresh) for _, key, group, _, _, fresh in self._pending}
        for ticket, *_ in self._pending:
            self.scorer.result(ticket)  # drained, so the pool holds nothing of a finished step
        self._pending = []
        by_engine: dict[int, list[int]] = {}
        for key in stop:
            e = self._engine_of.get(key)
            if e is not None:
                by_engine.setdefault(e, []).append(key)
        stopped_samples: dict[int, tuple[list[Response], int]] = {}  # key -> (samples, tokens of this step)
        for e, keys in by_engine.items():
            aborted = self.engines[e].abort(sorted(keys))
            for key in keys:
                self._engine_of.pop(key, None)
                fresh = self._fresh_tokens(key, aborted.get(key, []))
                if e in self.owned:
                    stopped_samples[key] = (aborted[key], fresh)
        for key, (group, fresh) in still_scoring.items():
            if key in stop:
                stopped_samples[key] = (group.responses, fresh)
        for key, (samples, fresh) in stopped_samples.items():
            versions = token_versions(samples, self.sampling_version)
            out[key] = Stopped(
                tokens=len(versions), tokens_now=fresh, first_version=min(versions) if versions else None
            )
            if stop[key]:
                self.partial[key] = samples  # kept only if settle() pauses it (see _forget)
        return out

    def _forget(self, keep: set[int]) -> None:
        """Drop this rank's responses of every group the scheduler no longer needs."""
        self.finished = {k: g for k, g in self.finished.items() if k in keep}
        self.partial = {k: s for k, s in self.partial.items() if k in keep}

    def _timing_stats(
        self, t_full: float, ticks: int, t_scoring: float, engine_t0: dict[int, dict[str, float]]
    ) -> dict[str, float]:
        """Per-step timing and engine activity: busy = seconds inside engine steps that ran something, summed over
        the engines (each counted on its owning rank); times are the slowest rank's."""
        busy = sum(
            self.engines[e].stats["seconds"] - before["seconds"] for e, before in engine_t0.items() if e in self.owned
        )
        free = self.free_steps if self.owned else 0  # an engine's steps, counted once (by its first rank)
        busy, free = self.comm.sum([busy, free])
        t_full, t_scoring = self.comm.max([t_full, t_scoring])
        out = {"sampler/ticks": float(ticks), "timing/rollout": t_full, "timing/reward_wait": t_scoring}
        if self.free:
            out["sampler/free_steps"] = free
        if engine_t0 and t_full > 0:
            engines = self.scheduler.num_engines
            out["timing/engine_busy_frac"] = busy / (engines * t_full)
            out["timing/engine_idle"] = t_full - busy / engines  # per engine: waiting on scores, ticks, peers
        return out

    # ---------------------------------------------------------------- state

    def state_dict(self) -> LoaderState:
        """The scheduler's state (the same on every rank) and this rank's responses of groups that outlive the step."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "finished": {k: g.to_dict() for k, g in self.finished.items()},
            "partial": {k: [asdict(r) for r in samples] for k, samples in self.partial.items()},
        }

    @staticmethod
    def merge_states(states: list[LoaderState]) -> LoaderState:
        """One state for the states of several ranks (the same scheduler, each rank's own responses)."""
        return {
            "scheduler": states[0]["scheduler"],
            "finished": {k: g for s in states for k, g in s["finished"].items()},
            "partial": {k: p for s in states for k, p in s["partial"].items()},
        }

    def load_state_dict(self, state: LoaderState) -> None:
        """state: this rank's (state_dict()) or several ranks' (merge_states()): this rank keeps the responses of
        the groups it owns by the scheduler's state, every one of which must be there."""
        if "scheduler" not in state:
            raise ValueError(
                "dynamic-sampling loader state has no 'scheduler' entry: it was saved by an older version of "
                "megatron-dapo, whose checkpoints cannot be resumed by this one"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        owned = {g.key for g in self.scheduler.carry if g.engine in self.owned}
        owned |= {p.key for p in self.scheduler.paused if p.engine in self.owned}
        finished = {int(k): g for k, g in state["finished"].items()}
        partial = {int(k): samples for k, samples in state["partial"].items()}
        self.finished = {k: Group.from_dict(g) for k, g in finished.items() if k in owned}
        self.partial = {k: [Response(**r) for r in samples] for k, samples in partial.items() if k in owned}
        missing = owned - set(self.finished) - set(self.partial)
        if missing:
            raise ValueError(
                f"dynamic-sampling loader state: this rank owns groups {sorted(owned)} by the scheduler's state but "
                f"the state holds no responses of {sorted(missing)}: the checkpoint's rank files do not belong together"
            )


def _num_tokens(responses: list[Response]) -> int:
    return sum(len(r.token_ids) for r in responses)
