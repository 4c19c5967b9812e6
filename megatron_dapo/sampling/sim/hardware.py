"""The simulator's hardware: dense decoder shapes (parameters, weight and KV bytes) and GPU datasheet numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape: enough to count its parameters, weight bytes and KV bytes per token."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qkv_bias: bool
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16

    @property
    def params(self) -> int:
        """Parameter count N: attention (with QKV bias if any), gated MLP, norms, embeddings (+ output head)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


QWEN25_32B = ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064, qkv_bias=True)
LLAMA3_70B = ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, qkv_bias=False)
LLAMA3_8B = ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, qkv_bias=False)


@dataclass(frozen=True)
class GPUSpec:
    name: str = "H100 SXM 80GB"
    memory_bytes: float = 80e9
    bandwidth: float = 3.35e12
    """HBM3, bytes/s (datasheet)."""
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s (datasheet)."""


H100 = GPUSpec()
