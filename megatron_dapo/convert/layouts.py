"""Hugging Face <-> Megatron-Core names and layouts for Qwen2/Qwen2.5 and Llama.

Written once, used by the model loader, the weight bridge and the conversion tools.

Megatron layout facts (local and Transformer Engine specs alike):
- `linear_qkv` fuses q, k and v grouped per query group: for each of the
  num_key_value_heads groups, its heads_per_group query heads, then its k head, then its
  v head. A tensor-parallel split is therefore a plain chunk of whole groups.
- `linear_fc1` is cat(gate, up) on dim 0; each TP rank holds cat(gate_r, up_r).
- `linear_proj` and `linear_fc2` split on dim 1; the embedding and the output layer on
  dim 0 (the vocabulary); norms are replicated.
- With the TE spec the input/pre-MLP norms live inside the next linear layer as
  `layer_norm_weight`.

Names here are "full" Megatron names with global layer numbers; model/ maps them to a
pipeline stage's local numbering.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from megatron_dapo.model.arch import ModelArch

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix (local spec) -> HF per-layer suffix, for the 1:1 tensors.
_LAYER_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Transformer Engine spec names for the norms fused into the following linear layer.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def layer_of(name: str) -> tuple[int, str] | None:
    """'decoder.layers.7.mlp.linear_fc2.weight' -> (7, 'mlp.linear_fc2.weight'); None for non-layer names."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def megatron_names(arch: ModelArch) -> list[str]:
    """Every full Megatron parameter name of the model (local-spec names), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [
            p + "self_attention.linear_proj.weight",
            p + "pre_mlp_layernorm.weight",
            p + "mlp.linear_fc1.weight",
            p + "mlp.linear_fc2.weight",
        ]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def megatron_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The full (unpadded, TP-gathered) shape of a Megatron tensor, from the architecture alone."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (arch.vocab_size, h)
    if name == "decoder.final_layernorm.weight":
        return (h,)
    suffix = (layer_of(name) or (None, ""))[1]
    suffix = {te: local for local, te in TE_NORM_NAMES.items()}.get(suffix, suffix)
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (q + 2 * kv, h),
        "self_attention.linear_qkv.bias": (q + 2 * kv,),
        "self_attention.linear_proj.weight": (h, q),
        "mlp.linear_fc1.weight": (2 * arch.intermediate_size, h),
        "mlp.linear_fc2.weight": (h, arch.intermediate_size),
    }
    if suffix not in shapes:
        raise KeyError(f"unknown Megatron tensor '{name}'")
    return shapes[suffix]


# ---------------------------------------------------------------- QKV and gate/up


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q [nq*d, ...], k [nkv*d, ...], v [nkv*d, ...] -> Megatron fused [(nq + 2 nkv) d, ...] grouped per KV group."""
    g, d = arch.num_key_value_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, arch.heads_per_group * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_from_megatron(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of qkv_to_megatron."""
    g, d, hpg = arch.num_key_value_heads, arch.head_dim, arch.heads_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---------------------------------------------------------------- whole state dicts


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """A full HF state dict -> full Megatron tensors (local-spec names). Missing or mis-shaped tensors raise."""

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint has no tensor '{name}' (expected for a {arch.family} model)")
        t = hf[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"HF tensor '{name}' has shape {tuple(t.shape)}, expected {shape} from config.json")
        return t

    h, d = arch.hidden_size, arch.head_dim
    nq, nkv, ffn = arch.num_attention_heads * d, arch.num_key_value_heads * d, arch.intermediate_size
    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight", (arch.vocab_size, h))}
    for i in range(arch.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mp + "input_layernorm.weight"] = get(hp + "input_layernorm.weight", (h,))
        out[mp + "self_attention.linear_qkv.weight"] = qkv_to_megatron(
            get(hp + "self_attn.q_proj.weight", (nq, h)),
            get(hp + "self_attn.k_proj.weight", (nkv, h)),
            get(hp + "self_attn.v_proj.weight", (nkv, h)),
            arch,
        )
        if arch.qkv_bias:
            out[mp + "self_attention.linear_qkv.bias"] = qkv_to_megatron(
                get(hp + "self_attn.q_proj.bias", (nq,)),
                get(hp + "self_attn.k_proj.bias", (nkv,)),
                get(hp + "self_attn.v_proj.bias", (nkv,)),
                arch,
            )
        out[mp + "self_attention.linear_proj.weight"] = get(hp + "self_attn.o_proj.weight", (h, nq))
        out[mp + "pre_mlp_layernorm.weight"] = get(hp + "post_attention_layernorm.weight", (h,))
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [get(hp + "mlp.gate_proj.weight", (ffn, h)), get(hp + "mlp.up_proj.weight", (ffn, h))], dim=0
        )
        out[mp + "mlp.linear_fc2.weight"] = get(hp + "mlp.down_proj.weight", (h, ffn))
    out["decoder.final_layernorm.weight"] = get("model.norm.weight", (h,))
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = get("lm_head.weight", (arch.vocab_size, h))
    return out


def megatron_to_hf(name: str, tensor: torch.Tensor, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (local-spec or TE name, global layer number) -> its HF tensors."""
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
        return
    if name == "output_layer.weight":
        yield "lm_head.weight", tensor
        return
    parsed = layer_of(name)
    if parsed is None:
        raise KeyError(f"no Hugging Face name for Megatron tensor '{name}'")
    i, suffix = parsed
    suffix = {te: local for local, te in TE_NORM_NAMES.items()}.get(suffix, suffix)
    hp = f"model.layers.{i}."
    if suffix in _LAYER_ONE_TO_ONE:
        yield hp + _LAYER_ONE_TO_ONE[suffix], tensor
    elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = qkv_from_megatron(tensor, arch)
        yield hp + f"self_attn.q_proj.{kind}", q
        yield hp + f"self_attn.k_proj.{kind}", k
        yield hp + f"self_attn.v_proj.{kind}", v
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield hp + "mlp.gate_proj.weight", gate
        yield hp + "mlp.up_proj.weight", up
    else:
        raise KeyError(f"no Hugging Face name for Megatron tensor '{name}'")


# ---------------------------------------------------------------- tensor parallel


def tp_split_dim(name: str) -> int | None:
    """The dim a tensor is split on across TP ranks (None: replicated)."""
    suffix = (layer_of(name) or (None, name))[1]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if suffix.startswith("self_attention.linear_qkv.") and "layer_norm" not in suffix:
        return 0
    if suffix == "mlp.linear_fc1.weight":
        return 0
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (gate and up chunked separately for fc1)."""
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    if full.shape[dim] % tp_size:
        raise ValueError(f"'{name}' dim {dim} of size {full.shape[dim]} does not split over tp={tp_size} ranks")
    return full.chunk(tp_size, dim)[tp_rank]


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of tp_shard: the full tensor from every TP rank's slice, in rank order."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)
