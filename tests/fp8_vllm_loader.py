"""Load FP8 block-quantized tensors into the installed vLLM's own Qwen2 model with its FP8 config, on CPU.

    python fp8_vllm_loader.py MODEL_DIR TENSORS.pt OUT.pt

MODEL_DIR: a Hugging Face Qwen2 directory (config.json); TENSORS.pt: {Hugging Face name: tensor} as the weight
bridge sends them for an FP8 engine. The model is built with vLLM's Fp8Config (weight_block_size [128, 128], the
quantization_config our GPU engine starts with), so every linear layer is created by vLLM's Fp8LinearMethod
(fp8 `weight`, BlockQuantScaleParameter `weight_scale_inv`), and the tensors go through the model's own
load_weights (name mapping, q/k/v and gate/up packing, per-shard scale placement). Writes OUT.pt:
{"loaded": the names load_weights reports, "params": vLLM's parameter names, "state": {name: tensor}}.

One thing is replaced: the choice of an FP8 matmul kernel at layer construction, which on a CPU without AMX
raises ("CPUFp8BlockScaledMMKernel requires AMX tile support"); nothing here runs a matmul, and weight loading
never touches the kernel. Runs in its own process: it sets up vLLM's global distributed state.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch


def main(model_dir: str, tensors: str, out: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from megatron_dapo.rollout.quantize import FP8_CONFIG

    fp8.init_fp8_linear_kernel = lambda **kwargs: None  # kernel choice only (see the module docstring)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)  # the config our GPU engine starts with: the checkpoint's config.json + FP8_CONFIG
        shutil.copy(Path(model_dir) / "config.json", d / "config.json")
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = FP8_CONFIG
        (d / "config.json").write_text(json.dumps(cfg))
        model_config = ModelConfig(model=str(d), tokenizer=str(d), skip_tokenizer_init=True, dtype="bfloat16")
        vllm_config = VllmConfig(model_config=model_config)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
            from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

            torch.set_default_dtype(model_config.dtype)  # as vLLM's loader builds a model: unquantized params in dtype
            model = Qwen2ForCausalLM(vllm_config=vllm_config)
            named = torch.load(tensors)
            loaded = model.load_weights(iter(named.items()))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"loaded": sorted(loaded), "params": sorted(state), "state": state}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
