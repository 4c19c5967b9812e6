"""Peak GPU memory of one rank for a micro-batch of T tokens: what Megatron-Core holds, term by term.

Pure arithmetic (no torch), so the config's defaults and the example checks can use it anywhere. Bytes throughout;
GIB = 2^30. Read top to bottom:

1. Static memory: the rank's parameters (its tensor-parallel slice of its pipeline stage's layers, the embedding on
   the first stage, the output layer on the last) in the model's dtype, Megatron DDP's fp32 gradient buffer
   (grad_reduce_in_fp32), and the optimizer's fp32 main parameters and Adam's two moments, sharded over the data-
   (and context-) parallel ranks by the distributed optimizer. A mixture of experts splits in two: the dense part
   (attention, norms, embeddings, the dense layers' MLP, and each MoE layer's router, replicated on every rank) as
   above, and the experts: num_experts / ep of them per MoE layer on this rank, each one's fc1 (gate, up) and fc2
   split over etp, their optimizer state sharded over the experts' own data-parallel group (edp = world / (etp x ep x
   pp) ranks, which hold the same experts).
2. Activations saved for backward, per layer and per token of the local (or Transformer Engine) layer spec, one
   term per tensor autograd keeps: the norms' inputs, each linear's input, RoPE's cos/sin, the core attention's
   q/k/v (and its output and log-sum-exp for a fused kernel), SwiGLU's inputs. Megatron's unfused attention also
   keeps the [heads/tp, s, s] softmax probabilities, in fp32 and in the model's dtype: the O(s^2) term. Selective
   recompute drops the core attention's own tensors (keeping its inputs); full recompute keeps each layer's input
   only and rebuilds one layer at a time in the backward pass. A MoE layer's MLP terms are the router's (its input,
   the top-k indices and weights, the routing map) and the experts': Megatron's dispatcher sends each token to its k
   experts (all-to-all over ep, then gathered over etp), so this rank's experts hold k x etp copies of each of its
   tokens (balanced routing; expert_load scales that for the busiest rank), each with its SwiGLU over
   moe_intermediate / etp. The all-to-all's buffers are a working set of the layer, not kept.
3. The pipeline: 1F1B keeps the activations of up to pp micro-batches on the first stage (pp - r on stage r).
4. The vocabulary pass on the last stage: the [T, V/tp] logits and what the logprob (and entropy) code adds,
   for the old two-pass code (an fp32 copy of the logits and an fp32 exp saved for backward, entropy in a second
   chunked pass) or the one-pass code of model/logprobs.py (the logits saved by reference, 2^26-element fp32 chunks).
5. Working sets on top of what is held: the layer being computed (the unfused attention's scores in flight, the
   backward's gradients of them), a recomputed layer, the optimizer step's temporary.

The peak is the largest of these moments, over the pipeline stages. Checked against the six train-step peaks
measured on an H200 (benchmarks/RESULTS.md, tests/test_memory.py): within 1% with no fitted constant, so
FITTED_OVERHEAD is 0 and the headroom a budget keeps (BUDGET_HEADROOM) is for what the model leaves out: the CUDA
context, NCCL's buffers, the caching allocator's fragmentation (reserved minus allocated) and a sleeping vLLM. The
MoE terms are read from Megatron-Core 0.16's code (router.py, moe_utils.py, token_dispatcher.py, experts.py) and have
not been measured on a GPU.

Routing replay (R3) carries each sample's routes on the host (route_bytes_per_token: moe layers x k small integers a
position); the device holds each MoE layer's replayed top k as int64, the size of the indices a router that picks by
itself saves, so replay adds nothing there, except where those indices are not otherwise kept (replay=True): under
full recompute each layer's routes wait for its recomputed forward in backward, and a forward-only pass is fed every
layer's routes of its stage at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.perf import SHAPES

GIB = 1 << 30

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
"""Bytes per element of the model's dtype (config model.dtype) and of the router's (model.moe_router_dtype)."""
ATTENTIONS = ("unfused", "sdpa", "te")
"""'unfused': Megatron-Core's local DotProductAttention ([heads, s, s] scores); 'sdpa': model/attention.py's
torch scaled_dot_product_attention; 'te': Transformer Engine's fused attention (TE layer spec)."""
VOCAB_PATHS = ("onepass", "twopass")
"""'onepass': model/logprobs.py (one chunked read of the logits, saved by reference; backward writes a gradient of
the logits' dtype); 'twopass': the code before it (an fp32 copy of the logits, an fp32 exp saved for backward, the
entropy in a second chunked pass). The recorded GPU peaks ran 'twopass'."""
RECOMPUTES = (None, "selective", "full")

