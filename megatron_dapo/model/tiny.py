"""A tiny random Qwen2 checkpoint with its own byte-level BPE tokenizer, for tests, benchmarks and the CPU demo.

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


def build_tiny_qwen2(
    out_dir: str | Path, seed: int = 0, vocab_size: int = 320, corpus: list[str] | None = None, **overrides
) -> Path:
    """Save a random tiny Qwen2ForCausalLM (float32 safetensors) and its tokenizer to out_dir; return the path.

    The model's vocabulary equals the tokenizer's (len(tokenizer)), so every sampled id decodes.
    corpus: texts the tokenizer's merges are trained on; overrides: Qwen2Config fields over TINY_QWEN2.
    eos = <|im_end|>, pad = <|endoftext|>.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.model.tokenizer import train_byte_bpe_tokenizer

    out_dir = Path(out_dir)
    tok = train_byte_bpe_tokenizer(corpus or CORPUS, out_dir, vocab_size=vocab_size)
    config = Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        **{**TINY_QWEN2, **overrides},
    )
    with torch.random.fork_rng():  # seeded here without reseeding the caller's global generator
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
