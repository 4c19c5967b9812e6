"""The allowed values of the config's string fields: a leaf that imports only the torch-free registry of objectives
and rollout corrections (algorithm/registry.py, filled where each is defined).

The config validates against them and the modules that act on them import them from here, so reading a
config loads no torch, Triton or verifier code.
"""

import megatron_dapo.algorithm.objectives  # noqa: F401 (importing them fills the registry)
import megatron_dapo.algorithm.rollout_correction  # noqa: F401
from megatron_dapo.algorithm.registry import CORRECTIONS, OBJECTIVES

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""algorithm.loss_agg_mode: DAPO's token-level mean, GRPO's per-sequence mean of token means, the mean over
responses of their token sums, or Dr. GRPO's token sums over a constant (responses x max_response_length)."""

ADV_NORMS = ("std", "none")
"""algorithm.adv_norm: GRPO's and DAPO's (R - mean) / (std + eps), or Dr. GRPO's R - mean."""

OVERLONG_SHAPES = ("buffer", "excess")
"""algorithm.overlong_shape: the paper's penalty ramp over the buffer below the limit, or the seed notes' penalty
proportional to the excess over a soft maximum."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""The per-token estimators of KL(pi || pi_ref) (algorithm/kl.py)."""

POLICY_LOSSES = tuple(OBJECTIVES)
"""algorithm.policy_loss: the built-in objectives (algorithm/objectives.py registers each): DAPO's token-level
decoupled clip, GSPO's sequence-level ratio and clip (Zheng et al. 2025) and its per-token variant, CISPO's
clipped, stop-gradient importance weight on every token's log-likelihood (MiniMax-M1). The config validates
against the registry itself, so an objective registered later (a test's) is accepted too."""

ROLLOUT_CORRECTIONS = tuple(CORRECTIONS)
"""algorithm.rollout_correction: the built-in modes (algorithm/rollout_correction.py registers each), how the
rollout engine's policy differing from the trainer's is corrected: truncated IS per token or per sequence, masking tokens or sequences whose ratio
leaves the bounds, IcePop's two-sided token masking, or nothing."""

LOSS_IMPLS = ("auto", "reference", "fused")
"""algorithm.loss_impl: fused where the kernel runs, the PyTorch reference, or the fused Triton kernel ('auto' resolves
to one of the other two at start-up)."""

RESOLVED_LOSS_IMPLS = tuple(i for i in LOSS_IMPLS if i != "auto")
"""What algorithm.loss_impl resolves to: the implementations themselves."""

DATASET_FORMATS = ("auto", "dapo", "gsm8k")
"""data.format: the row schemas the prompt datasets read."""

DATASET_SCHEMAS = tuple(f for f in DATASET_FORMATS if f != "auto")
"""The row schemas themselves ('auto' picks one of them per file)."""

BAD_ROW_POLICIES = ("error", "skip")
"""data.on_bad_row: stop at a malformed row, or count and skip it."""

SAMPLER_MODES = ("stream", "fill", "dynamic_bs")
"""sampler.mode: how informative groups are found."""

ROUND_SAMPLER_MODES = ("fill", "dynamic_bs")
"""The sampler modes that generate in rounds of gen_batch_size (dynamic_bs: train_batch_size) prompts, where 'stream'
keeps the engines full."""

SHORTFALL_POLICIES = ("error", "train")
"""sampler.on_shortfall: what a step does when the generation cap cannot fill its batch."""

VERIFIER_NAMES = ("auto", "dapo", "math_verify", "hybrid")
"""reward.verifier's built-in names (a 'package.module:function' is also accepted)."""

VERIFIERS = tuple(v for v in VERIFIER_NAMES if v != "auto")
"""The built-in verifiers themselves ('auto' picks one of them per data source)."""

MATH_VERIFY_USERS = ("auto", "math_verify", "hybrid")
"""reward.verifier names that may call math-verify (its import is paid once in each reward worker)."""

ROLLOUT_QUANTIZATIONS = ("none", "fp8")
"""rollout.quantization: the rollout engine's weights as the policy holds them, or per-block FP8 (rollout/quantize.py)."""

ATTENTION_IMPLS = ("auto", "sdpa", "unfused")
"""model.attention: the core attention of the layers. 'sdpa': torch's fused scaled_dot_product_attention
(model/attention.py; takes packed rows); 'unfused': Megatron-Core's local DotProductAttention, which materialises
the [heads, s, s] scores; 'auto': Transformer Engine's fused attention under TE, else 'sdpa'."""

DTYPES = ("bf16", "fp16", "fp32")
"""model.dtype: the parameter and compute precision (model/dtypes.py maps them to torch's and Hugging Face's names)."""

FP8_FORMATS = ("e4m3", "hybrid")
"""model.fp8: Transformer Engine's FP8 formats (null: no FP8)."""

FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
"""model.fp8_recipe: how Transformer Engine scales FP8 tensors."""

RECOMPUTE_METHODS = ("selective", "full")
"""model.recompute: the attention core only, or whole layers (null: no activation recompute)."""

MOE_ROUTER_DTYPES = ("fp32", "fp64")
"""model.moe_router_dtype: the precision of the router's logits, softmax and expert weights (null: the model's dtype,
as Hugging Face and vLLM compute them)."""

MOE_DISPATCHERS = ("alltoall", "allgather")
"""model.moe_token_dispatcher: how tokens reach the ranks holding their experts (Megatron-Core's dispatchers)."""

ROUTER_REPLAYS = ("none", "r2", "r3")
"""model.router_replay: the trainer's router picks the experts itself; R2, the old-logprob pass's routes replayed in
the train step; R3, the rollout engine's routes replayed in every trainer forward."""

TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
"""model.transformer_impl: the layer spec, Transformer Engine's or Megatron-Core's local one."""

PIPELINE_MODES = ("colocated", "async")
"""pipeline.mode: every process trains and generates in turn, or the rollout and train sides are split."""

WEIGHTS_BACKENDS = ("auto", "nccl", "gloo")
"""pipeline.weights_backend: the process group that carries each weight update to the rollout side."""