VOCAB_DIVISIBLE_BY = 128
"""model/provider.py's VOCAB_DIVISIBLE_BY (not imported: provider imports torch): the vocabulary is padded to a
multiple of this times tp."""
CHUNK_ELEMENTS = 1 << 26
"""model/logprobs.py's CHUNK_ELEMENTS (and the old token_entropy's): logits upcast to fp32 this many at a time."""
FITTED_OVERHEAD = 0
"""Bytes added to every peak for allocator overhead and workspaces, fitted to the measured peaks: none was needed
(the terms below land within 1% of all six without it)."""
BATCH_BYTES_PER_TOKEN = 48
"""The micro-batch's own tensors on the device: token, position and target ids (int64), masks, advantages, old,
rollout and reference logprobs, the logprobs out."""
ADAM_STEP_TEMP_BYTES = 4
"""torch.optim.AdamW (foreach; what Megatron uses without TE or Apex) allocates sqrt(v), one fp32 tensor per
main parameter, during the step."""
INDEX_BYTES = 8
"""Megatron's router and dispatcher index tokens and experts with int64 (torch.topk's indices, the permutation)."""
ROUTE_BYTES_MAX_EXPERTS = 256
"""model/routing.py's route_dtype (not imported: it imports torch): a route is 1 byte up to this many experts, else 2."""

BUDGET_HEADROOM = 0.10
"""Fraction of the device's memory a token budget leaves unplanned (see the module docstring)."""
BUDGET_STEP = 1024
"""Token budgets are multiples of this."""
ENGINE_MEMORY_SHARE = 0.5
"""The share of a GPU a colocated vLLM engine takes for its weights and KV cache while it generates
(VLLMEngine's gpu_memory_utilization, which the trainer's engine keeps): the policy's static memory stays resident
beside it, so a plan needs static_bytes + this share of the device within the budget."""

REFERENCE_CASE = dict(
    model="qwen2.5-1.5b",
    device_gib=80.0,
    headroom=BUDGET_HEADROOM,
    attention="sdpa",
    dtype="bf16",
    recompute=None,
    vocab_path="onepass",
)
"""The case config.TrainConfig's default token budgets are sized for: the Qwen2.5-1.5B shape of model/perf.py's
SHAPES (as perf.shape_arch builds it, which the preflight runs: untied embeddings, 0.23B parameters more than the
tied Hugging Face model, so on the safe side) alone on one 80 GiB GPU (tp = pp = cp = dp = 1), SDPA attention,
bf16, no recompute, the one-pass vocabulary code, one sequence filling the budget."""


@dataclass(frozen=True)
class Shape:
    """What the memory model needs of an architecture."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3's RMSNorm weights on each head's queries and keys: 2 x head_dim parameters a layer, replicated."""
    experts: int = 0
    """Routed experts of each MoE layer (0: a dense model)."""
    topk: int = 0
    """Experts each token goes to."""
    moe_ffn: int = 0
    """Each expert's SwiGLU width (moe_intermediate_size)."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the layers whose MLP is the experts (ModelArch.moe_layers)."""
    norm_topk: bool = True
    """The router's softmax over the top k only (norm_topk_prob); False: over every expert, then the top k."""


