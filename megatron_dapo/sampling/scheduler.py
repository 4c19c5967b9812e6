"""Which prompt groups to generate, on which engine, and which to train on: the dynamic-sampling decisions.

A deterministic state machine with no I/O, no engines and no torch.distributed: the loader
(loader.py) feeds it what the engines report, and the paper-scale simulator
(sim/driver.py) feeds it simulated engines, so both run exactly these rules. Every rank
holds an identical scheduler and feeds it the same observations in the same order, so every
rank takes the same decisions, and a resumed run takes the ones the uninterrupted run took.
The records it exchanges are in records.py; the step in progress (its batch, counters and
statistics) is step.py's StepState.

One rollout step:

    resumed = s.begin_step()         # partial rollout: paused groups to continue (or drop when too stale)
    while not s.step_done:
        submit(s.plan())             # new groups: dataset prompt, engine, seed
        s.observe(finished_groups)   # scored groups, as GroupMeta, in a deterministic order
    stop = s.close_step()            # {key: keep?} for groups still generating: abort, or pause (keep)
    result = s.settle(stopped)       # what the engines had of them; the batch, carry, stats

Modes (sampler.mode):
- fill (verl's DAPO recipe): generation rounds of gen_batch_size prompts, each generated to the
  end, then filtered in submission order until train_batch_size informative groups are found.
- dynamic_bs (AReaL): one round of train_batch_size prompts; train on whatever it accepted.
- stream: prompts go out one group at a time whenever the expected number of informative groups
  in flight falls short of what the batch still needs, to whichever engine has the fewest groups,
  and groups are committed strictly in submission order: a group that finished early is never
  preferred over one submitted before it that is still generating, so the trained groups are the
  ones a round-based sampler would have trained (no bias toward short responses). When the batch
  is full, every group behind its last one goes back to the head of the queue, still generating
  (aborted) or finished: keeping the finished ones would keep the short ones.
- stream with partial_rollout: groups start while the engines have room and admission allows (see
  Staleness), are accepted as they complete, and groups still generating when the batch is full are
  paused and continue after the weight sync (every token tagged with the policy version that sampled
  it). Every started group is eventually accepted or rejected on its own outcome (with
  sampler.drop_stale also aborted by the staleness bound alone), so over a run
  no response is kept or dropped for being short.

Prompt memory (prompt_memory.py): every observed group is recorded against its prompt, and with
sampler.skip a prompt whose record predicts an uninformative group may be deferred when it comes up in the
queue (consumed from this epoch's pass, back in the next); the groups generated are judged exactly as
without it.

Staleness: the policy version is the number of weight syncs so far (= rollout steps trained); a token sampled
under version v and trained at version V is V - v stale. max_staleness has three meanings (docs/async.md's table):
with partial rollout, AReaL's eta, bounding admission, never age (_admissible: a started group is trained or
rejected on its own outcome, however many versions it spans; sampler.drop_stale restores the older rule, stale
groups dropped); fill and dynamic_bs carry their surplus one version on only when it is >= 1 (_too_stale); and
asynchronous, the batches collected ahead of training (untrained_batches counts them as started).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from megatron_dapo.choices import ROUND_SAMPLER_MODES
from megatron_dapo.cli import UserError
from megatron_dapo.config import SamplerConfig
from megatron_dapo.sampling.prompt_memory import PromptMemory
from megatron_dapo.sampling.records import Flight, GroupMeta, Paused, StepResult, Stopped, Submission
from megatron_dapo.sampling.scheduler_state import SchedulerState
from megatron_dapo.sampling.step import StepState

INITIAL_INFORMATIVE_FRAC = 0.5
"""The first step's guess of the informative fraction; later steps start from what earlier steps measured."""


class DynamicSamplingError(UserError, RuntimeError):
    """The loader cannot fill a batch: too few informative groups within the cap, or too few prompts."""


def _requeue_front(queue: list[int], indices: list[int]) -> list[int]:
    return list(indices) + queue


