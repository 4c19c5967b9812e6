"""The model families we run, read from a Hugging Face config.json.

Qwen2/Qwen2.5, Qwen3 (dense) and Llama share one decoder shape (pre-RMSNorm, RoPE, GQA, SwiGLU); they
differ in the QKV bias (Qwen2 has it; Qwen3 and Llama take it from `attention_bias`, off in every released
checkpoint), in Qwen3's RMSNorm on each head's queries and keys before RoPE (`qk_layernorm`), in Qwen3's
`head_dim`, which is its own field and not hidden/heads (Qwen3-32B: 64 heads of 128 = 8192 against a hidden of
5120), and in defaults. `ModelArch` is that shape, and the only thing the Megatron provider and the weight maps
need to know about a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
"""config.json's `architectures` entry -> family; its `model_type` is the family's name."""


class ArchError(ValueError):
    """A config.json we cannot build: the message names the file, the field and what was expected."""


@dataclass(frozen=True)
class ModelArch:
    family: str
    """'qwen2', 'qwen3' or 'llama'."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    qk_layernorm: bool = False
    """RMSNorm over head_dim on every query and key head before RoPE (Qwen3's q_norm / k_norm, weights [head_dim])."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @staticmethod
    def from_hf_config(config: dict[str, Any], source: str = "config.json") -> ModelArch:
        """From the dict of a Hugging Face config.json (or `PretrainedConfig.to_dict()`)."""
        archs = config.get("architectures") or []
        family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        # model_type only where no architecture is named: one we cannot map (Qwen3MoeForCausalLM) is refused
        # whatever its model_type says
        if not archs:
            family = {f: f for f in SUPPORTED.values()}.get(config.get("model_type", ""))
        if family is None:
            raise ArchError(
                f"{source}: field 'architectures'={archs} (model_type={config.get('model_type')!r}) is not supported; "
                f"expected one of {sorted(SUPPORTED)}"
            )

        def need(key: str) -> Any:
            if key not in config or config[key] is None:
                raise ArchError(f"{source}: field '{key}' is missing; a {family} config needs it")
            return config[key]

        heads = int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        if heads % kv_heads:
            raise ArchError(f"{source}: field 'num_key_value_heads'={kv_heads} must divide num_attention_heads={heads}")
        # Qwen3 states head_dim (transformers' Qwen3Config defaults it to 128 whatever the hidden size), so it is
        # read, never derived; the others fall back to hidden/heads as transformers does
        head_dim = int(need("head_dim")) if family == "qwen3" else int(config.get("head_dim") or hidden // heads)
        if config.get("use_sliding_window"):
            raise ArchError(
                f"{source}: field 'use_sliding_window'=true is not supported; expected false (full attention)"
            )
        rope = config.get("rope_theta")
        if rope is None:  # transformers 5 moves it into rope_parameters
            rope = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        rope_scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
        if rope_scaling.get("rope_type", "default") not in ("default", None):
            raise ArchError(
                f"{source}: field 'rope_scaling' type {rope_scaling.get('rope_type')!r} is not supported; "
                "expected plain RoPE"
            )
        qkv_bias = family == "qwen2" or bool(config.get("attention_bias", False))  # Qwen2: always, no field
        if family == "llama" and config.get("mlp_bias"):
            raise ArchError(f"{source}: field 'mlp_bias'=true is not supported; expected false")
        return ModelArch(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            qk_layernorm=family == "qwen3",
        )

    @staticmethod
    def from_hf_dir(path: str | Path) -> ModelArch:
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ArchError(f"{f}: no config.json in the model directory {path}")
        try:
            config = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ArchError(f"{f}: not valid JSON: {e}") from None
        return ModelArch.from_hf_config(config, str(f))
