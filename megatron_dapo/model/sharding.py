"""How Megatron-Core names, splits and places the tensors of a GPTModel across tensor-parallel ranks.

Names here are "full" Megatron names with global layer numbers ('decoder.layers.7.mlp.linear_fc2.weight');
provider.local_slots maps a pipeline stage's local numbering to them, convert/layouts.py maps them to
Hugging Face names.

Megatron layout facts (local and Transformer Engine specs alike):
- `linear_qkv` and `linear_fc1` split on dim 0; `linear_fc1` is cat(gate, up) on dim 0, so each TP rank
  holds cat(gate_r, up_r).
- `linear_proj` and `linear_fc2` split on dim 1; the embedding and the output layer on dim 0 (the
  vocabulary); norms are replicated.
- With the TE spec the input/pre-MLP norms live inside the next linear layer as `layer_norm_weight` (not in a
  MoE layer, whose pre-MLP norm stays its own module).
- A MoE layer's router (`mlp.router.weight`, [experts, hidden]) is replicated; its experts
  (`mlp.experts.local_experts.{e}.linear_fc1/fc2.weight`, TE's grouped GEMM: `mlp.experts.linear_fc1.weight{e}`)
  split like a dense MLP's fc1 and fc2, but over the expert tensor-parallel group (parallel.etp), and each
  expert-parallel rank holds num_experts / ep of them. Full names number experts globally; a rank's local index j
  is expert ep_rank * (num_experts / ep) + j.
"""

from __future__ import annotations

import re

import torch

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_TE_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Local-spec norm suffix -> its Transformer Engine spec name (fused into the following linear layer)."""

_LOCAL_NORM_NAMES = {te: local for local, te in TE_NORM_NAMES.items()}


def layer_of(name: str) -> tuple[int, str] | None:
    """'decoder.layers.7.mlp.linear_fc2.weight' -> (7, 'mlp.linear_fc2.weight'); None for non-layer names."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def local_suffix(suffix: str) -> str:
    """A per-layer suffix in local-spec naming: TE's fused norm names and grouped-GEMM expert names mapped back,
    every other one unchanged."""
    grouped = _TE_EXPERT_RE.match(suffix)
    if grouped:
        return f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return _LOCAL_NORM_NAMES.get(suffix, suffix)


def expert_of(name: str) -> tuple[int, int, str] | None:
    """'decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight' -> (3, 5, 'linear_fc1.weight'); None for a
    tensor that is no expert's."""
    parsed = layer_of(name)
    m = _EXPERT_RE.match(local_suffix(parsed[1])) if parsed else None
    return (parsed[0], int(m.group(1)), m.group(2)) if m else None


def with_expert(name: str, expert: int) -> str:
    """An expert tensor's name with its expert index replaced (local <-> global numbering)."""
    layer, _, rest = expert_of(name)
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{rest}"


def tp_split_dim(name: str) -> int | None:
    """The dim a tensor is split on across TP ranks, or for an expert's across expert-TP ranks (None: replicated)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    suffix = local_suffix((layer_of(name) or (None, name))[1])
    expert = _EXPERT_RE.match(suffix)
    if expert:
        suffix = "mlp." + expert.group(2)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight"):
        return 0
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (gate and up chunked separately for fc1). An expert's tensor
    takes its expert tensor-parallel rank and size here."""
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
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
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)
