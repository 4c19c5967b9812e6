"""One rollout step inside the SamplingScheduler: its batch (taken in order), its counters, its statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_dapo.sampling.records import GroupMeta

COUNTS = (
    "groups",
    "informative",
    "all_correct",
    "all_wrong",
    "responses",
    "correct",
    "score_sum",
    "reward_sum",
    "truncated",
    "response_tokens",
    "length_max",
    "reward_timeouts",
    "reward_errors",
    "carried_in",
    "resumed",
    "requeued",
    "groups_stale",
    "taken",
    "taken_informative",
    "tokens_generated",
    "tokens_trained",
    "tokens_trained_total",
    "tokens_uninformative",
    "tokens_wasted",
    "tokens_wasted_earlier",
    "tokens_carried",
    "tokens_paused",
    "skipped",
    "tokens_saved",
    "explore_visits",
    "explore_uninformative",
    "ht_informative",
    "ht_groups",
)
"""The step's counters (StepState.counts), all starting at 0."""


@dataclass
class StepState:
    """Bookkeeping of the step in progress (a checkpoint is only ever taken between steps)."""

    version: int
    batch: list[GroupMeta] = field(default_factory=list)
    surplus: list[GroupMeta] = field(default_factory=list)
    """Informative groups found after the batch was full, in acceptance order."""
    waiting: dict[int, GroupMeta] = field(default_factory=dict)
    """stream: finished groups behind an unfinished earlier one (committed in submission order)."""
    order: list[int] = field(default_factory=list)
    """Keys submitted this step, in submission order (stream commits along it)."""
    committed: int = 0
    in_step: set[int] = field(default_factory=set)
    """Prompts already in this step: none is generated twice in one step."""
    drawn: dict[int, tuple[bool, float]] = field(default_factory=dict)
    """Prompts drawn and not submitted yet: (predicted uninformative, probability of being generated)."""
    submitted: int = 0
    rounds: int = 0
    round_left: int = 0
    exhausted: bool = False
    stopping: dict[int, bool] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in COUNTS})
    max_in_flight: int = 0

    # ---------------------------------------------------------------- the batch

    def count_finished(self, g: GroupMeta, predicted: bool = False, p_generate: float = 1.0) -> None:
        """A generated group observed; predicted / p_generate: what the skip policy said of its prompt."""
        c = self.counts
        if predicted:  # an exploration visit: did the record predict right?
            c["explore_visits"] += 1
            c["explore_uninformative"] += not g.informative
        c["ht_informative"] += g.informative / p_generate  # Horvitz-Thompson: each group stands for 1/p draws
        c["ht_groups"] += 1.0 / p_generate
        c["groups"] += 1
        c["informative"] += g.informative
        c["all_correct"] += g.num_correct == len(g.acc)
        c["all_wrong"] += g.num_correct == 0
        c["responses"] += len(g.acc)
        c["correct"] += g.num_correct
        c["score_sum"] += sum(g.scores)
        c["reward_sum"] += sum(g.rewards)
        c["truncated"] += sum(g.truncated)
        c["response_tokens"] += g.tokens
        c["length_max"] = max(c["length_max"], max(g.lengths, default=0))
        c["reward_timeouts"] += g.reward_timeouts
        c["reward_errors"] += g.reward_errors
        c["tokens_generated"] += g.tokens_of_step(self.version)

    def commit_in_order(self, train_batch_size: int, stop_when_full: bool) -> None:
        """Take finished groups in submission order, up to the first one still generating."""
        while self.committed < len(self.order) and self.order[self.committed] in self.waiting:
            if stop_when_full and len(self.batch) >= train_batch_size:
                return  # the rest goes back to the queue (close_step)
            self.accept(self.waiting.pop(self.order[self.committed]), train_batch_size)
            self.committed += 1

    def accept(self, g: GroupMeta, train_batch_size: int) -> None:
        c = self.counts
        c["taken"] += 1
        c["taken_informative"] += g.informative
        if not g.informative:
            c["tokens_uninformative"] += g.tokens_of_step(self.version)
        elif len(self.batch) < train_batch_size:
            self.batch.append(g)
        else:
            self.surplus.append(g)

    # ---------------------------------------------------------------- estimates

    def informative_estimate(self, prior_frac: float, train_batch_size: int) -> float:
        """The informative fraction: earlier steps' estimate (prior_frac), updated by this step's groups taken so far.

        Only groups taken in order count (stream: the committed prefix; fill: whole rounds): the groups that
        finish first are the short ones, and short (easy) prompts are more often all correct, so counting
        early finishers would understate the fraction and over-submit.
        """
        c = self.counts
        prior = max(8.0, train_batch_size / 4)  # how many groups' worth of weight the history has
        p = (prior_frac * prior + c["taken_informative"]) / (prior + c["taken"])
        return min(1.0, max(p, 0.02))

    def groups_wanted(self, train_batch_size: int, p: float, stream_margin: float) -> int:
        """stream: groups to have in flight so the batch is expected to fill with stream_margin binomial standard
        deviations to spare (1.0: ~84% of steps need no late refill); p: the informative fraction estimate."""
        need = train_batch_size - len(self.batch) - sum(g.informative for g in self.waiting.values())
        if need <= 0:
            return 0
        # smallest m with m p - z sqrt(m p (1 - p)) >= need: a quadratic in sqrt(m)
        b = stream_margin * math.sqrt(p * (1 - p))
        root = (b + math.sqrt(b * b + 4 * p * need)) / (2 * p)
        return math.ceil(root * root)

    # ---------------------------------------------------------------- reports

    def skip_stats(self, explore: float) -> dict[str, float]:
        """Prompt memory's statistics (sampler.skip): explore is the exploration probability the step used."""
        c = self.counts
        stats = {
            "skip/skipped": c["skipped"],
            "skip/tokens_saved": c["tokens_saved"],
            "skip/explore": explore,
            "skip/explore_visits": c["explore_visits"],
        }
        if c["explore_visits"]:
            stats["skip/precision"] = c["explore_uninformative"] / c["explore_visits"]
        if c["groups"]:
            stats["skip/informative_frac_before"] = c["ht_informative"] / c["ht_groups"]
            stats["skip/informative_frac_after"] = c["informative"] / c["groups"]
        return stats

    def shortfall_reason(
        self, *, num_prompts: int, mode: str, max_gen_batches: int, gen_batch_size: int, train_batch_size: int
    ) -> str:
        c = self.counts
        if self.exhausted:
            when = f"after every one of the {num_prompts} prompts was tried in this step"
        elif mode == "fill":
            when = f"after {self.rounds} generation rounds (sampler.max_gen_batches={max_gen_batches})"
        else:
            when = (
                f"after {self.submitted} groups were generated (sampler.max_gen_batches x sampler.gen_batch_size = "
                f"{max_gen_batches * gen_batch_size})"
            )
        frac = c["informative"] / c["groups"] if c["groups"] else 0.0
        return (
            f"dynamic sampling: {when}, only {len(self.batch)} of sampler.train_batch_size={train_batch_size} "
            f"informative groups were found ({int(c['carried_in'])} carried over; {int(c['informative'])} of "
            f"{int(c['groups'])} groups generated this step were informative, fraction {frac:.3f}; "
            f"{int(c['all_correct'])} all correct, {int(c['all_wrong'])} all wrong). Raise sampler.max_gen_batches "
            f"or sampler.gen_batch_size, lower sampler.train_batch_size, set sampler.on_shortfall=train, or use a "
            f"dataset whose difficulty suits the policy."
        )

    def staleness_stats(self, max_staleness: int) -> dict[str, float]:
        """Trained tokens by staleness (versions behind this step's), tokens_0 .. tokens_K with K at least
        max_staleness, and the largest and 99th-percentile staleness of a trained token."""
        hist: dict[int, int] = {}
        for g in self.batch:
            for i, n in enumerate(g.version_tokens):
                if n:
                    k = self.version - (g.version + i)
                    hist[k] = hist.get(k, 0) + n
        top = max(hist, default=0)
        stats = {f"staleness/tokens_{k}": float(hist.get(k, 0)) for k in range(max(top, max_staleness) + 1)}
        total, seen, p99 = sum(hist.values()), 0, 0
        for k in sorted(hist):
            seen += hist[k]
            if seen >= 0.99 * total:
                p99 = k
                break
        return stats | {"staleness/max": float(top), "staleness/p99": float(p99)}

    def stats(
        self,
        shortfall: Optional[str],
        *,
        carried_out: int,
        paused: int,
        epoch: int,
        informative_estimate: float,
        max_staleness: int,
    ) -> dict[str, float]:
        """The step's statistics (carried_out, paused, epoch: the scheduler's state after settling)."""
        c = self.counts
        stats = {
            "sampler/gen_rounds": float(self.rounds),
            "sampler/groups_submitted": float(self.submitted),
            "sampler/groups_generated": c["groups"],
            "sampler/carried_in": c["carried_in"],
            "sampler/carried_out": float(carried_out),
            "sampler/paused": float(paused),
            "sampler/resumed": c["resumed"],
            "sampler/requeued": c["requeued"],
            "sampler/stale_dropped": c["groups_stale"],
            "sampler/batch_groups": float(len(self.batch)),
            "sampler/shortfall": float(shortfall is not None),
            "sampler/epoch": float(epoch),
            "sampler/in_flight_max": float(self.max_in_flight),
            "sampler/informative_frac_estimate": informative_estimate,
            "tokens/generated": c["tokens_generated"],
            "tokens/trained": c["tokens_trained"],
            "tokens/trained_total": c["tokens_trained_total"],
            "tokens/uninformative": c["tokens_uninformative"],
            "tokens/wasted": c["tokens_wasted"],
            "tokens/wasted_earlier": c["tokens_wasted_earlier"],
            "tokens/carried": c["tokens_carried"],
            "tokens/paused": c["tokens_paused"],
        }
        stats |= self.staleness_stats(max_staleness)
        if not c["groups"]:
            return stats  # served from the carry: no fresh rollout, so no rates (a 0 would read as a collapse)
        responses = c["responses"]
        return stats | {
            "sampler/informative": c["informative"],
            "sampler/informative_frac": c["informative"] / c["groups"],
            "sampler/all_correct": c["all_correct"],
            "sampler/all_wrong": c["all_wrong"],
            "reward/mean": c["reward_sum"] / responses,
            "reward/score_mean": c["score_sum"] / responses,
            "reward/acc": c["correct"] / responses,
            "reward/timeouts": c["reward_timeouts"],
            "reward/errors": c["reward_errors"],
            "response/length_mean": c["response_tokens"] / responses,
            "response/length_max": c["length_max"],
            "response/truncated_frac": c["truncated"] / responses,
        }
