"""Build the Megatron-Core GPTModel policy (chunks, DDP, optimizer, LR schedule) and load weights.

The Transformer Engine layer spec is used when TE is usable (GPU), the local spec
otherwise; everything else is the same code path on CPU and GPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from megatron_dapo.config import ModelConfig, OptimConfig
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.comm import Comm
from megatron_dapo.model.dtypes import torch_dtype
from megatron_dapo.model.parallel import Layout
from megatron_dapo.model.sharding import (
    expert_of,
    layer_of,
    local_suffix,
    tp_shard,
    tp_split_dim,
    tp_unshard,
    with_expert,
)

VOCAB_DIVISIBLE_BY = 128
"""The vocabulary is padded to a multiple of this times tp (Megatron-LM's default), for GEMM shapes."""


def padded_vocab_size(arch: ModelArch, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-arch.vocab_size // multiple) * multiple


def transformer_config(arch: ModelArch, m: ModelConfig, layout: Layout):
    """Megatron TransformerConfig for the arch, the model section's precision and recompute, and the layout."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch_dtype(m.dtype)
    kwargs = {}
    if m.fp8 is not None:
        kwargs.update(fp8=m.fp8, fp8_recipe=m.fp8_recipe)
    if m.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif m.recompute == "full":
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=m.recompute_num_layers
        )
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # Qwen3's per-head q/k RMSNorm; the spec builds the norms (layer_spec), but only this flag makes Megatron
        # all-reduce their gradients over TP (finalize_model_grads): each rank sees its own heads, so without it the
        # replicas of the same [head_dim] weight drift apart from the first step
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Weights are loaded afterwards, but Megatron sets the tensor-parallel attributes that
        # grad-norm clipping relies on only inside its init: without it TP>1 clips wrongly.
        perform_initialization=True,
        # fused kernels need CUDA (and some TE); the unfused paths are exact
        bias_dropout_fusion=layout.use_te,
        masked_softmax_fusion=layout.use_te,
        apply_rope_fusion=layout.use_te,
        bias_activation_fusion=torch.cuda.is_available(),  # SwiGLU fused by Megatron's jit fuser (compiled on CUDA)
        persist_layer_norm=False,
        # weight gradients accumulated into the fp32 main_grad by the GEMM itself: TE's layers can, but the output
        # layer is Megatron's own ColumnParallelLinear, which needs apex's fused_weight_gradient_mlp_cuda for it
        # (Megatron-LM turns the fusion off without apex too)
        gradient_accumulation_fusion=layout.use_te
        and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        # our loss normalises by the mini-batch's global token count itself (see policy.py)
        calculate_per_token_loss=True,
        # micro-batches are padded to their own longest sequence: the pipeline's p2p sends learn each one's shape
        # (only between stages: Megatron's allgather dispatcher refuses the flag, so it is off without pipelining)
        variable_seq_lengths=layout.pp > 1,
        batch_p2p_comm=False,  # gloo cannot batch p2p; nccl is fine either way
        **moe_config(arch, m, layout),
        **kwargs,
    )


def moe_config(arch: ModelArch, m, layout: Layout) -> dict:
    """TransformerConfig's MoE fields: the router of Hugging Face's Qwen3-MoE (softmax over every expert, top k,
    renormalised when norm_topk_prob; no scaling, bias, groups or capacity) and the layout's expert groups. A dense
    model gets only the dispatcher (the config check wants one that accepts variable lengths). m: ModelConfig."""
    if not arch.is_moe:
        return {"moe_token_dispatcher_type": "alltoall"}
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        # one entry per layer, 1 = experts: transformers' rule read into arch.moe_layers (Megatron's integer
        # frequency puts experts at i % n == 0, not at (i + 1) % decoder_sparse_step == 0)
        moe_layer_freq=[int(i in arch.moe_layers) for i in range(arch.num_layers)],
        # top k of the logits then softmax over the k == softmax over all, top k, renormalised (norm_topk_prob)
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype=m.moe_router_dtype,
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff or None,
        moe_token_dispatcher_type=m.moe_token_dispatcher,
        moe_grouped_gemm=layout.use_te,  # TE's grouped GEMM on GPU; SequentialMLP (one GEMM per expert) otherwise
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )


def layer_spec(arch: ModelArch, layout: Layout, tf_config, varlen_attention: bool = False, vp_stage=None):
    """The decoder block spec of this pipeline stage: Megatron's TE or local layer spec, its core attention swapped
    for model/attention.py's SDPAttention when layout.attention is 'sdpa' (the spec's extension point: a class with
    DotProductAttention's arguments). A MoE model's block holds a dense and an expert layer spec, placed by
    tf_config.moe_layer_freq. Under sequence parallel without Transformer Engine the hidden-size norms are
    SequenceParallelRMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if arch.is_moe:
        block = get_gpt_decoder_block_spec(
            tf_config, use_transformer_engine=layout.use_te, normalization="RMSNorm", vp_stage=vp_stage,
            pp_rank=layout.pp_rank,
        )  # fmt: skip
    else:
        if layout.use_te:
            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
        else:
            spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_layernorm)
        layers = get_num_layers_to_build(tf_config, vp_stage=vp_stage, pp_rank=layout.pp_rank)
        block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=None)
    local_sp = layout.sequence_parallel and not layout.use_te
    for layer in {id(x): x for x in block.layer_specs}.values():  # the one or two specs the layers share
        _set_core_attention(layer, layout, varlen_attention)
        if local_sp:
            _set_norms(layer, arch.qk_layernorm)
    if local_sp:
        block.layer_norm = SequenceParallelRMSNorm
    elif block.layer_norm is None:  # what TransformerBlock gives a single layer spec's block
        from megatron.core.transformer.transformer_block import LayerNormImpl

        block.layer_norm = LayerNormImpl
    return block


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in the local spec's place under sequence parallel (Megatron's own wrapper refuses it): each
    TP rank normalises its share of the positions, and its weight is marked so that finalize_model_grads sums the
    shares' gradients over the TP group (what Transformer Engine's norms do)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for Qwen3's per-head q/k norms under sequence parallel: they act on whole sequences after the
    heads' tensor-parallel split (their gradients are summed over TP by TransformerConfig.qk_layernorm), so they are
    the local spec's norms less its refusal of sequence parallel."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)


