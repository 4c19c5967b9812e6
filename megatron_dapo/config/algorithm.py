"""The algorithm section: the objective (DAPO by default) and its clip, rollout correction, advantages, overlong
shaping and KL term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.algorithm.registry import CORRECTIONS, OBJECTIVES, Correction  # torch-free
from megatron_dapo.choices import ADV_NORMS, KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_IMPLS, OVERLONG_SHAPES
from megatron_dapo.config.base import check

__all__ = ["AlgorithmConfig", "Correction"]


@dataclass
class AlgorithmConfig:
    """The DAPO objective (paper section 3)."""

    group_size: int = 16
    """G: responses sampled per prompt. Must be >= 2: a group of one has no variance."""
    policy_loss: str = "dapo"
    """The objective (formulas in algorithm/objectives.py): 'dapo' (the paper's eq. 8: token-level ratio,
    clipped at [1 - eps_low, 1 + eps_high], dual clip optional); 'gspo' (GSPO, Zheng et al. 2025: the response's
    ratio, the geometric mean of its token ratios, clipped at [1 - gspo_eps_low, 1 + gspo_eps_high]; the paper
    averages per response: loss_agg_mode seq-mean-token-mean); 'gspo_token' (GSPO-token: the same value, each
    token's own gradient, for per-token advantages); 'cispo' (MiniMax-M1: every token's log-likelihood weighted
    by its ratio clipped to [1 - eps_low_is, 1 + eps_high_is] with no gradient through the weight)."""
    eps_low: float = 0.2
    """Clip-Higher lower bound: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.28
    """Clip-Higher upper bound: the ratio is clipped above at 1 + eps_high."""
    gspo_eps_low: float = 3e-4
    """GSPO's clip below: the response's ratio is clipped at 1 - gspo_eps_low (the GSPO paper's 3e-4)."""
    gspo_eps_high: float = 4e-4
    """GSPO's clip above: at 1 + gspo_eps_high (the GSPO paper's 4e-4)."""
    eps_low_is: Optional[float] = None
    """CISPO's importance weight is clipped below at 1 - eps_low_is; null: no lower bound (MiniMax-M1 tunes only
    the upper one)."""
    eps_high_is: float = 4.0
    """CISPO's importance weight is capped at 1 + eps_high_is: 5.0, TRL's recommended cap for CISPO."""
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
    megatron_dapo.kernels: one read of the inputs; policy_loss 'dapo' only), or 'auto' (fused on CUDA tensors
    with 'dapo', the reference on CPU unless TRITON_INTERPRET=1 and for the other objectives, said once)."""
    adv_eps: float = 1e-6
    """Added to the group's standard deviation: A = (R - mean) / (std + adv_eps)."""
    adv_norm: str = "std"
    """'std': A = (R - mean) / (std + adv_eps) within the group (GRPO, DAPO); 'none': A = R - mean
    (Dr. GRPO: dividing by the std weighs groups whose rewards barely differ the most)."""
    log_ratio_clamp: float = 20.0
    """|logp - old_logp| is clamped to this before exp(), so huge differences never give inf/NaN."""
    rollout_correction: Optional[str] = None
    """How the rollout engine's policy differing from the trainer's is corrected, from each token's ratio
    w = exp(old_logp - rollout_logp) and a response's geometric mean W (algorithm/rollout_correction.py has each
    formula): 'token_tis' (min(w, tis_cap)), 'seq_tis' (min(W, tis_cap) on the response's tokens), 'token_mask' /
    'seq_mask' (tokens / responses whose w / W leaves [rollout_mask_low, rollout_mask_high] get no gradient),
    'icepop' (tokens with w in [icepop_low, icepop_high] weighted by w, the rest none), 'none'. Masked tokens stay
    in the loss's divisor. null: 'token_tis' when a cap is in force (tis_cap, or FP8 rollouts'
    rollout.quantization_tis_cap), else 'none'. Sources: truncated IS from Yao et al. 2025 ("Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"), the sequence and masked modes from verl's rollout
    correction (Liu, Li et al. 2025, "When Speed Kills Stability"), IcePop from Ring-1T (inclusionAI 2025)."""
    tis_cap: Optional[float] = None
    """The cap of truncated importance sampling ('token_tis' and 'seq_tis'): each token's loss is weighted by
    min(w, tis_cap). Set alone, it turns 'token_tis' on."""
    rollout_mask_low: float = 0.5
    """'token_mask' and 'seq_mask': the lowest kept ratio (inclusive; verl's lower threshold, 1 / 2.0)."""
    rollout_mask_high: float = 2.0
    """'token_mask' and 'seq_mask': the highest kept ratio (inclusive; verl's threshold 2.0)."""
    icepop_low: float = 0.5
    """'icepop': the lowest kept ratio (inclusive; Ring-1T's IcePop keeps [0.5, 5])."""
    icepop_high: float = 5.0
    """'icepop': the highest kept ratio (inclusive; Ring-1T's IcePop, verl's preset "0.5_5.0")."""
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

    def clip_bounds(self) -> tuple[Optional[float], float]:
        """(eps_low, eps_high) of the objective in force, read from its keys (DAPO's, GSPO's or CISPO's)."""
        objective = OBJECTIVES[self.policy_loss]
        return getattr(self, objective.low), getattr(self, objective.high)

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
        check(self.policy_loss in OBJECTIVES, "algorithm.policy_loss", self.policy_loss, f"one of {tuple(OBJECTIVES)}")
        objective = OBJECTIVES[self.policy_loss]
        check(0 <= self.gspo_eps_low < 1, "algorithm.gspo_eps_low", self.gspo_eps_low, "a value in [0, 1)")
        check(self.gspo_eps_high >= 0, "algorithm.gspo_eps_high", self.gspo_eps_high, "a value >= 0")
        if self.eps_low_is is not None:
            check(0 <= self.eps_low_is <= 1, "algorithm.eps_low_is", self.eps_low_is, "a value in [0, 1], or null")
        check(self.eps_high_is >= 0, "algorithm.eps_high_is", self.eps_high_is, "a value >= 0")
        if self.rollout_correction is not None:
            check(
                self.rollout_correction in CORRECTIONS,
                "algorithm.rollout_correction",
                self.rollout_correction,
                f"one of {tuple(CORRECTIONS)}, or null",
            )
        for low, high in dict.fromkeys((c.low, c.high) for c in CORRECTIONS.values() if c.low is not None):
            lo, hi = getattr(self, low), getattr(self, high)
            check(0 <= lo, f"algorithm.{low}", lo, "a ratio >= 0")
            check(hi > lo, f"algorithm.{high}", hi, f"a ratio above algorithm.{low}={lo}")
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
        if self.loss_impl == "fused":
            fused = " and ".join(f"{name}'s" for name, o in OBJECTIVES.items() if o.fused)
            check(
                objective.fused,
                "algorithm.loss_impl",
                self.loss_impl,
                f"'auto' or 'reference' with policy_loss={self.policy_loss!r} (the fused kernel computes {fused})",
            )
        if self.dual_clip_c is not None:
            check(
                objective.dual_clip,
                "algorithm.dual_clip_c",
                self.dual_clip_c,
                f"null with policy_loss={self.policy_loss!r} (dual clip caps DAPO's token loss)",
            )
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
