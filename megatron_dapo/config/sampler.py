"""The sampler section: the dynamic-sampling loader, its modes, admission and prompt memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.choices import SAMPLER_MODES, SHORTFALL_POLICIES
from megatron_dapo.config.base import check


@dataclass
class SamplerConfig:
    """The dynamic-sampling loader (paper section 3.2): how prompt groups are generated until a batch is full."""

    train_batch_size: int = 512
    """Informative prompt groups per rollout step (512 prompts x 16 responses in the paper)."""
    mode: str = "stream"
    """'stream': prompt groups flow through the engines one at a time, on demand, and are taken in
    submission order until train_batch_size informative groups are found; what is still generating
    then is aborted (prompts requeued) or, with partial_rollout, paused. 'fill' (verl's DAPO recipe):
    generation rounds of gen_batch_size prompts, each generated to its end, then filtered. 'dynamic_bs'
    (AReaL): one round of train_batch_size prompts, trained on whatever it accepted."""
    gen_batch_size: int = 1536
    """fill: prompts per generation round (3 x train_batch_size, as verl's recipe). stream: the unit of
    the generation cap (max_gen_batches x gen_batch_size groups per step)."""
    max_gen_batches: int = 10
    """The generation cap per rollout step: fill rounds, or stream groups in units of gen_batch_size;
    running into it is a shortfall (see on_shortfall). 0 = no cap (a step still ends once every prompt
    of the dataset has been tried in it)."""
    carry_surplus: bool = True
    """fill and partial_rollout: informative groups found beyond train_batch_size are trained in the
    next step (1 version stale: fill needs max_staleness >= 1); false drops them, as verl's recipe does. (stream
    without partial rollout never carries: it requeues everything behind the batch's last group, since
    keeping what happened to finish would favour short responses.)"""
    partial_rollout: bool = False
    """stream only. When the batch is full, pause the groups still generating instead of aborting them:
    they continue after the weight sync from their tokens so far, every token tagged with the policy
    version that sampled it, and groups are accepted as they complete. Faster (no step waits for its
    longest response); a group once started is trained or rejected on its own outcome, so its tokens can
    be several versions old (reported as staleness/max and staleness/p99), corrected by truncated
    importance sampling or another rollout correction (algorithm.tis_cap or algorithm.rollout_correction must
    be set)."""
    max_staleness: int = 1
    """eta, as AReaL's: how many batches generation may run ahead of training. With partial_rollout a
    group is started only while the informative groups found and not yet trained, plus the groups generating
    weighted by the estimated informative fraction, stay within (1 + max_staleness) x train_batch_size; a
    started group is never dropped for its age (the bound is on starts, not on token age). fill and
    dynamic_bs: 0 drops the surplus instead of carrying it a version on. 0 = start only what this batch
    needs. pipeline.mode=async: also how many collected batches the rollout controller may hold untrained
    (each counts as a whole batch started), so at 1 the next batch is collected while one trains."""
    drop_stale: bool = False
    """partial_rollout only: the pre-admission rule instead. Engines are kept full, and carried or paused
    groups whose tokens would be more than max_staleness versions old are dropped and their prompts
    requeued. It drops the longest groups, so it trains short responses: on the long-tailed script of
    tests/test_dynamic_sampling.py at max_staleness=1 the mean trained length is 15.5 tokens against fill's
    21.7 (-29%; 16.5 at 2), and at paper scale it drops 1.3-9.3% of the generated tokens (the simulator)."""
    engine_sequences: int = 128
    """stream: samples each engine keeps generating or queued (running and waiting, counted per sample, so
    an engine finishing a group's last straggler has room for new ones). New groups go to the engine with the
    most room. Set it to about what an engine's KV cache holds at once: 128 for Qwen2.5-32B on 4 x H100 at
    the paper's lengths (~110 sequences fit at ~6k tokens; tools/bench_sampler.py); more only queues samples
    inside vLLM, where KV pressure preempts them. partial_rollout keeps every engine this full, as far as
    admission (max_staleness) allows."""
    stream_margin: float = 0.0
    """stream: binomial standard deviations of informative groups to keep in flight beyond what the batch is
    expected to need. More: fewer late refills; less: fewer groups behind the batch to throw away. 0 was
    best at the paper's scale in the simulator (tools/bench_sampler.py): as fast as 1, with less waste."""
    tick_steps: int = 32
    """stream: engine steps between the sampler's decisions. Finished groups are scored while the next tick
    generates; every rank decides on what was gathered at the tick, never on wall-clock time, so ranks wait
    for each other there (fill and dynamic_bs gather once per round instead)."""
    lockstep: Optional[bool] = None
    """stream, several engines in several processes: true makes every engine run exactly tick_steps
    engine steps per tick, so the slowest engine sets the tick and the others wait for it (every decision
    a function of engine steps: reproducible). false lets an engine that has run its steps keep generating
    until every process has run its own (no engine idles at the tick; what a tick observes then depends on
    timing; sampler/free_steps counts those steps). None: false with pipeline.mode=async at max_staleness >= 1
    (already timing-dependent), true otherwise."""
    on_shortfall: str = "error"
    """When the cap (or the dataset) runs out before the batch is full: 'error' stops with a message
    saying what was found (the default: a DAPO step always has train_batch_size groups, so a short
    batch silently changes the recipe); 'train' trains on what was found, with a warning and the
    sampler/shortfall metric, if at least min_groups were found."""
    min_groups: int = 1
    """With on_shortfall=train: the fewest groups worth a step (fewer is an error)."""
    filter: Optional[str] = None
    """A user function 'package.module:function' of a Group (prompt, responses, scores, acc, shaped
    rewards) returning True to train on it, in place of the informative test (AReaL's dynamic_filter_fn).
    Imported and checked at start-up."""
    skip: bool = False
    """Prompt memory (selective rollout, after GRESO): before generating a prompt, look at its record of past
    groups; one whose last z groups were all correct (or all wrong) is deferred to a later epoch with probability
    1 - e^z, e the exploration probability, which adapts each step toward skip_target. Generation goes to the
    prompts likely to be informative: less generation per trained group, at the price of sampling easy and hopeless
    prompts less often than the dataset holds them (and the rest more often). It pays where outcomes persist:
    simulated at paper scale, 1.7-1.9x less generation time per step at an informative fraction of 0.25, 1.2-1.3x
    at 0.5. It does not pay in the CPU demo, whose outcomes barely persist: about as many tokens per trained token
    and lower held-out accuracy (benchmarks/RESULTS.md). Off in the paper's recipe and in the demo."""
    skip_target: float = 0.75
    """The informative fraction of generated groups that skipping steers toward: a step below it lowers the
    exploration probability by skip_adapt (skip more), a step above it raises it (skip less)."""
    skip_adapt: float = 0.05
    """How far the exploration probability moves per rollout step; it starts at 1 (no skipping)."""
    skip_min_explore: float = 0.05
    """The lowest exploration probability: a prompt after one uninformative group is generated with at least this
    probability, so a skip is never certain."""
    skip_max_consecutive: int = 4
    """The exploration floor as a bound: a prompt deferred this many times in a row is generated the next time it
    comes up, so every prompt is generated at least once every skip_max_consecutive + 1 epochs and a forgotten skill
    (or a newly learnt one) is noticed. Skipping makes epochs pass faster, so on a small dataset (an epoch a step)
    these forced visits can be most of what is generated: raise it there."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(0 < self.skip_target <= 1, "sampler.skip_target", self.skip_target, "a fraction in (0, 1]")
        check(0 < self.skip_adapt <= 1, "sampler.skip_adapt", self.skip_adapt, "a value in (0, 1]")
        check(0 < self.skip_min_explore <= 1, "sampler.skip_min_explore", self.skip_min_explore, "a value in (0, 1]")
        check(
            self.skip_max_consecutive >= 0,
            "sampler.skip_max_consecutive",
            self.skip_max_consecutive,
            "an integer >= 0 (0 = never skip)",
        )
        check(self.train_batch_size >= 1, "sampler.train_batch_size", self.train_batch_size, "an integer >= 1")
        check(self.gen_batch_size >= 1, "sampler.gen_batch_size", self.gen_batch_size, "an integer >= 1")
        check(
            self.max_gen_batches >= 0, "sampler.max_gen_batches", self.max_gen_batches, "an integer >= 0 (0 = no cap)"
        )
        check(self.mode in SAMPLER_MODES, "sampler.mode", self.mode, f"one of {SAMPLER_MODES}")
        check(self.max_staleness >= 0, "sampler.max_staleness", self.max_staleness, "an integer >= 0")
        check(self.tick_steps >= 1, "sampler.tick_steps", self.tick_steps, "an integer >= 1")
        check(self.stream_margin >= 0, "sampler.stream_margin", self.stream_margin, "a value >= 0")
        check(
            self.on_shortfall in SHORTFALL_POLICIES,
            "sampler.on_shortfall",
            self.on_shortfall,
            f"one of {SHORTFALL_POLICIES}",
        )
        check(
            1 <= self.min_groups <= self.train_batch_size,
            "sampler.min_groups",
            self.min_groups,
            f"an integer in [1, sampler.train_batch_size={self.train_batch_size}]",
        )
        if self.partial_rollout:
            check(self.mode == "stream", "sampler.partial_rollout", True, f"sampler.mode=stream (not {self.mode!r})")
        if self.drop_stale:
            check(
                self.partial_rollout,
                "sampler.drop_stale",
                True,
                "sampler.partial_rollout=true (it drops paused groups)",
            )
            check(
                self.max_staleness >= 1,
                "sampler.max_staleness",
                self.max_staleness,
                "an integer >= 1 with sampler.drop_stale=true (a paused group is trained a version later)",
            )
