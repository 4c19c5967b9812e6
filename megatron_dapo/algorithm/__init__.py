"""Pure tensor math of DAPO and its peers' objectives: no Megatron, no I/O, no distributed calls."""

from megatron_dapo.algorithm.advantages import group_advantages
from megatron_dapo.algorithm.filters import informative_groups
from megatron_dapo.algorithm.kl import kl_estimate, kl_penalized_rewards
from megatron_dapo.algorithm.overlong import excess_overlong_penalty, overlong_filter_mask, soft_overlong_punishment
from megatron_dapo.algorithm.policy_loss import (
    LOSS_AGG_MODES,
    STAT_KEYS,
    PolicyLoss,
    loss_metrics,
    loss_normalizer,
    policy_loss,
    reduce_stats,
)
from megatron_dapo.algorithm.rollout_correction import (
    MISMATCH_KEYS,
    Correction,
    correction_weight,
    mismatch_metrics,
    rollout_mismatch_sums,
)

__all__ = [
    "LOSS_AGG_MODES",
    "MISMATCH_KEYS",
    "STAT_KEYS",
    "Correction",
    "PolicyLoss",
    "correction_weight",
    "excess_overlong_penalty",
    "group_advantages",
    "informative_groups",
    "kl_estimate",
    "kl_penalized_rewards",
    "loss_metrics",
    "loss_normalizer",
    "mismatch_metrics",
    "overlong_filter_mask",
    "policy_loss",
    "reduce_stats",
    "rollout_mismatch_sums",
    "soft_overlong_punishment",
]
