"""Rule-based rewards: answer verifiers and the process pool that runs them under time and memory limits."""

from megatron_dapo.reward.answers import VerifyResult, extract_dapo_answer, gsm8k_answer, normalize_answer
from megatron_dapo.reward.hybrid import hybrid_verify
from megatron_dapo.reward.hybrid_parse import extract_final_answer
from megatron_dapo.reward.pool import RewardPool
from megatron_dapo.reward.registry import VERIFIER_NAMES, select_verifier
from megatron_dapo.reward.tickets import RewardBatch
from megatron_dapo.reward.verifiers import dapo_verify, math_verify_verify

__all__ = [
    "VERIFIER_NAMES",
    "RewardBatch",
    "RewardPool",
    "VerifyResult",
    "dapo_verify",
    "extract_dapo_answer",
    "extract_final_answer",
    "gsm8k_answer",
    "hybrid_verify",
    "math_verify_verify",
    "normalize_answer",
    "select_verifier",
]
