"""Tiny random Qwen2, Qwen3 and Qwen3-MoE checkpoints with their own byte-level BPE tokenizer, for tests, benchmarks and the demo.

Nothing can be downloaded here, so the model is built from a config with transformers and
saved as float32 safetensors next to a tokenizer trained by
megatron_dapo.model.tokenizer.train_byte_bpe_tokenizer: an ordinary HF model directory that
transformers, vLLM and our converters load.
"""

from __future__ import annotations

from pathlib import Path

import torch

# A few lines of text to train the BPE merges on: arithmetic words and digits, like the prompts.
CORPUS = [
    "What is 12 + 30? Answer: 42",
    "Compute 7 * 6 and give the final answer. Answer: 42",
    "The sum of the first ten positive integers is 55.",
    "If x + 3 = 10, then x = 7. Therefore the answer is 7.",
    "Let's think step by step. First, we add the numbers.",
] * 4

# head_dim = hidden / heads = 32: vLLM's CPU attention supports head_dim in {32, 64, 80, ...}, not 16.
TINY_QWEN2 = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # a wide init spreads the logits, so greedy argmax margins are far above fp32 noise
    initializer_range=0.1,
)

# Qwen3's head_dim is its own field: 64 here, not hidden / heads = 32, so code that derives it fails on shapes.
TINY_QWEN3 = {**TINY_QWEN2, "head_dim": 64}

# Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers), 8 experts of width 64, each token to its best 2, the
# two weights renormalised (Qwen3-30B-A3B's norm_topk_prob); head_dim 32 is hidden / heads here (vLLM's CPU attention
# takes 32), so Qwen3's own-head_dim check stays with TINY_QWEN3.
TINY_QWEN3_MOE = {
    **TINY_QWEN2,
    "num_hidden_layers": 3,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "router_aux_loss_coef": 0.001,
}

ROUTER_TIE_STD = 0.01
"""The tiny MoE's router rows come in pairs: row e + E/2 is row e plus this much relative noise, so a token whose
best experts include e often finds e + E/2 within a few hundredths of a logit: far above float32 rounding (the
trainer and transformers pick alike) and within bfloat16's (a bf16 engine flips some of them)."""

QK_NORM_STD = 0.3
"""Spread of the tiny Qwen3's q_norm / k_norm weights around 1: transformers initialises both to ones, and a model
whose two norms are equal would hide a swap of them."""


def build_tiny_qwen2(
    out_dir: str | Path, seed: int = 0, vocab_size: int = 320, corpus: list[str] | None = None, **overrides
) -> Path:
    """Save a random tiny Qwen2ForCausalLM (float32 safetensors) and its tokenizer to out_dir; return the path.

    The model's vocabulary equals the tokenizer's (len(tokenizer)), so every sampled id decodes.
    corpus: texts the tokenizer's merges are trained on; overrides: Qwen2Config fields over TINY_QWEN2.
    eos = <|im_end|>, pad = <|endoftext|>.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2Config, Qwen2ForCausalLM, {**TINY_QWEN2, **overrides}, out_dir, seed, vocab_size, corpus)


def build_tiny_qwen3(
    out_dir: str | Path, seed: int = 0, vocab_size: int = 320, corpus: list[str] | None = None, **overrides
) -> Path:
    """build_tiny_qwen2's Qwen3ForCausalLM: 2 layers, head_dim 64 (not hidden/heads), no QKV bias, and q_norm and
    k_norm weights 1 + QK_NORM_STD * N(0, 1), drawn separately for each. overrides: Qwen3Config fields over TINY_QWEN3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**TINY_QWEN3, **overrides}
    return _build(Qwen3Config, Qwen3ForCausalLM, fields, out_dir, seed, vocab_size, corpus, spread_qk_norms)


def build_tiny_qwen3_moe(
    out_dir: str | Path, seed: int = 0, vocab_size: int = 320, corpus: list[str] | None = None, **overrides
) -> Path:
    """build_tiny_qwen3's Qwen3MoeForCausalLM (TINY_QWEN3_MOE): distinct random experts, a router with near-ties
    (ROUTER_TIE_STD), spread q/k norms. overrides: Qwen3MoeConfig fields over TINY_QWEN3_MOE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {**TINY_QWEN3_MOE, **overrides}
    return _build(Qwen3MoeConfig, Qwen3MoeForCausalLM, fields, out_dir, seed, vocab_size, corpus, moe_init)


def moe_init(model) -> None:
    """Qwen3-MoE weights where a port's mistakes show: q/k norms neither ones nor equal (spread_qk_norms), and
    each router of E rows in pairs e, e + E/2 that differ by ROUTER_TIE_STD relative noise (near-ties between
    experts). Draws from the global generator (seed it first)."""
    spread_qk_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                half = p.shape[0] // 2
                p[half : 2 * half] = p[:half] * (1 + ROUTER_TIE_STD * torch.randn_like(p[:half]))


def spread_qk_norms(model) -> None:
    """q_norm / k_norm weights 1 + QK_NORM_STD * N(0, 1), each drawn on its own (transformers initialises both to 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn_like(p) * QK_NORM_STD)


def random_model(model_cls, config, seed: int, after_init=None):
    """model_cls(config) in float32 and eval mode, initialised from `seed`, then after_init(model) (drawing from the
    same generator): the one way the tiny models here, in the preflight and in the tests are drawn. The caller's
    global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global generator
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        if after_init is not None:
            after_init(model)
    return model


def _build(config_cls, model_cls, fields: dict, out_dir, seed: int, vocab_size: int, corpus, after_init=None) -> Path:
    """The tokenizer, then the model from config_cls(**fields) on it, initialised from `seed`, then after_init(model)."""
    from megatron_dapo.model.tokenizer import train_byte_bpe_tokenizer

    out_dir = Path(out_dir)
    tok = train_byte_bpe_tokenizer(corpus or CORPUS, out_dir, vocab_size=vocab_size)
    config = config_cls(
        vocab_size=len(tok),
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        **fields,
    )
    random_model(model_cls, config, seed, after_init).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
