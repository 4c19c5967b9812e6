"""The algorithm section: the DAPO objective, its clip, advantages, overlong shaping and KL term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.choices import ADV_NORMS, KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_IMPLS, OVERLONG_SHAPES
from megatron_dapo.config.base import check


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
        check(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            "an integer >= 2 (a group of one has no variance)",
        )
        check(
            0 <= self.eps_low < 1,
            "algorithm.eps_low",
            self.eps_low,
            "a value in [0, 1): the ratio is clipped below at 1 - eps_low",
        )
        check(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, "a value >= 0")
        if self.dual_clip_c is not None:
            check(
                self.dual_clip_c > 1,
                "algorithm.dual_clip_c",
                self.dual_clip_c,
                "a value > 1, or null to turn dual clip off",
            )
        if self.tis_cap is not None:
            check(self.tis_cap > 0, "algorithm.tis_cap", self.tis_cap, "a value > 0, or null to turn truncated IS off")
        check(
            self.loss_agg_mode in LOSS_AGG_MODES,
            "algorithm.loss_agg_mode",
            self.loss_agg_mode,
            f"one of {LOSS_AGG_MODES}",
        )
        check(self.loss_impl in LOSS_IMPLS, "algorithm.loss_impl", self.loss_impl, f"one of {LOSS_IMPLS}")
        check(self.adv_eps > 0, "algorithm.adv_eps", self.adv_eps, "a value > 0")
        check(self.adv_norm in ADV_NORMS, "algorithm.adv_norm", self.adv_norm, f"one of {ADV_NORMS}")
        check(
            self.overlong_shape in OVERLONG_SHAPES,
            "algorithm.overlong_shape",
            self.overlong_shape,
            f"one of {OVERLONG_SHAPES}",
        )
        check(self.log_ratio_clamp > 0, "algorithm.log_ratio_clamp", self.log_ratio_clamp, "a value > 0")
        check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "a value >= 0 (0: no KL, no reference)")
        check(
            self.kl_estimator in KL_ESTIMATORS,
            "algorithm.kl_estimator",
            self.kl_estimator,
            f"one of {KL_ESTIMATORS}",
        )
        if self.overlong_punishment:
            check(
                self.overlong_penalty_factor >= 0,
                "algorithm.overlong_penalty_factor",
                self.overlong_penalty_factor,
                "a value >= 0",
            )