def _set_norms(spec, qk_layernorm: bool) -> None:
    """A local layer spec's norms for sequence parallel: SequenceParallelRMSNorm on positions, HeadRMSNorm on q/k
    heads (when the model has them)."""
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm


def _set_core_attention(spec, layout: Layout, varlen_attention: bool) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = spec.submodules.self_attention.submodules
    if layout.attention == "sdpa":
        from megatron_dapo.model.attention import SDPAttention

        attention.core_attention = ModuleSpec(module=SDPAttention, params={"varlen": varlen_attention})
    elif layout.attention == "unfused":
        attention.core_attention = DotProductAttention


def build_model_chunks(arch: ModelArch, model: ModelConfig, layout: Layout) -> list:
    """GPTModel chunks of this pipeline rank (one, or vpp with the interleaved schedule), not yet wrapped. model: the
    model section (precision, recompute, attention)."""
    from megatron.core.models.gpt import GPTModel

    tf_config = transformer_config(arch, model, layout)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        spec = layer_spec(arch, layout, tf_config, model.varlen_attention, vp)
        chunk = GPTModel(
            config=tf_config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(arch, layout.tp),
            max_sequence_length=arch.max_position_embeddings,
            # the embedding on the first virtual stage of the first rank, the output layer on the last of the last
            pre_process=layout.pp_rank == 0 and vp_stage == 0,
            post_process=layout.pp_rank == layout.pp - 1 and vp_stage == (layout.vpp or 1) - 1,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            vp_stage=vp,
        )
        # Every parameter in the model's dtype, as Megatron's Float16Module makes it: the local spec's torch norms
        # are built float32 whatever params_dtype says, and a bf16 model with fp32 norms breaks the distributed
        # optimizer's checkpoint (its parameter order mixes the two dtypes: a bf16 save raised an AssertionError)
        for p in chunk.parameters():
            if p.dtype != tf_config.params_dtype:
                p.data = p.data.to(tf_config.params_dtype)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


def wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list:
    """Megatron DDP around each chunk: fp32 grad buffers, reduced once per mini-batch. use_distributed_optimizer:
    parallel.use_distributed_optimizer (the buffers then hold each rank's shard of the optimizer state)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def build_optimizer(ddp_chunks: list, o: OptimConfig, *, dtype: str, use_distributed_optimizer: bool):
    """AdamW (decoupled weight decay, none on biases and norms), grad-norm clipping, fp32 main params. o: the optim
    section; dtype: model.dtype, the parameters' precision; use_distributed_optimizer: parallel's, as wrap_ddp got
    it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    params_dtype = torch_dtype(dtype)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    # Linear warm-up from 0 over warmup_steps optimizer steps, then constant (the paper's schedule).
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=o.warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# ---------------------------------------------------------------- weights


@dataclass
class _Slot:
    """Where a local parameter's data comes from: a full Megatron tensor name (global layer number)."""

    full_name: str
    param: torch.nn.Parameter


def unwrap(chunk):
    """The GPTModel inside a chunk: Megatron's DDP wrapper has no sharded_state_dict of its own."""
    return chunk.module if hasattr(chunk, "module") else chunk


