"""The model families we run, read from a Hugging Face config.json.

Qwen2/Qwen2.5, Qwen3 (dense and mixture-of-experts) and Llama share one decoder shape (pre-RMSNorm, RoPE, GQA, SwiGLU); they
differ in the QKV bias (Qwen2 has it; Qwen3 and Llama take it from `attention_bias`, off in every released
checkpoint), in Qwen3's RMSNorm on each head's queries and keys before RoPE (`qk_layernorm`), in Qwen3's
`head_dim`, which is its own field and not hidden/heads (Qwen3-32B: 64 heads of 128 = 8192 against a hidden of
5120), and in defaults. Qwen3-MoE is Qwen3 with the MLP of some layers (`decoder_sparse_step`, less
`mlp_only_layers`) replaced by `num_experts` SwiGLU experts of `moe_intermediate_size`, each token sent to its
`num_experts_per_tok` best by a linear router: softmax over every expert's logit, the top k kept, their weights
renormalised to sum to 1 when `norm_topk_prob`. `ModelArch` is that shape, and the only thing the Megatron provider
and the weight maps need to know about a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
"""config.json's `architectures` entry -> family; its `model_type` is the family's name."""

UNSUPPORTED_MOE_FIELDS = {
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0,
    "num_shared_experts": 0,
    "moe_layer_freq": None,
    "first_k_dense_replace": 0,
    "n_group": None,
    "topk_group": None,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "topk_method": "greedy",
}
"""MoE fields of other families (shared experts, group-limited or sigmoid routing, scaled weights) that a Qwen3-MoE
config.json must not set to anything but the value here: a checkpoint that uses one is refused, never mis-built."""


class ArchError(ValueError):
    """A config.json we cannot build: the message names the file, the field and what was expected."""


@dataclass(frozen=True)
class ModelArch:
    family: str
    """'qwen2', 'qwen3', 'qwen3_moe' or 'llama'."""
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
    num_experts: int = 0
    """Routed experts in each MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is sent to (the router's top k)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width (intermediate_size is the dense layers')."""
    norm_topk_prob: bool = False
    """The top k weights renormalised to sum to 1 (softmax over the k logits); False keeps the softmax over all."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the layers whose MLP is the experts; the others are dense."""
    router_aux_loss_coef: float = 0.0
    """The load-balancing loss coefficient the checkpoint was pre-trained with (informational: the trainer's is
    model.moe_aux_loss_coeff)."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_index(self, layer: int) -> int:
        """A global layer's place among the MoE layers (its routes' layer axis); ValueError for a dense layer."""
        return self.moe_layers.index(layer)

    @staticmethod
    def from_hf_config(config: dict[str, Any], source: str = "config.json") -> ModelArch:
        """From the dict of a Hugging Face config.json (or `PretrainedConfig.to_dict()`)."""
        archs = config.get("architectures") or []
        family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        # model_type only where no architecture is named: one we cannot map (Qwen2MoeForCausalLM) is refused
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
        # read, never derived; the others (Qwen3-MoE included) fall back to hidden/heads as transformers does
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
        layers = int(need("num_hidden_layers"))
        moe = _moe_fields(config, layers, source) if family == "qwen3_moe" else {}
        return ModelArch(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            qk_layernorm=family in ("qwen3", "qwen3_moe"),
            **moe,
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


def _moe_fields(config: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelArch's MoE fields from a Qwen3-MoE config.json; a field this code cannot honour is refused by name."""

    def positive(key: str, default: Any = None) -> int:
        value = config.get(key, default)
        if key == "num_experts" and value is None:  # transformers 5 saves it under its attribute_map name
            key, value = "num_local_experts", config.get("num_local_experts")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArchError(f"{source}: field '{key}'={value!r}; expected an integer >= 1")
        return value

    for key, allowed in UNSUPPORTED_MOE_FIELDS.items():
        if config.get(key, allowed) not in (allowed, None):
            raise ArchError(
                f"{source}: field '{key}'={config[key]!r} is not supported (Qwen3-MoE routing only); expected "
                f"{allowed!r} or absent"
            )
    experts = positive("num_experts")
    topk = positive("num_experts_per_tok")
    if topk > experts:
        raise ArchError(f"{source}: field 'num_experts_per_tok'={topk} exceeds num_experts={experts}")
    step = positive("decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ArchError(
            f"{source}: field 'mlp_only_layers'={dense!r}; expected a list of layer indices 0..{layers - 1}"
        )
    # transformers' rule (Qwen3MoeDecoderLayer): experts where (i + 1) % decoder_sparse_step == 0, unless listed
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not moe_layers:
        raise ArchError(
            f"{source}: fields 'decoder_sparse_step'={step} and 'mlp_only_layers'={dense} leave no MoE layer"
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=positive("moe_intermediate_size"),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
        router_aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0),
    )
