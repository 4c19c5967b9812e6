"""How far the rollout engine's policy is from the trainer's, per response and summed for the logs: the token
ratios w = exp(old_logp - rollout_logp) of rollout_correction.py, their k3 KL estimate and what the correction in
force capped or masked."""

from __future__ import annotations

import torch

from megatron_dapo.algorithm.kl import k3
from megatron_dapo.algorithm.registry import CORRECTIONS, Correction
from megatron_dapo.algorithm.rollout_correction import correction_weight, rollout_log_ratio

NO_CORRECTION = Correction()
MISMATCH_KEYS = ("abs_sum", "kl_sum", "corrected", "tokens", "corrected_seqs", "seqs")


def rollout_mismatch_sums(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    correction: Correction = NO_CORRECTION,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """How far the rollout engine's policy is from the training policy, over one response's tokens.

    old_logp, rollout_logp: [N] the response's logprobs under the training policy (recomputed) and the engine (as
    sampled). With w = exp(old_logp - rollout_logp) per token, returns [6] float64 sums (MISMATCH_KEYS): sum
    |old_logp - rollout_logp|; sum (w - 1) - log w, the k3 estimate of KL(pi_rollout || pi_train) (>= 0 per token,
    unbiased under the rollout's samples); the tokens the correction capped or masked; N; 1 if it capped or
    masked any token of the response; 1 (the response). Sums, so ranks, micro-batches and responses add them.
    """
    _, corrected = correction_weight(old_logp, rollout_logp, correction, log_ratio_clamp)
    log_w = rollout_log_ratio(old_logp, rollout_logp, log_ratio_clamp)
    return torch.tensor(
        [
            float(log_w.abs().sum()),
            float(k3(log_w).sum()),
            float(corrected.sum()),
            float(log_w.numel()),
            float(corrected.any()),
            1.0,
        ],
        dtype=torch.float64,
    )


def mismatch_metrics(sums: torch.Tensor, correction: Correction = NO_CORRECTION) -> dict[str, float]:
    """Means for the logs from rollout_mismatch_sums' [6] totals (zero when no token had both logprobs):
    rollout/logp_mismatch_mean and rollout/kl per token; with a correction on, rollout/corrected_frac (the tokens
    capped or masked) and, for a sequence mode, rollout/corrected_seq_frac (the responses)."""
    abs_sum, kl_sum, corrected, tokens, corrected_seqs, seqs = (float(x) for x in sums)
    out = {"rollout/logp_mismatch_mean": abs_sum / max(tokens, 1.0), "rollout/kl": kl_sum / max(tokens, 1.0)}
    if correction.mode != "none":
        out["rollout/corrected_frac"] = corrected / max(tokens, 1.0)
    if CORRECTIONS[correction.mode].per_sequence:
        out["rollout/corrected_seq_frac"] = corrected_seqs / max(seqs, 1.0)
    return out
