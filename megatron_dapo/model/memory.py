"""Peak GPU memory of one rank for a micro-batch of T tokens: what Megatron-Core holds, term by term.

Pure arithmetic (no torch), so the config's defaults and the example checks can use it anywhere. Bytes throughout;
GIB = 2^30. Read top to bottom:

1. Static memory: the rank's parameters (its tensor-parallel slice of its pipeline stage's layers, the embedding on
   the first stage, the output layer on the last) in the model's dtype, Megatron DDP's fp32 gradient buffer
   (grad_reduce_in_fp32), and the optimizer's fp32 main parameters and Adam's two moments, sharded over the data-
   (and context-) parallel ranks by the distributed optimizer.
2. Activations saved for backward, per layer and per token of the local (or Transformer Engine) layer spec, one
   term per tensor autograd keeps: the norms' inputs, each linear's input, RoPE's cos/sin, the core attention's
   q/k/v (and its output and log-sum-exp for a fused kernel), SwiGLU's inputs. Megatron's unfused attention also
   keeps the [heads/tp, s, s] softmax probabilities, in fp32 and in the model's dtype: the O(s^2) term. Selective
   recompute drops the core attention's own tensors (keeping its inputs); full recompute keeps each layer's input
   only and rebuilds one layer at a time in the backward pass.
3. The pipeline: 1F1B keeps the activations of up to pp micro-batches on the first stage (pp - r on stage r).
4. The vocabulary pass on the last stage: the [T, V/tp] logits and what the logprob (and entropy) code adds,
   for the old two-pass code (an fp32 copy of the logits and an fp32 exp saved for backward, entropy in a second
   chunked pass) or the one-pass code of model/logprobs.py (the logits saved by reference, 2^26-element fp32 chunks).
5. Working sets on top of what is held: the layer being computed (the unfused attention's scores in flight, the
   backward's gradients of them), a recomputed layer, the optimizer step's temporary.

The peak is the largest of these moments, over the pipeline stages. Checked against the six train-step peaks
measured on an H200 (benchmarks/RESULTS.md, tests/test_memory.py): within 1% with no fitted constant, so
FITTED_OVERHEAD is 0 and the headroom a budget keeps (BUDGET_HEADROOM) is for what the model leaves out: the CUDA
context, NCCL's buffers, the caching allocator's fragmentation (reserved minus allocated) and a sleeping vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.model.perf import SHAPES

GIB = 1 << 30

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
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

BUDGET_HEADROOM = 0.10
"""Fraction of the device's memory a token budget leaves unplanned (see the module docstring)."""
BUDGET_STEP = 1024
"""Token budgets are multiples of this."""

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


def shape_of(model, tied: bool | None = None) -> Shape:
    """A Shape from a ModelArch (model/arch.py), a name in model/perf.py's SHAPES, or a SHAPES tuple (hidden, ffn,
    layers, heads, kv_heads, vocab). A SHAPES entry is a Qwen2 (QKV bias), untied as perf.shape_arch builds it unless
    `tied` says otherwise."""
    if isinstance(model, str):
        model = SHAPES[model]
    if isinstance(model, tuple):
        h, ffn, layers, heads, kv, vocab = model
        return Shape(h, ffn, layers, heads, kv, h // heads, vocab, bool(tied), True)
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
    )


def padded_vocab(s: Shape, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-s.vocab // multiple) * multiple


# ----------------------------------------------------------------------------- 1. static memory


def layer_params(s: Shape, tp: int) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (the norms are replicated)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = s.hidden * (q + 2 * kv) + (q + 2 * kv) * s.qkv_bias
    proj = q * s.hidden
    mlp = 3 * s.hidden * s.ffn  # fc1 (gate and up) + fc2
    return (qkv + proj + mlp) // tp + 2 * s.hidden


def stage_params(s: Shape, tp: int, pp: int, stage: int) -> int:
    """Parameters on one rank of pipeline stage `stage`: its layers, the embedding on the first stage, the final
    norm and the output layer on the last (a tied output layer shares the embedding only when both are here)."""
    params = s.layers // pp * layer_params(s, tp)
    table = padded_vocab(s, tp) // tp * s.hidden
    first, last = stage == 0, stage == pp - 1
    if first:
        params += table
    if last:
        params += s.hidden
        if not s.tied or not first:
            params += table
    return params


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
) -> int:
    """Parameters, gradient buffer and optimizer state of one rank. trainable=False: a frozen copy (the KL
    reference): its weights only."""
    n = stage_params(s, tp, pp, stage)
    d = DTYPE_BYTES[dtype]
    if not trainable:
        return n * d
    grads = 4 * n  # DDP's grad buffer, fp32 (grad_reduce_in_fp32)
    main = 4 if d != 4 else 0  # fp32 main parameters (an fp32 model's are its parameters)
    shard = dp * cp if distributed_optimizer else 1  # Megatron shards over the data-parallel group with CP
    optimizer = (main + 8) * n // shard  # + Adam's exp_avg and exp_avg_sq, fp32
    return n * d + grads + optimizer


