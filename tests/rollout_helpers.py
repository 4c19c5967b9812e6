"""Tiny-model fixtures for the rollout tests: a random Qwen2 checkpoint and its byte-level BPE tokenizer.

Nothing can be downloaded here, so the model is built from a config with transformers and saved as float32
safetensors next to a tokenizer trained by megatron_dapo.data.tokenizer.train_byte_bpe_tokenizer.
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


def build_tiny_qwen2(out_dir: str | Path, seed: int = 0, vocab_size: int = 320) -> Path:
    """Save a random tiny Qwen2ForCausalLM (float32 safetensors) and its tokenizer to out_dir; return the path.

    The model's vocabulary equals the tokenizer's (len(tokenizer)), so every sampled id decodes.
    eos = <|im_end|>, pad = <|endoftext|>.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.data.tokenizer import train_byte_bpe_tokenizer

    out_dir = Path(out_dir)
    tok = train_byte_bpe_tokenizer(CORPUS, out_dir, vocab_size=vocab_size)
    config = Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        **TINY_QWEN2,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_hf_model(model_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None):
    """The float32 transformers reference model, optionally with state_dict (HF names) loaded over it."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None) -> list[int]:
    """transformers' generate(do_sample=False) continuation of prompt_ids (the prompt excluded)."""
    inp = torch.tensor([prompt_ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if isinstance(eos_token_id, int) else None,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at each response token: float32 [len(response_ids)]."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [R, V]: position t predicts token t+1
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def perturbed_state_dict(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """model's state dict (HF names) with every weight perturbed by scale * N(0, std(weight)): a new policy."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in model.state_dict().items():
        noise = torch.randn(w.shape, generator=g, dtype=w.dtype)
        out[name] = (w + scale * w.std().clamp_min(1e-3) * noise).contiguous()
    return out
