"""Core attention through torch's fused scaled_dot_product_attention, for Megatron's local layer spec.

Megatron-Core's local `DotProductAttention` materialises [b, heads, s, s] scores (bf16) and their softmax (fp32
without Transformer Engine's fused kernel), so at 4096 tokens attention was most of a 1.5B train step and its
memory. `SDPAttention` takes the same constructor arguments (Megatron's extension point: the layer spec's
`core_attention` class) and computes the same function with `torch.nn.functional.scaled_dot_product_attention`:
the flash or memory-efficient kernel on CUDA, the fused flash kernel on CPU, O(s) memory per head.

Shapes (Megatron's): padded rows q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads * d]; packed rows
(THD, `packed_seq_params.qkv_format == "thd"`, the batch dimension squeezed by Megatron's Attention) q [t, heads, d],
k/v [t, groups, d] -> [t, heads * d], one causal sequence per `cu_seqlens_q` segment. Grouped-query attention maps
query head h to KV group h // (heads / groups), as Megatron's repeat_interleave does. Context parallel needs
Transformer Engine's ring attention: this module refuses cp > 1 as `DotProductAttention` does.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def repeat_kv(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Each KV head n times in place, [.., groups, ..] -> [.., groups * n, ..] along dim: query head h reads group
    h // n (Megatron's and SDPA's enable_gqa order), for kernels that take no grouped heads."""
    return x.repeat_interleave(n, dim=dim) if n > 1 else x


def _varlen_kwargs(heads: int, groups: int) -> tuple[dict, bool]:
    """(causal keyword arguments for this torch's varlen_attn, whether KV heads must be repeated first):
    torch 2.10 took is_causal, later versions a window (-1, 0); enable_gqa is not in every version."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if heads != groups and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
        return kwargs, False
    return kwargs, heads != groups


class SDPAttention(MegatronModule):
    """Causal self-attention of Megatron's core-attention interface through scaled_dot_product_attention."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        varlen: bool = False,
        expand_kv: bool = False,
    ):
        """Megatron's DotProductAttention arguments, and (the layer spec's params) varlen: packed rows through torch's
        `varlen_attn` (one kernel for the whole pack) on CUDA (`model.varlen_attention`; CPU has no varlen kernel, so
        there packed rows always take one SDPA call per sequence); expand_kv: repeat the KV heads instead of SDPA's
        enable_gqa (with grouped heads only the flash backend qualifies: this lets the others be timed)."""
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention has no context parallel (ring attention): use Transformer Engine's")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention computes causal self-attention only, not {attn_mask_type}")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention has no sliding window and no softmax offset")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scores by the layer number and multiplies them back inside the
        # softmax: the same function, so only the plain scale matters here
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPAttention has no attention dropout (got {dropout}): the policy trains without it")
        self.varlen, self.expand_kv = varlen, expand_kv

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d], causal."""
        grouped = self.heads != self.groups
        if grouped and self.expand_kv:
            k, v = (repeat_kv(x, self.heads // self.groups, dim=1) for x in (k, v))
            grouped = False
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            # the policy passes neither (causal masking is built in); an explicit mask would be silently ignored
            raise ValueError("SDPAttention takes no attention_mask or attention_bias: it is causal by construction")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        s, b = query.shape[:2]
        # [s, b, h, d] -> [b, h, s, d]: views; SDPA takes strided inputs whose last dimension is contiguous
        out = self._sdpa(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * out.shape[-1])

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """THD rows: q [t, heads, d], k/v [t, groups, d] -> [t, heads * d], each cu_seqlens segment its own
        causal sequence (the row's padding is a segment of its own: it attends to itself only)."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        t, d = query.shape[0], query.shape[-1]
        if self.varlen and query.is_cuda:
            from torch.nn.attention.varlen import varlen_attn

            kwargs, repeat = _varlen_kwargs(self.heads, self.groups)
            if repeat or self.expand_kv:
                kwargs.pop("enable_gqa", None)
                key, value = (repeat_kv(x, self.heads // self.groups, dim=1) for x in (key, value))
            out = varlen_attn(
                query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_kv, scale=self.softmax_scale, **kwargs
            )
            return out.reshape(t, self.heads * d)
        bounds = cu.tolist()
        parts = []
        for start, end in zip(bounds, bounds[1:]):
            # [n, h, d] -> [1, h, n, d]
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            parts.append(self._sdpa(q, k, v).squeeze(0).transpose(0, 1))
        return torch.cat(parts).reshape(t, self.heads * d)
