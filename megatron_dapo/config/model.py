"""The model section: the Megatron-Core policy (architecture source, dtype, layers, MoE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dapo.choices import (
    ATTENTION_IMPLS,
    DTYPES,
    FP8_FORMATS,
    FP8_RECIPES,
    MOE_DISPATCHERS,
    MOE_ROUTER_DTYPES,
    RECOMPUTE_METHODS,
    ROUTER_REPLAYS,
    TRANSFORMER_IMPLS,
)
from megatron_dapo.config.base import check


@dataclass
class ModelConfig:
    """The Megatron-Core policy."""

    hf_path: str = ""
    """Hugging Face model directory: its config.json gives the architecture (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE or
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
    router_replay: str = "none"
    """Mixture-of-experts models: whose expert choices the trainer's forward passes use. 'none': its own router's.
    'r2': the old-logprob pass records its routes and the train step replays them (the update sees the experts the
    old policy used). 'r3' (Rollout Routing Replay): the rollout engine's routes for every position of each sample,
    prompt and response, replayed in the old-logprob, reference and train passes, so a token is scored through the
    experts that sampled it. Ignored for dense models."""
    moe_router_dtype: Optional[str] = None
    """The precision of the router's logits, softmax and the experts' weighted sum: null = the model's dtype (as
    Hugging Face and vLLM compute the logits, so the trainer ties as the engine does), 'fp32' or 'fp64' (NeMo-RL's
    MoE recipes: fewer flips between near-equal experts)."""
    moe_token_dispatcher: str = "alltoall"
    """How tokens reach the ranks that hold their experts: 'alltoall' (each rank sends each token to its experts'
    ranks only) or 'allgather' (every rank of the expert group gathers every token). The same results either way."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing (Switch) auxiliary loss, averaged over the mini-batch's tokens; 0 = off. Off
    by default, as the MoE RL recipes of verl (mbridge's Qwen3-MoE: moe_router_load_balancing_type 'none', "default
    None for RL") and NeMo-RL (moe_router_load_balancing_type 'none') run: a balancing term pulls the router away
    from what the reward asks and makes the trainer's routes drift from the engine's. Its value is logged as
    moe/load_balancing_loss either way."""
    moe_z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (ST-MoE: the mean squared logsumexp of the router logits); 0 = off, as in
    the same recipes (neither sets it). Logged as moe/z_loss when on."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        check(self.dtype in DTYPES, "model.dtype", self.dtype, f"one of {DTYPES}")
        if self.fp8 is not None:
            check(self.fp8 in FP8_FORMATS, "model.fp8", self.fp8, f"one of {FP8_FORMATS} or null")
        check(self.fp8_recipe in FP8_RECIPES, "model.fp8_recipe", self.fp8_recipe, f"one of {FP8_RECIPES}")
        if self.recompute is not None:
            check(
                self.recompute in RECOMPUTE_METHODS,
                "model.recompute",
                self.recompute,
                f"one of {RECOMPUTE_METHODS} or null",
            )
        check(
            self.recompute_num_layers >= 1, "model.recompute_num_layers", self.recompute_num_layers, "an integer >= 1"
        )
        check(
            self.transformer_impl in TRANSFORMER_IMPLS,
            "model.transformer_impl",
            self.transformer_impl,
            f"one of {TRANSFORMER_IMPLS}",
        )
        check(self.attention in ATTENTION_IMPLS, "model.attention", self.attention, f"one of {ATTENTION_IMPLS}")
        check(
            self.router_replay in ROUTER_REPLAYS, "model.router_replay", self.router_replay, f"one of {ROUTER_REPLAYS}"
        )
        if self.moe_router_dtype is not None:
            check(
                self.moe_router_dtype in MOE_ROUTER_DTYPES,
                "model.moe_router_dtype",
                self.moe_router_dtype,
                f"one of {MOE_ROUTER_DTYPES} or null",
            )
        check(
            self.moe_token_dispatcher in MOE_DISPATCHERS,
            "model.moe_token_dispatcher",
            self.moe_token_dispatcher,
            f"one of {MOE_DISPATCHERS}",
        )
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            check(getattr(self, key) >= 0, f"model.{key}", getattr(self, key), "a value >= 0")