def shape_of(model, tied: bool | None = None) -> Shape:
    """A Shape from a ModelArch (model/arch.py), a name in model/perf.py's SHAPES, or a SHAPES tuple (hidden, ffn,
    layers, heads, kv_heads, vocab). A SHAPES tuple is a Qwen2 (QKV bias), untied as perf.shape_arch builds it unless
    `tied` says otherwise; a SHAPES dict is a config.json's fields."""
    if isinstance(model, str):
        model = SHAPES[model]
    if isinstance(model, tuple):
        h, ffn, layers, heads, kv, vocab = model
        return Shape(h, ffn, layers, heads, kv, h // heads, vocab, bool(tied), True)
    if isinstance(model, dict):
        model = ModelArch.from_hf_config(model, source="model/perf.py SHAPES")
    return Shape(
        model.hidden_size,
        model.intermediate_size,
        model.num_layers,
        model.num_attention_heads,
        model.num_key_value_heads,
        model.head_dim,
        model.vocab_size,
        model.tie_word_embeddings if tied is None else tied,
        model.qkv_bias,
        qk_norm=model.qk_layernorm,
        experts=model.num_experts,
        topk=model.num_experts_per_tok,
        moe_ffn=model.moe_intermediate_size,
        moe_layers=tuple(model.moe_layers) if model.is_moe else (),
        norm_topk=model.norm_topk_prob,
    )


def route_bytes_per_token(s: Shape) -> int:
    """Bytes of one position's R3 routes (model/routing.py: [moe layers, k] small integers, on the host): what each
    sample carries through the exchange per prompt and response token. 0 for a dense model."""
    return len(s.moe_layers) * s.topk * (1 if s.experts <= ROUTE_BYTES_MAX_EXPERTS else 2)


def expert_data_parallel(tp: int, cp: int, dp: int, ep: int, etp: int) -> int:
    """edp, the ranks that hold the same experts: world / (etp x ep x pp) with world = tp x cp x dp x pp (Megatron's
    expert groups fold context parallel into it). ValueError when etp x ep does not divide tp x cp x dp."""
    cells = tp * cp * dp
    if cells % (ep * etp):
        raise ValueError(
            f"ep x etp = {ep} x {etp} does not divide tp x cp x dp = {tp} x {cp} x {dp}: no expert layout of this world"
        )
    return cells // (ep * etp)


def padded_vocab(s: Shape, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-s.vocab // multiple) * multiple


# ----------------------------------------------------------------------------- 1. static memory


def layer_params(s: Shape, tp: int, moe: bool = False) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank, its experts aside (expert_params): the norms
    (and Qwen3's q/k norms) are replicated, and so is a MoE layer's router [experts, hidden]."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = s.hidden * (q + 2 * kv) + (q + 2 * kv) * s.qkv_bias
    proj = q * s.hidden
    mlp = 0 if moe else 3 * s.hidden * s.ffn  # fc1 (gate and up) + fc2
    router = s.experts * s.hidden if moe else 0
    return (qkv + proj + mlp) // tp + 2 * s.hidden + 2 * s.head_dim * s.qk_norm + router


def expert_params(s: Shape, ep: int = 1, etp: int = 1) -> int:
    """One MoE layer's expert weights on one rank: its experts / ep experts, each one's fc1 (gate and up) and fc2
    split over etp."""
    return s.experts // ep * (3 * s.hidden * s.moe_ffn // etp)


def stage_layers(s: Shape, pp: int, stage: int, vpp: int | None = None) -> tuple[int, int]:
    """(dense layers, MoE layers) that pipeline stage `stage` holds: layers // pp in a row, or with vpp its model
    chunks stage, stage + pp, ... of layers / (pp x vpp) each (Megatron's interleaved order)."""
    if not s.moe_layers:
        return s.layers // pp, 0
    if vpp:
        size = s.layers // (pp * vpp)
        mine = [i for chunk in range(stage, pp * vpp, pp) for i in range(chunk * size, (chunk + 1) * size)]
    else:
        size = s.layers // pp
        mine = list(range(stage * size, (stage + 1) * size))
    moe = sum(i in s.moe_layers for i in mine)
    return len(mine) - moe, moe


def stage_param_split(
    s: Shape, tp: int, pp: int, stage: int, *, ep: int = 1, etp: int = 1, vpp: int | None = None
) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of pipeline stage `stage`: its layers (their experts apart), the
    embedding on the first stage, the final norm and the output layer on the last (a tied output layer shares the
    embedding only when both are here); the experts of its MoE layers."""
    dense_layers, moe_layers = stage_layers(s, pp, stage, vpp)
    params = dense_layers * layer_params(s, tp)
    if moe_layers:
        params += moe_layers * layer_params(s, tp, moe=True)
    table = padded_vocab(s, tp) // tp * s.hidden
    first, last = stage == 0, stage == pp - 1
    if first:
        params += table
    if last:
        params += s.hidden
        if not s.tied or not first:
            params += table
    return params, moe_layers * expert_params(s, ep, etp)


def stage_params(s: Shape, tp: int, pp: int, stage: int, *, ep: int = 1, etp: int = 1, vpp: int | None = None) -> int:
    """All parameters on one rank of pipeline stage `stage`, dense and expert (stage_param_split)."""
    return sum(stage_param_split(s, tp, pp, stage, ep=ep, etp=etp, vpp=vpp))


def static_bytes(
    s: Shape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dp: int = 1,
    stage: int = 0,
    dtype: str = "bf16",
    distributed_optimizer: bool = True,
    trainable: bool = True,
    ep: int = 1,
    etp: int = 1,
    vpp: int | None = None,
) -> int:
    """Parameters, gradient buffer and optimizer state of one rank. trainable=False: a frozen copy (the KL
    reference): its weights only. ep, etp: the experts' split (a MoE model)."""
    n, experts = stage_param_split(s, tp, pp, stage, ep=ep, etp=etp, vpp=vpp)
    d = DTYPE_BYTES[dtype]
    if not trainable:
        return (n + experts) * d
    grads = 4 * (n + experts)  # DDP's grad buffers, fp32 (grad_reduce_in_fp32), the experts' one of its own
    main = 4 if d != 4 else 0  # fp32 main parameters (an fp32 model's are its parameters)
    shard = dp * cp if distributed_optimizer else 1  # Megatron shards over the data-parallel group with CP
    optimizer = (main + 8) * n // shard  # + Adam's exp_avg and exp_avg_sq, fp32
    if experts:  # the experts' state over the ranks that hold the same experts
        expert_shard = expert_data_parallel(tp, cp, dp, ep, etp) if distributed_optimizer else 1
        optimizer += (main + 8) * experts // expert_shard
    return (n + experts) * d + grads + optimizer


def optimizer_step_temp_bytes(
    s: Shape, *, tp=1, pp=1, cp=1, dp=1, stage=0, distributed_optimizer=True, ep=1, etp=1, vpp=None
) -> int:
    n, experts = stage_param_split(s, tp, pp, stage, ep=ep, etp=etp, vpp=vpp)
    shard = dp * cp if distributed_optimizer else 1
    temp = ADAM_STEP_TEMP_BYTES * n // shard
    if experts:
        expert_shard = expert_data_parallel(tp, cp, dp, ep, etp) if distributed_optimizer else 1
        temp += ADAM_STEP_TEMP_BYTES * experts // expert_shard
    return temp


# ----------------------------------------------------------------------------- 2. activations per layer


def layer_terms(
    s: Shape,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    attention: str = "sdpa",
    recompute: str | None = None,
    fused_swiglu: bool = True,
    moe: bool = False,
    etp: int = 1,
    router_dtype: str | None = None,
    expert_load: float = 1.0,
) -> dict[str, float]:
    """Bytes one layer keeps for backward per token of this rank's micro-batch, by tensor (O(T) terms only: the
    unfused attention's scores are attention_scores_bytes). Under sequence parallel the hidden-sized tensors are
    the rank's sequence shard (Megatron saves a column-parallel linear's input before its all-gather).
    fused_swiglu: Megatron's bias_swiglu kernel (bias_activation_fusion, on CUDA), which saves only its input.
    moe: a MoE layer (router and experts in place of the MLP, moe_terms; etp, router_dtype, expert_load as there)."""
    d = DTYPE_BYTES[dtype]
    row = 1 / tp if sequence_parallel else 1  # a hidden-sized tensor's share of a token on this rank
    h, q, kv = s.hidden * row, s.heads * s.head_dim / tp, s.kv_heads * s.head_dim / tp
    ffn = s.ffn / tp
    if recompute == "full":
        return {"layer.input": d * h}  # the checkpoint's input; the rest is rebuilt in backward
    t = {
        "input_norm.input": d * h + 4 * row,  # + the fp32 1/rms per token (torch's fused RMSNorm, TE's)
        "qkv.input": d * h,
        "rope.cos_sin": 4 * d * s.head_dim,  # cos and sin, for q and for k
    }
    grouped = s.heads > s.kv_heads
    if recompute == "selective":  # the checkpoint keeps the core attention's inputs
        t["attention.q"] = d * q
        t["attention.k"] = d * kv
        t["attention.qkv_for_v"] = d * (q + 2 * kv)  # v is a view into the fused QKV output: all of it stays
    elif attention == "unfused":  # baddbmm keeps q and k, bmm keeps v: k and v repeated to every query head
        t["attention.q"] = d * q
        t["attention.k_repeated"] = d * q if grouped else d * kv
        t["attention.v_repeated"] = d * q if grouped else d * (q + 2 * kv)
    else:  # a fused kernel keeps q, k, v, its output and the per-head log-sum-exp
        t["attention.q"] = d * q
        t["attention.k"] = d * kv
        t["attention.qkv_for_v"] = d * (q + 2 * kv)
        if attention == "sdpa":  # SDPA's [b, heads, s, d] output; linear_proj gets a contiguous copy of it
            t["attention.out"] = d * q
        t["attention.lse"] = 4 * s.heads / tp
    t["proj.input"] = d * q
    t["mlp_norm.input"] = d * h + 4 * row
    if moe:
        return {**t, **moe_terms(s, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype, fused_swiglu=fused_swiglu,
                                 etp=etp, router_dtype=router_dtype, expert_load=expert_load)}  # fmt: skip
    t["fc1.input"] = d * h
    t["swiglu.input"] = d * 2 * ffn  # fc1's output: gate and up
    if not fused_swiglu:  # silu(gate) * (up + 0): silu's output and the offset's copy of `up`
        t["swiglu.silu"] = d * ffn
        t["swiglu.up_plus_offset"] = d * ffn
    t["fc2.input"] = d * ffn
    return t


def expert_slots(s: Shape, *, tp: int = 1, sequence_parallel: bool = False, etp: int = 1, load: float = 1.0) -> float:
    """Token copies this rank's experts compute per token of the micro-batch: each of the rank's tokens (1/tp of them
    under sequence parallel) goes to k experts; the all-to-all over ep brings as many back to each rank when routing
    is balanced, and the gather over etp multiplies them by etp. load: the busiest rank's share over the mean."""
    row = 1 / tp if sequence_parallel else 1
    return s.topk * row * etp * load


def moe_terms(
    s: Shape,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    fused_swiglu: bool = True,
    etp: int = 1,
    router_dtype: str | None = None,
    expert_load: float = 1.0,
) -> dict[str, float]:
    """Bytes a MoE layer's router and experts keep for backward per token of this rank's micro-batch, by tensor
    (Megatron-Core 0.16's TopKRouter, alltoall dispatcher, SequentialMLP / TE grouped experts). router_dtype: the
    router's logits and probabilities (model.moe_router_dtype; None = the model's dtype). expert_load: the busiest
    expert rank's tokens over the mean (1 = balanced routing)."""
    d, rd = DTYPE_BYTES[dtype], DTYPE_BYTES[router_dtype or dtype]
    row = 1 / tp if sequence_parallel else 1
    k, width = s.topk, s.moe_ffn / etp
    slots = expert_slots(s, tp=tp, sequence_parallel=sequence_parallel, etp=etp, load=expert_load)
    t = {
        "router.input": d * s.hidden * row,  # the norm's output: the gating GEMM saves it, the dispatcher permutes it
        "router.topk_indices": INDEX_BYTES * k * row,  # torch.topk's (or the replayed routes gathered), [T, k]
        # norm_topk_prob: the softmax over the k chosen logits, fp32; else over every expert before the top k
        "router.softmax": 4 * (k if s.norm_topk else s.experts) * row,
        "router.routing_map": s.experts * row,  # bool [E, T]: masked_select of the probabilities saves it
        "dispatch.indices": INDEX_BYTES * k * row,  # the permutation's token indices, kept to unpermute
        "experts.fc1.input": d * s.hidden * slots,
        "experts.swiglu.input": d * 2 * width * slots,  # fc1's output: gate and up
        "experts.probs": rd * slots,  # each copy's routing weight, multiplied in after the activation
    }
    if not fused_swiglu:  # silu(gate) * (up + 0), then times the weight: silu's output, up's copy, the product
        t["experts.swiglu.silu"] = d * width * slots
        t["experts.swiglu.up_plus_offset"] = d * width * slots
        t["experts.swiglu.output"] = d * width * slots
    t["experts.fc2.input"] = d * width * slots
    return t


def moe_working_bytes(
    s: Shape,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    etp: int = 1,
    router_dtype: str | None = None,
    expert_load: float = 1.0,
) -> tuple[float, float]:
    """(forward, backward) bytes a MoE layer has in flight beyond what it keeps, per token of the micro-batch.
    Forward: the router's [T, E] logits, probabilities and int32 routing map, and the dispatcher's copies of the
    tokens (on the way out the permuted ones, the all-to-all's output and its re-sort by expert; on the way back the
    experts' output, its re-sort and the all-to-all's output). Backward: the gradients of the experts' fc1 output and
    fc2 input and of their input and its all-to-all'd copy, and the residual stream's."""
    d, rd = DTYPE_BYTES[dtype], DTYPE_BYTES[router_dtype or dtype]
    row = 1 / tp if sequence_parallel else 1
    width = s.moe_ffn / etp
    slots = expert_slots(s, tp=tp, sequence_parallel=sequence_parallel, etp=etp, load=expert_load)
    forward = (2 * rd + 4 + 1) * s.experts * row + 3 * d * s.hidden * slots
    backward = d * (slots * (3 * width + 2 * s.hidden) + 2 * s.hidden * row)
    return forward, backward


def attention_scores_bytes(
    s: Shape, tokens: int, seq: int, *, tp: int = 1, dtype: str = "bf16", attention: str = "sdpa", recompute=None
) -> int:
    """The O(s^2) bytes one layer keeps: Megatron's unfused attention saves softmax's fp32 output and its copy in
    the model's dtype (bmm's input), [heads/tp, tokens, seq] each (`tokens` tokens in rows of `seq`). Zero for a
    fused kernel and under recompute."""
    if attention != "unfused" or recompute is not None:
        return 0
    d = DTYPE_BYTES[dtype]
    return score_elements(s, tokens, seq, tp) * (4 + (d if d != 4 else 0))


def score_elements(s: Shape, tokens: int, seq: int, tp: int) -> int:
    return s.heads // tp * tokens * seq


# ----------------------------------------------------------------------------- 4. the vocabulary pass


def vocab_bytes(
    s: Shape, tokens: int, *, tp: int = 1, dtype: str = "bf16", vocab_path: str = "onepass", forward_only=False
) -> int:
    """The last stage's logits and the logprob code's tensors at their largest, for `tokens` positions."""
    d = DTYPE_BYTES[dtype]
    part = padded_vocab(s, tp) // tp
    logits = tokens * part  # [T, V/tp] elements
    chunk = min(tokens, max(1, CHUNK_ELEMENTS // part)) * part  # elements of one fp32 chunk
    if vocab_path == "onepass":
        forward = d * logits + 2 * 4 * chunk  # the logits + a chunk's fp32 shift and its exp
        backward = 2 * d * logits + 4 * chunk  # the saved logits + their gradient + a chunk's fp32 softmax
        return forward if forward_only else max(forward, backward)
    # twopass: z = logits.float() / T (fp32, the upcast copy freed once divided), then exp(z - max) (fp32, saved)
    padding = 4 * logits if part * tp > s.vocab and tp > 1 else 0  # masked_fill's copy on a padded rank
    forward = (d + 4 + 4) * logits + padding
    entropy = (d + (0 if forward_only else 4)) * logits + 2 * 4 * chunk  # the exp kept for backward + 2 chunks
    return max(forward, entropy)


# ----------------------------------------------------------------------------- 3, 5. the peak


def in_flight(pp: int, stage: int, vpp: int | None = None, microbatches: int | None = None) -> float:
    """Micro-batches whose activations stage `stage` holds at once (1F1B: pp - stage; interleaved: its warm-up
    count of model chunks, each 1/vpp of the stage's layers), at most the micro-batches there are."""
    if not vpp:
        count = pp - stage
        return min(count, microbatches) if microbatches else count
    chunks = (pp - stage - 1) * 2 + (vpp - 1) * pp + 1
    if microbatches:
        chunks = min(chunks, microbatches * vpp)
    return chunks / vpp


def peak_bytes(
    model,
    tokens: int,
    *,
    seq: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dp: int = 1,
    vpp: int | None = None,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    recompute: str | None = None,
    recompute_num_layers: int = 1,
    attention: str = "sdpa",
    vocab_path: str = "onepass",
    forward_only: bool = False,
    fused_swiglu: bool = True,
    distributed_optimizer: bool = True,
    reference_weights: bool = False,
    microbatches: int | None = None,
    stage: int | None = None,
    tied: bool | None = None,
    ep: int = 1,
    etp: int = 1,
    router_dtype: str | None = None,
    expert_load: float = 1.0,
    replay: bool = False,
) -> int:
    """Peak bytes of one rank (the worst pipeline stage, or `stage`) in a train step's forward-backward over
    micro-batches of `tokens` tokens (rows of `seq` tokens, default one row of all of them), or in a forward-only
    pass (forward_only: the old logprobs, the KL reference's logprobs: nothing kept for backward, one layer's
    working set and the vocabulary pass). model: a ModelArch, a SHAPES name or tuple (shape_of).
    reference_weights: the KL reference's frozen weights are on the GPU too. A mixture of experts: ep, etp (parallel.ep,
    parallel.etp), router_dtype (model.moe_router_dtype), expert_load (the busiest expert rank's tokens over the mean;
    1 = balanced), replay (the pass replays routes: R3's passes, R2's train step). The rest as in the config."""
    if attention not in ATTENTIONS or vocab_path not in VOCAB_PATHS or recompute not in RECOMPUTES:
        raise ValueError(f"attention={attention!r}, vocab_path={vocab_path!r}, recompute={recompute!r}")
    if router_dtype is not None and router_dtype not in DTYPE_BYTES:
        raise ValueError(f"router_dtype={router_dtype!r}: expected one of {sorted(DTYPE_BYTES)} or None")
    if expert_load < 1:
        raise ValueError(f"expert_load={expert_load}: expected >= 1 (the busiest rank's tokens over the mean)")
    s = shape_of(model, tied)
    seq = seq or tokens
    local = tokens // cp  # this rank's positions: a context-parallel rank holds 1/cp of each sequence
    d = DTYPE_BYTES[dtype]
    sp = sequence_parallel and tp > 1
    row = 1 / tp if sp else 1
    kw = dict(tp=tp, sequence_parallel=sp, dtype=dtype, attention=attention, fused_swiglu=fused_swiglu)
    moe_kw = dict(etp=etp, router_dtype=router_dtype, expert_load=expert_load)
    sk = dict(tp=tp, dtype=dtype, attention=attention)
    elements = score_elements(s, local, seq, tp) if attention == "unfused" else 0
    q, kv, ffn = s.heads * s.head_dim / tp, s.kv_heads * s.head_dim / tp, s.ffn / tp
    kinds = [False] + ([True] if s.moe_layers else [])  # a layer's MLP: dense, experts
    if s.moe_layers and len(s.moe_layers) == s.layers:
        kinds = [True]

    # what one layer holds while it is computed with autograd, and the extra bytes in flight at its worst moment
    def layer_bytes(moe: bool, recompute_=None) -> float:
        terms = layer_terms(s, recompute=recompute_, moe=moe, **kw, **moe_kw)
        return sum(terms.values()) * local + attention_scores_bytes(s, local, seq, recompute=recompute_, **sk)

    score_forward = elements * (d + (4 if d != 4 else 0))  # the scores in the model's dtype and their fp32 copy
    if attention == "unfused":
        attention_backward = 8 * elements  # softmax's input and output gradients, fp32
    else:  # dq, dk, dv, and the kernel's fp32 dq accumulator and per-head softmax sums
        attention_backward = (d * (q + 2 * kv) + 4 * q + 4 * s.heads / tp) * local
    mlp_backward = d * (3 * ffn + 2 * s.hidden * row) * local  # gradients of fc1's output, fc2's input, the stream
    full_layer = max(layer_bytes(moe) for moe in kinds)
    layer_forward = score_forward
    layer_backward = attention_backward + (mlp_backward if False in kinds else 0)
    if True in kinds:  # the experts' working sets come after the attention's scores are freed
        moe_forward, moe_backward = moe_working_bytes(s, tp=tp, sequence_parallel=sp, dtype=dtype, **moe_kw)
        layer_forward = max(layer_forward, moe_forward * local)
        layer_backward = max(layer_backward, attention_backward + moe_backward * local)

    buffers = BATCH_BYTES_PER_TOKEN * tokens
    if attention == "unfused":
        buffers += d * elements  # Megatron's global memory buffer for baddbmm's input, kept once allocated
    if sp:
        buffers += d * s.hidden * local  # the global buffer sequence parallel all-gathers a linear's input into
    routes = INDEX_BYTES * s.topk * row * local if replay else 0  # one MoE layer's replayed routes, int64 [T, k]

    stages = range(pp) if stage is None else [stage]
    peaks = []
    for r in stages:
        split = dict(tp=tp, pp=pp, stage=r, dtype=dtype, ep=ep, etp=etp, vpp=vpp)
        static = static_bytes(s, cp=cp, dp=dp, distributed_optimizer=distributed_optimizer, **split)
        if reference_weights:
            static += static_bytes(s, trainable=False, **split)
        dense_layers, moe_layers = stage_layers(s, pp, r, vpp)
        first, last = r == 0, r == pp - 1
        head = (d * s.hidden * row * 2 + 4 * row) * local if last else 0  # final norm's input, output layer's input
        ids = 8 * local if first else 0  # the embedding keeps its input ids
        vocab = vocab_bytes(s, local, tp=tp, dtype=dtype, vocab_path=vocab_path, forward_only=forward_only)
        vocab = vocab if last else 0
        base = static + buffers + FITTED_OVERHEAD
        if forward_only:  # no_grad: the layer being computed, then the logits (replay: every layer's routes fed)
            peaks.append(base + moe_layers * routes + max(full_layer + layer_forward, head + vocab))
            continue
        saved = {moe: layer_bytes(moe, recompute) for moe in kinds}
        if recompute == "full":
            saved = {moe: b / recompute_num_layers for moe, b in saved.items()}
            if True in saved:  # replayed routes wait for each layer's recomputed forward
                saved[True] += routes
        stage_saved = dense_layers * saved[False] if False in saved else 0
        if moe_layers:
            stage_saved += moe_layers * saved[True]
        held = in_flight(pp, r, vpp, microbatches) * (stage_saved + ids) + head
        if recompute == "full":  # a block of layers rebuilt with autograd, then its backward
            rebuilt = recompute_num_layers * full_layer + max(layer_forward, layer_backward)
        elif recompute == "selective":  # the core attention rebuilt with autograd: unfused, its scores, k and v
            # repeated and its output; a fused kernel, its output and log-sum-exp (q, k, v are the checkpoint's)
            rebuilt = attention_scores_bytes(s, local, seq, **sk) + max(layer_forward, layer_backward)
            rebuilt += (d * 3 * q if attention == "unfused" else d * q + 4 * s.heads / tp) * local
        else:
            rebuilt = layer_backward
        moments = [held + layer_forward, held + rebuilt, held + vocab]
        optimizer = optimizer_step_temp_bytes(
            s, tp=tp, pp=pp, cp=cp, dp=dp, stage=r, distributed_optimizer=distributed_optimizer, ep=ep, etp=etp, vpp=vpp
        )
        peaks.append(base + max(max(moments), optimizer))
    return int(max(peaks))


def max_tokens(
    model, device_gib: float = 80.0, headroom: float = BUDGET_HEADROOM, step: int = BUDGET_STEP, **kw
) -> int:
    """The largest token budget, a multiple of `step`, whose peak_bytes(model, tokens, **kw) fits device_gib GiB
    with `headroom` of it left free; 0 if not even `step` tokens fit. kw: peak_bytes's (seq defaults to the budget:
    one sequence filling it, the worst case for the unfused attention)."""
    limit = device_gib * (1 - headroom) * GIB

    def fits(n: int) -> bool:
        return peak_bytes(model, n * step, **kw) <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:  # over 16 billion tokens: nothing on the device grows with the budget
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def reference_budgets() -> tuple[int, int]:
    """(train, forward) token budgets for REFERENCE_CASE: the train one is config.TrainConfig's default; the forward
    one is what config's max_tokens_per_forward documents (its default, 0, keeps the train step's micro-batches)."""
    case = dict(REFERENCE_CASE)
    model, device, headroom = case.pop("model"), case.pop("device_gib"), case.pop("headroom")
    train = max_tokens(model, device, headroom, **case)
    forward = max_tokens(model, device, headroom, forward_only=True, **case)
    return train, forward