def optimizer_step_temp_bytes(s: Shape, *, tp=1, pp=1, cp=1, dp=1, stage=0, distributed_optimizer=True) -> int:
    shard = dp * cp if distributed_optimizer else 1
    return ADAM_STEP_TEMP_BYTES * stage_params(s, tp, pp, stage) // shard


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
) -> dict[str, float]:
    """Bytes one layer keeps for backward per token of this rank's micro-batch, by tensor (O(T) terms only: the
    unfused attention's scores are attention_scores_bytes). Under sequence parallel the hidden-sized tensors are
    the rank's sequence shard (Megatron saves a column-parallel linear's input before its all-gather).
    fused_swiglu: Megatron's bias_swiglu kernel (bias_activation_fusion, on CUDA), which saves only its input."""
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
    t["fc1.input"] = d * h
    t["swiglu.input"] = d * 2 * ffn  # fc1's output: gate and up
    if not fused_swiglu:  # silu(gate) * (up + 0): silu's output and the offset's copy of `up`
        t["swiglu.silu"] = d * ffn
        t["swiglu.up_plus_offset"] = d * ffn
    t["fc2.input"] = d * ffn
    return t


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
) -> int:
    """Peak bytes of one rank (the worst pipeline stage, or `stage`) in a train step's forward-backward over
    micro-batches of `tokens` tokens (rows of `seq` tokens, default one row of all of them), or in a forward-only
    pass (forward_only: the old logprobs, the KL reference's logprobs: nothing kept for backward, one layer's
    working set and the vocabulary pass). model: a ModelArch, a SHAPES name or tuple (shape_of).
    reference_weights: the KL reference's frozen weights are on the GPU too. The rest as in the config."""
    if attention not in ATTENTIONS or vocab_path not in VOCAB_PATHS or recompute not in RECOMPUTES:
        raise ValueError(f"attention={attention!r}, vocab_path={vocab_path!r}, recompute={recompute!r}")
    s = shape_of(model, tied)
    seq = seq or tokens
    local = tokens // cp  # this rank's positions: a context-parallel rank holds 1/cp of each sequence
    d = DTYPE_BYTES[dtype]
    sp = sequence_parallel and tp > 1
    row = 1 / tp if sp else 1
    kw = dict(tp=tp, sequence_parallel=sp, dtype=dtype, attention=attention, fused_swiglu=fused_swiglu)
    sk = dict(tp=tp, dtype=dtype, attention=attention)
    layers = s.layers // pp
    elements = score_elements(s, local, seq, tp) if attention == "unfused" else 0
    q, kv, ffn = s.heads * s.head_dim / tp, s.kv_heads * s.head_dim / tp, s.ffn / tp

    # what one layer holds while it is computed with autograd, and the extra bytes in flight at its worst moment
    full_layer = sum(layer_terms(s, **kw).values()) * local + attention_scores_bytes(s, local, seq, **sk)
    score_forward = elements * (d + (4 if d != 4 else 0))  # the scores in the model's dtype and their fp32 copy
    if attention == "unfused":
        attention_backward = 8 * elements  # softmax's input and output gradients, fp32
    else:  # dq, dk, dv, and the kernel's fp32 dq accumulator and per-head softmax sums
        attention_backward = (d * (q + 2 * kv) + 4 * q + 4 * s.heads / tp) * local
    mlp_backward = d * (3 * ffn + 2 * s.hidden * row) * local  # gradients of fc1's output, fc2's input, the stream
    layer_forward = score_forward
    layer_backward = attention_backward + mlp_backward

    buffers = BATCH_BYTES_PER_TOKEN * tokens
    if attention == "unfused":
        buffers += d * elements  # Megatron's global memory buffer for baddbmm's input, kept once allocated
    if sp:
        buffers += d * s.hidden * local  # the global buffer sequence parallel all-gathers a linear's input into

    stages = range(pp) if stage is None else [stage]
    peaks = []
    for r in stages:
        static = static_bytes(
            s, tp=tp, pp=pp, cp=cp, dp=dp, stage=r, dtype=dtype, distributed_optimizer=distributed_optimizer
        )
        if reference_weights:
            static += static_bytes(s, tp=tp, pp=pp, stage=r, dtype=dtype, trainable=False)
        first, last = r == 0, r == pp - 1
        head = (d * s.hidden * row * 2 + 4 * row) * local if last else 0  # final norm's input, output layer's input
        ids = 8 * local if first else 0  # the embedding keeps its input ids
        vocab = vocab_bytes(s, local, tp=tp, dtype=dtype, vocab_path=vocab_path, forward_only=forward_only)
        vocab = vocab if last else 0
        base = static + buffers + FITTED_OVERHEAD
        if forward_only:  # no_grad: the layer being computed, then the logits
            peaks.append(base + max(full_layer + layer_forward, head + vocab))
            continue
        per_layer = layer_terms(s, recompute=recompute, **kw)
        saved = sum(per_layer.values()) * local + attention_scores_bytes(s, local, seq, recompute=recompute, **sk)
        if recompute == "full":
            saved = saved / recompute_num_layers
        held = in_flight(pp, r, vpp, microbatches) * (layers * saved + ids) + head
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
            s, tp=tp, pp=pp, cp=cp, dp=dp, stage=r, distributed_optimizer=distributed_optimizer
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
