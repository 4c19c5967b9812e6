"""The policy's sections: optim, model, parallel and train (the optimizer, the Megatron-Core model, its
parallel layout, and how a mini-batch runs through it)."""

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
        check(self.lr > 0, "optim.lr", self.lr, "a value > 0")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a value >= 0")
        check(self.clip_grad > 0, "optim.clip_grad", self.clip_grad, "a value > 0")
        check(self.mini_batch_size >= 1, "optim.mini_batch_size", self.mini_batch_size, "an integer >= 1")


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
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each MoE layer's experts are split over this many ranks,
    which hold different data (the experts' data parallel is world / (pp x ep x etp)); it must divide the number of
    experts and world / pp."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's weights split over this many ranks. 1 (each expert whole) as the
    Qwen3-MoE recipes of verl, slime and NeMo-RL run; at most tp."""
    sequence_parallel: bool = True
    """Sequence parallel with tp > 1: each TP rank holds a share of the positions between the tensor-parallel layers
    (Transformer Engine's norms, or on the local spec model/provider.py's SequenceParallelRMSNorm). A MoE model with
    tp > 1 needs it (Megatron's MoE layer refuses to train without)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""

    def validate(self) -> None:
        """Raise ConfigError for a value of this section that cannot run."""
        for key in ("tp", "pp", "cp", "ep", "etp"):
            check(getattr(self, key) >= 1, f"parallel.{key}", getattr(self, key), "an integer >= 1")
        if self.vpp is not None:
            check(
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
        check(
            self.max_tokens_per_microbatch >= 1,
            "train.max_tokens_per_microbatch",
            self.max_tokens_per_microbatch,
            "an integer >= 1",
        )
        check(
            self.max_tokens_per_forward >= 0,
            "train.max_tokens_per_forward",
            self.max_tokens_per_forward,
            "an integer >= 0 (0 = train.max_tokens_per_microbatch)",
        )

    def microbatch_tokens(self, forward_only: bool) -> int:
        """The token budget of a pass: max_tokens_per_forward for a forward-only one (0: the train step's)."""
        return (forward_only and self.max_tokens_per_forward) or self.max_tokens_per_microbatch