class SamplingScheduler(SchedulerState):
    """The decisions of the dynamic-sampling loader; see the module docstring.

    sampler: the config's sampler section (validated here too, for a scheduler built outside a config).
    num_prompts: dataset size. num_engines: rollout engines across the world. group_size: algorithm.group_size.
    seed: the run's seed (prompt order, skip decisions). dynamic_sampling: false when every group is trained (no
    informative test and no user filter). shuffle: data.shuffle.
    """

    def __init__(
        self,
        sampler: SamplerConfig,
        num_prompts: int,
        num_engines: int = 1,
        *,
        group_size: int = 16,
        seed: int = 42,
        dynamic_sampling: bool = True,
        shuffle: bool = True,
    ) -> None:
        sampler.validate()
        if num_prompts < 1:
            raise ValueError("the dataset is empty: the sampler has no prompt to draw")
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines}: expected at least 1")
        self.cfg = sampler
        self.num_prompts = num_prompts
        self.num_engines = num_engines
        self.group_size = group_size
        self.shuffle = shuffle
        self.seed = seed
        # state kept across steps (state_dict)
        self.version = 0  # weight syncs so far = steps returned
        self.epoch = 0  # permutations appended to the queue so far
        self.next_key = 0
        self.queue: list[int] = []
        self.carry: list[GroupMeta] = []
        self.paused: list[Paused] = []
        self.untrained_batches = 0
        """Asynchronous pipeline: batches handed to the trainer and not trained yet, set by whoever runs the trainer
        (the controller, the simulator) before each plan(); admission counts them as started. Colocated: always 0."""
        # without dynamic sampling every group is trained: nothing to estimate
        self.informative_frac = INITIAL_INFORMATIVE_FRAC if dynamic_sampling else 1.0
        self.memory = PromptMemory(num_prompts, group_size, sampler, seed)
        # the step in progress
        self.flight: dict[int, Flight] = {}
        self._step: Optional[StepState] = None
        self._load = [0] * num_engines
        """Unfinished samples per engine: as the engines last reported (observe), plus what went out since."""

    # ---------------------------------------------------------------- prompt order

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts).tolist()

    def _draw(self, k: int) -> list[int]:
        """Take up to k queued prompts not yet in this step; fewer only when every prompt is."""
        st = self._step
        drawn: list[int] = []
        passed_over: list[int] = []
        i = 0
        while len(drawn) < k:
            if i == len(self.queue):
                if len(st.in_step) >= self.num_prompts:
                    st.exhausted = True
                    break
                self.queue.extend(self._permutation(self.epoch))  # a new epoch, reshuffled
                self.epoch += 1
            idx = self.queue[i]
            i += 1
            if idx in st.in_step:
                passed_over.append(idx)  # stays queued, in order, for a later step
                continue
            decision = self.memory.decide(idx)
            if decision.skip:  # consumed from this epoch's pass: it comes up again in the next
                st.counts["skipped"] += 1
                st.counts["tokens_saved"] += decision.tokens
            else:
                drawn.append(idx)
                st.in_step.add(idx)
                st.drawn[idx] = (decision.predicted, decision.p_generate)
        self.queue = passed_over + self.queue[i:]
        return drawn

    def group_seed(self, key: int) -> int:
        """The seed of group `key` (sample j: + j)."""
        return (self.seed * 1_000_003 + key * self.group_size) % 2**31

    # ---------------------------------------------------------------- the step

    def begin_step(self) -> list[Submission]:
        """Start a rollout step; returns the paused groups to continue first (partial rollout)."""
        if self._step is not None:
            raise RuntimeError("begin_step() while a step is in progress: close_step() and settle() it first")
        v = self.version
        st = self._step = StepState(version=v)
        fresh, stale = [], []
        for g in self.carry:  # trained this step at version v
            (stale if self._too_stale(g.version, v) else fresh).append(g)
        for g in stale:
            st.counts["groups_stale"] += 1
            st.counts["tokens_wasted_earlier"] += g.tokens
        st.counts["carried_in"] = len(fresh)
        st.batch, self.carry = fresh[: self.cfg.train_batch_size], fresh[self.cfg.train_batch_size :]
        requeue = [g.index for g in stale]
        resumed: list[Submission] = []
        for p in self.paused:
            if self._too_stale(p.version, v):  # only when max_staleness was lowered since it was paused
                requeue.append(p.index)
                st.counts["groups_stale"] += 1
                st.counts["tokens_wasted_earlier"] += p.tokens
            else:
                self.flight[p.key] = Flight(p.key, p.index, p.engine, p.seed, True, p.predicted, p.p_generate)
                resumed.append(Submission(p.key, p.index, p.engine, p.seed, resume=True))
        st.counts["resumed"] = len(resumed)
        self._load = [0] * self.num_engines
        for sub in resumed:
            self._load[sub.engine] += self.group_size
        self.paused = []
        self.queue = _requeue_front(self.queue, requeue)
        st.in_step = (
            {g.index for g in st.batch} | {g.index for g in self.carry} | {f.index for f in self.flight.values()}
        )
        st.order = [s.key for s in resumed]
        self._note_in_flight()
        return resumed

    def _too_stale(self, first_version: int, trained_at: int) -> bool:
        """The drop rule (fill's carry; partial rollout only with sampler.drop_stale): would a group whose oldest
        token is of first_version, trained at version trained_at, exceed max_staleness?"""
        if self.cfg.partial_rollout and not self.cfg.drop_stale:
            return False  # admission bounds partial rollout: a started group is never dropped for its age
        return trained_at - first_version > self.cfg.max_staleness

    def _admissible(self) -> int:
        """Partial rollout: how many more groups may start within (1 + max_staleness) batches ahead of training
        (AReaL's eta), counting each group generating as the informative fraction estimated so far, and each batch
        handed out but not trained yet (asynchronous) as a whole batch."""
        st = self._step
        p = self._informative_estimate()
        ahead = self.untrained_batches * self.cfg.train_batch_size
        ahead += len(st.batch) + len(st.surplus) + len(self.carry) + p * len(self.flight)
        return math.floor(((1 + self.cfg.max_staleness) * self.cfg.train_batch_size - ahead) / p + 1e-9)

    @property
    def step_done(self) -> bool:
        """The batch is full, or nothing more can be generated and nothing is generating."""
        st = self._require_step()
        if self.cfg.mode == "dynamic_bs":
            return st.rounds == 1 and not self.flight
        if len(st.batch) >= self.cfg.train_batch_size:
            return True
        return not self.flight and not self._can_submit()

    def _can_submit(self) -> bool:
        st = self._step
        if st.exhausted:
            return False
        if self.cfg.mode == "fill":
            return not (self.cfg.max_gen_batches and st.rounds >= self.cfg.max_gen_batches)
        if self.cfg.mode == "dynamic_bs":
            return st.rounds == 0
        cap = self.cfg.max_gen_batches * self.cfg.gen_batch_size
        return not (cap and st.submitted >= cap)

    def plan(self) -> list[Submission]:
        """The new groups to submit now (possibly none), each with its engine and seed."""
        st = self._require_step()
        if self.step_done or not self._can_submit():
            return []
        if self.cfg.mode in ROUND_SAMPLER_MODES:
            if self.flight:  # a round is generated to its end before it is filtered
                return []
            size = self.cfg.train_batch_size if self.cfg.mode == "dynamic_bs" else self.cfg.gen_batch_size
            st.rounds += 1
            out = self._submit(self._draw(size))
            st.round_left = len(out)
            return out
        # whole groups into the engines' free sample slots (engine_sequences each)
        room = sum(max(0, (self.cfg.engine_sequences - load) // self.group_size) for load in self._load)
        cap = self.cfg.max_gen_batches * self.cfg.gen_batch_size
        if cap:
            room = min(room, cap - st.submitted)
        if not self.cfg.partial_rollout:  # on-policy: only what the batch is expected to need, to abort little
            wanted = st.groups_wanted(self.cfg.train_batch_size, self._informative_estimate(), self.cfg.stream_margin)
            room = min(room, wanted - len(self.flight))
        elif not self.cfg.drop_stale:  # starts stay within max_staleness batches of what training consumed
            room = min(room, self._admissible())
        return self._submit(self._draw(room)) if room > 0 else []

    def _informative_estimate(self) -> float:
        """The informative fraction: earlier steps' estimate, updated by this step's groups taken in order."""
        return self._step.informative_estimate(self.informative_frac, self.cfg.train_batch_size)

    def _submit(self, indices: list[int]) -> list[Submission]:
        """Each prompt to the engine with the fewest unfinished samples (the most room), lowest id first on ties."""
        st = self._step
        out = []
        for idx in indices:
            engine = min(range(self.num_engines), key=lambda e: (self._load[e], e))
            self._load[engine] += self.group_size
            key = self.next_key
            self.next_key += 1
            sub = Submission(key, idx, engine, self.group_seed(key))
            predicted, p_generate = st.drawn.pop(idx)
            self.flight[key] = Flight(key, idx, engine, sub.seed, False, predicted, p_generate)
            st.order.append(key)
            out.append(sub)
        st.submitted += len(out)
        self._note_in_flight()
        return out

    def _note_in_flight(self) -> None:
        self._step.max_in_flight = max(self._step.max_in_flight, len(self.flight))

    def observe(self, groups: list[GroupMeta], engine_load: Optional[list[int]] = None) -> None:
        """Finished, scored groups (in any order: they are taken by submission number).

        engine_load: each engine's unfinished samples now (running or queued), as the engines report them; without
        it a group counts whole until it is observed (an engine holding stragglers then looks fuller than it is).
        """
        st = self._require_step()
        if engine_load is not None:
            if len(engine_load) != self.num_engines:
                raise ValueError(f"engine_load has {len(engine_load)} entries for {self.num_engines} engines")
            self._load = [int(x) for x in engine_load]
        for g in sorted(groups, key=lambda g: g.key):
            flight = self.flight.pop(g.key, None)
            if flight is None:
                raise ValueError(f"group {g.key} (prompt {g.index}) was observed but is not in flight")
            if engine_load is None:
                self._load[g.engine] -= self.group_size
            st.count_finished(g, flight.predicted, flight.p_generate)
            self.memory.record(g.index, self.version, g.num_correct, g.tokens / len(g.lengths))
            if self.cfg.mode == "stream" and not self.cfg.partial_rollout:
                st.waiting[g.key] = g
            elif self.cfg.mode == "stream":
                st.accept(g, self.cfg.train_batch_size)  # partial rollout: in completion order
            else:
                st.waiting[g.key] = g
                st.round_left -= 1
        if self.cfg.mode == "stream" and not self.cfg.partial_rollout:
            st.commit_in_order(self.cfg.train_batch_size, stop_when_full=True)
        elif self.cfg.mode != "stream" and st.round_left == 0 and st.waiting:  # the round is complete
            st.commit_in_order(self.cfg.train_batch_size, stop_when_full=False)

    def close_step(self) -> dict[int, bool]:
        """End the step: {key: keep} for every group still generating; keep=True pauses it (partial rollout),
        False aborts it (its prompt returns to the head of the queue)."""
        st = self._require_step()
        if not self.step_done:
            raise RuntimeError("close_step() before the step is done (step_done is False)")
        # stream (on-policy): everything behind the batch's last group goes back to the queue, finished or not.
        # Carrying the finished ones would favour short responses (whether a group is done by now depends on its
        # length: measured -5% mean trained length on a long-tailed script); the in-flight target keeps this small.
        st.stopping = {key: self.cfg.partial_rollout for key in self.flight}
        return dict(st.stopping)

    def settle(self, stopped: dict[int, Stopped]) -> StepResult:
        """What the engines had of the stopped groups -> the step's batch, the state for the next step, stats.

        Raises DynamicSamplingError on a shortfall with on_shortfall=error (or fewer than min_groups);
        what was found is kept as carry, so a resumed or reconfigured run can use it.
        """
        st = self._require_step()
        if set(stopped) != set(st.stopping):
            raise ValueError(
                f"settle() needs every stopped group: expected {sorted(st.stopping)}, got {sorted(stopped)}"
            )
        c = st.counts
        v = st.version
        requeue: list[tuple[int, int]] = []  # (key, prompt): back to the head of the queue, in submission order
        # stream: finished groups behind the batch's last one lose their place (see close_step)
        for key, g in sorted(st.waiting.items()):
            requeue.append((key, g.index))
            c["tokens_wasted"] += g.tokens_of_step(v)
        st.waiting.clear()
        for key, keep in sorted(st.stopping.items()):
            f, info = self.flight.pop(key), stopped[key]
            c["tokens_generated"] += info.tokens_now
            if info.first_version is None:  # never started: nothing generated, nothing lost
                requeue.append((key, f.index))
            elif keep and not self._too_stale(info.first_version, v + 1):
                self.paused.append(
                    Paused(key, f.index, f.engine, f.seed, info.first_version, info.tokens, f.predicted, f.p_generate)
                )
                c["tokens_paused"] += info.tokens_now
            else:
                requeue.append((key, f.index))
                c["tokens_wasted"] += info.tokens_now
                c["tokens_wasted_earlier"] += info.tokens - info.tokens_now
        shortfall = None
        if len(st.batch) < self.cfg.train_batch_size and self.cfg.mode != "dynamic_bs":
            shortfall = st.shortfall_reason(
                num_prompts=self.num_prompts,
                mode=self.cfg.mode,
                max_gen_batches=self.cfg.max_gen_batches,
                gen_batch_size=self.cfg.gen_batch_size,
                train_batch_size=self.cfg.train_batch_size,
            )
        # surplus informative groups: trained next step (version v + 1) when allowed, else dropped
        for g in st.surplus:
            if self.cfg.carry_surplus and not self._too_stale(g.version, v + 1):
                self.carry.append(g)
                c["tokens_carried"] += g.tokens_of_step(v)
            else:
                if self.cfg.carry_surplus:  # too stale to carry: the prompt is tried again
                    requeue.append((g.key, g.index))
                c["tokens_wasted"] += g.tokens_of_step(v)
                c["tokens_wasted_earlier"] += g.tokens - g.tokens_of_step(v)
        self.queue = _requeue_front(self.queue, [idx for _, idx in sorted(requeue)])
        c["requeued"] = len(requeue)
        if shortfall is not None and (self.cfg.on_shortfall == "error" or len(st.batch) < self.cfg.min_groups):
            self.carry = st.batch + self.carry  # keep what was found (at the front: it is the oldest)
            self.informative_frac = self._informative_estimate()
            self._step = None
            raise DynamicSamplingError(shortfall)
        for g in st.batch:
            c["tokens_trained"] += g.tokens_of_step(v)
            c["tokens_trained_total"] += g.tokens
        stats = st.stats(
            shortfall,
            carried_out=len(self.carry),
            paused=len(self.paused),
            epoch=self.epoch,
            informative_estimate=self._informative_estimate(),
            max_staleness=self.cfg.max_staleness,
        )
        if self.cfg.skip:
            stats |= st.skip_stats(self.memory.explore)
            if c["groups"]:
                self.memory.adapt(c["informative"] / c["groups"])
        self.informative_frac = self._informative_estimate()
        keep = {g.key for g in st.batch} | {g.key for g in self.carry} | {p.key for p in self.paused}
        self.version += 1
        self._step = None
        return StepResult(batch=st.batch, keep=keep, stats=stats, shortfall=shortfall)

    def _require_step(self) -> StepState:
        if self._step is None:
            raise RuntimeError("no rollout step in progress: call begin_step() first")
        return self._step