def local_slots(chunks: list, arch: ModelArch, ep_rank: int = 0) -> Iterator[_Slot]:
    """Every parameter of this rank with its full Megatron name (global layer, local-spec names, global expert
    index: this expert-parallel rank's local expert j is ep_rank * experts per rank + j)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for vp, chunk in enumerate(chunks):
        model = unwrap(chunk)
        offset = get_transformer_layer_offset(model.config, vp_stage=vp if len(chunks) > 1 else None)
        per_rank = arch.num_experts // (model.config.expert_model_parallel_size or 1)
        for name, param in model.named_parameters():
            parsed = layer_of(name)
            if parsed is not None:
                i, suffix = parsed
                name = f"decoder.layers.{i + offset}.{local_suffix(suffix)}"
                expert = expert_of(name)
                if expert is not None:
                    name = with_expert(name, ep_rank * per_rank + expert[1])
            elif name == "output_layer.weight" and arch.tie_word_embeddings:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            yield _Slot(name, param)


def _pad_vocab(name: str, tensor: torch.Tensor, padded: int) -> torch.Tensor:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") and tensor.shape[0] < padded:
        pad = tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, pad], dim=0)
    return tensor


@torch.no_grad()
def load_full_weights(chunks: list, full: dict[str, torch.Tensor], arch: ModelArch, layout: Layout) -> None:
    """Copy this rank's slices of full Megatron tensors (convert.layouts.hf_to_megatron) into the chunks.

    Every local parameter must be covered; a missing name or a shape mismatch raises. Load
    before build_optimizer: the optimizer takes its fp32 main params from these.
    """
    padded = padded_vocab_size(arch, layout.tp)
    for slot in local_slots(chunks, arch, layout.ep_rank):
        if slot.full_name not in full:
            raise KeyError(f"no weights for Megatron parameter '{slot.full_name}'")
        rank, size = tp_place(slot.full_name, layout)
        src = tp_shard(slot.full_name, _pad_vocab(slot.full_name, full[slot.full_name], padded), rank, size)
        if src.shape != slot.param.shape:
            raise ValueError(
                f"'{slot.full_name}': checkpoint slice {tuple(src.shape)} does not fit parameter {tuple(slot.param.shape)}"
            )
        slot.param.copy_(src)


def tp_place(name: str, layout: Layout) -> tuple[int, int]:
    """(rank, size) of the group a tensor is split over: the expert tensor-parallel group for an expert's weights,
    the tensor-parallel group for every other tensor."""
    return (layout.etp_rank, layout.etp) if expert_of(name) is not None else (layout.tp_rank, layout.tp)


def gather_tp(name: str, local: torch.Tensor, arch: ModelArch, comm: Comm) -> torch.Tensor:
    """This TP rank's slice of Megatron tensor `name` -> the full tensor, vocabulary padding dropped.

    Collective over the TP group (the expert-TP group for an expert's tensor; every rank of it calls it for the same
    name); a replicated tensor comes back as it is. The result is contiguous (gloo sends non-contiguous views wrong).
    """
    t = local.detach().contiguous()
    over = "etp" if expert_of(name) is not None else "tp"
    if tp_split_dim(name) is not None and comm.size(over) > 1:
        shards = comm.all_gather(t, over)
        t = tp_unshard(name, shards)
        del shards  # the slices are garbage once joined: free them before anything else is allocated
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = t[: arch.vocab_size]
    return t.contiguous()


def tp_gathered_tensors(chunks: list, arch: ModelArch, layout: Layout, grads: bool = False) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters (or their main grads) as full-TP Megatron tensors, vocab unpadded.

    Collective over the TP group: every TP rank gets every tensor; with expert parallelism, only this rank's
    experts (global names). Meant for checks and small models; the weight bridge streams instead.
    """
    out, comm = {}, Comm(layout)
    for slot in local_slots(chunks, arch, layout.ep_rank):
        t = gather_tp(slot.full_name, slot.param.main_grad if grads else slot.param.data, arch, comm).float()
        out.setdefault(slot.full_name, t.clone())  # a tied embedding on first and last stage: the first copy
    return out


def weights_digest(full: Mapping[str, torch.Tensor], comm: Comm) -> str:
    """sha256 over every full Megatron tensor (name, dtype, shape, bytes) in `full`'s order: the same for any
    tp/pp/cp/dp, so a resumed run can check it is against the same weights. Each rank hashes one contiguous
    share of the names (LazyMegatronWeights then reads each layer about once in all) and the digests are gathered:
    collective over the world. full: name -> full tensor, e.g. LazyMegatronWeights."""
    names = list(full)
    share = -(-len(names) // comm.world)
    mine = {}
    for name in names[comm.rank * share : (comm.rank + 1) * share]:
        t = full[name].detach().cpu().contiguous()
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
        mine[name] = h.hexdigest()
    parts = comm.all_gather_objects(mine, "a rank's weight digests")
    merged = {k: v for part in parts for k, v in part.items()}
    return hashlib.sha256("".join(f"{n}:{merged[n]}\n" for n in names).encode()).hexdigest()
