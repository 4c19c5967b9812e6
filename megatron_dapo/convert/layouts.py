"""Hugging Face <-> Megatron-Core names and layouts for Qwen2/Qwen2.5, Qwen3 (dense and MoE) and Llama.

Written once, used by the model loader, the weight bridge and the conversion tools.

`linear_qkv` fuses q, k and v grouped per query group: for each of the num_key_value_heads groups, its
heads_per_group query heads, then its k head, then its v head (so a tensor-parallel split is a plain chunk
of whole groups); `linear_fc1` is cat(gate, up) on dim 0. Qwen3's per-head norms map one to one (q_norm ->
`self_attention.q_layernorm`, k_norm -> `self_attention.k_layernorm`, each [head_dim], replicated over TP).
Qwen3-MoE's expert layers: the router `mlp.gate.weight` -> `mlp.router.weight` ([experts, hidden]), and expert e's
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (the checkpoint's layout; transformers fuses them in memory as
`mlp.experts.gate_up_proj` [experts, 2 ffn, hidden] and `mlp.experts.down_proj` [experts, hidden, ffn], which
hf_to_megatron reads too) -> `mlp.experts.local_experts.{e}.linear_fc1.weight` = cat(gate, up) and `linear_fc2` =
down. How Megatron splits each tensor across TP (and expert) ranks, and the Transformer Engine spec's names, are
model/sharding.py's.

Names here are "full" Megatron names with global layer numbers; model/ maps them to a
pipeline stage's local numbering.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.sharding import expert_of, layer_of, local_suffix

# Megatron per-layer suffix (local spec) -> HF per-layer suffix, for the 1:1 tensors.
_LAYER_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}

_QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
"""Megatron -> HF suffixes of the per-head query and key norms (ModelArch.qk_layernorm: Qwen3)."""


def megatron_names(arch: ModelArch) -> list[str]:
    """Every full Megatron parameter name of the model (local-spec names), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_layernorm:
            names += [p + suffix for suffix in _QK_NORMS]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if i in arch.moe_layers:
            names.append(p + "mlp.router.weight")
            for e in range(arch.num_experts):
                names += [p + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
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
    expert = expert_of(name)
    if expert is not None:
        ffn = arch.moe_intermediate_size
        return (2 * ffn, h) if expert[2] == "linear_fc1.weight" else (h, ffn)
    suffix = local_suffix((layer_of(name) or (None, ""))[1])
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (q + 2 * kv, h),
        "self_attention.linear_qkv.bias": (q + 2 * kv,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, q),
        "mlp.linear_fc1.weight": (2 * arch.intermediate_size, h),
        "mlp.linear_fc2.weight": (h, arch.intermediate_size),
        "mlp.router.weight": (arch.num_experts, h),
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
        if arch.qk_layernorm:
            for m_suffix, hf_suffix in _QK_NORMS.items():
                out[mp + m_suffix] = get(hp + hf_suffix, (d,))
        out[mp + "self_attention.linear_proj.weight"] = get(hp + "self_attn.o_proj.weight", (h, nq))
        out[mp + "pre_mlp_layernorm.weight"] = get(hp + "post_attention_layernorm.weight", (h,))
        if i in arch.moe_layers:
            out.update(_experts_to_megatron(hf, i, arch, get))
            continue
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [get(hp + "mlp.gate_proj.weight", (ffn, h)), get(hp + "mlp.up_proj.weight", (ffn, h))], dim=0
        )
        out[mp + "mlp.linear_fc2.weight"] = get(hp + "mlp.down_proj.weight", (h, ffn))
    out["decoder.final_layernorm.weight"] = get("model.norm.weight", (h,))
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = get("lm_head.weight", (arch.vocab_size, h))
    return out


def _experts_to_megatron(hf, i: int, arch: ModelArch, get) -> dict[str, torch.Tensor]:
    """Layer i's router and experts: from the checkpoint's per-expert tensors, or transformers' fused in-memory
    ones (a state_dict of a loaded model). get(name, shape): the checked lookup of hf_to_megatron."""
    h, ffn, n = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    hp, mp = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    out = {mp + "router.weight": get(hp + "gate.weight", (n, h))}
    fused = hp + "experts.gate_up_proj" in hf
    if fused:  # [experts, 2 ffn, hidden] is cat(gate, up) per expert already
        gate_up, down = get(hp + "experts.gate_up_proj", (n, 2 * ffn, h)), get(hp + "experts.down_proj", (n, h, ffn))
    for e in range(n):
        ep = mp + f"experts.local_experts.{e}."
        if fused:
            out[ep + "linear_fc1.weight"], out[ep + "linear_fc2.weight"] = gate_up[e], down[e]
            continue
        x = hp + f"experts.{e}."
        gate, up = get(x + "gate_proj.weight", (ffn, h)), get(x + "up_proj.weight", (ffn, h))
        out[ep + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[ep + "linear_fc2.weight"] = get(x + "down_proj.weight", (h, ffn))
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
    suffix = local_suffix(suffix)
    hp = f"model.layers.{i}."
    mlp = hp + "mlp."
    expert = expert_of(name)
    if expert is not None:  # an expert's MLP under the checkpoint's per-expert names (what vLLM and transformers load)
        mlp, suffix = hp + f"mlp.experts.{expert[1]}.", "mlp." + expert[2]
    if suffix == "mlp.router.weight":
        yield hp + "mlp.gate.weight", tensor
    elif suffix == "mlp.linear_fc2.weight":
        yield mlp + "down_proj.weight", tensor
    elif suffix in _LAYER_ONE_TO_ONE:
        yield hp + _LAYER_ONE_TO_ONE[suffix], tensor
    elif suffix in _QK_NORMS and arch.qk_layernorm:
        yield hp + _QK_NORMS[suffix], tensor
    elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = qkv_from_megatron(tensor, arch)
        yield hp + f"self_attn.q_proj.{kind}", q
        yield hp + f"self_attn.k_proj.{kind}", k
        yield hp + f"self_attn.v_proj.{kind}", v
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield mlp + "gate_proj.weight", gate
        yield mlp + "up_proj.weight", up
    else:
        raise KeyError(f"no Hugging Face name for Megatron tensor '{name}'")
