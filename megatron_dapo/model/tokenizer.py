"""A tiny byte-level BPE tokenizer with a ChatML chat template, for tiny models on CPU (nothing can be downloaded).

Byte-level BPE round-trips arbitrary text exactly: every byte has a token, so nothing is ever
unknown or dropped. (A WordLevel tokenizer under a Qwen2 model silently drops text: transformers
5.x forces Qwen2Tokenizer and replaces its pre-tokenizer.)

    tok = train_byte_bpe_tokenizer(texts, "runs/tok", vocab_size=512)
    tok = AutoTokenizer.from_pretrained("runs/tok")   # the same tokenizer, reloaded
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2's ChatML layout without its default system message: <|im_start|>{role}\\n{content}<|im_end|>\\n."""
GENERATION_PROMPT = "<|im_start|>assistant\n"

QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's split pattern: with it a directory that also holds a Qwen2 config.json (for which transformers 5.x
forces Qwen2Tokenizer and rebuilds the pre-tokenizer) tokenizes NFC text to the same ids."""


def train_byte_bpe_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE on texts (Iterable[str]), save it to out_dir, return it (PreTrainedTokenizerFast).

    Special tokens: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos); chat template: CHATML_TEMPLATE.
    vocab_size counts the 256 byte tokens and the 3 special tokens, so it must be at least 259.
    AutoTokenizer.from_pretrained(out_dir) loads the same tokenizer back.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size}: expected at least {len(alphabet) + len(SPECIAL_TOKENS)} (bytes + specials)"
        )
    core = Tokenizer(models.BPE())
    # no normalizer (Qwen2Tokenizer adds NFC, which changes non-NFC text); add_prefix_space=False: a leading
    # space would be invented on encode and survive decode
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,  # all 256 bytes, even those the texts lack: exact round trips on any text
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,  # the cleanup rewrites " ." to "." and breaks round trips
        model_max_length=1 << 30,
    )
    tok.chat_template = CHATML_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok
