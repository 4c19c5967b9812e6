"""What a model costs and what the device can do: FLOPs per token, parameter counts, peak matmul and copy rates.

The accounting tools/bench_train.py, tools/bench_throughput.py, tools/estimate_step_time.py and tools/preflight.py
share. Model FLOPs per trained token = 6 x (matmul parameters) + 6 x layers x seq x q_heads x head_dim (causal
attention: half of the 12 L s d of full attention), the usual accounting (Megatron-LM, PaLM). For a mixture of
experts the matmul parameters are the *active* ones: a token goes through its top-k experts' SwiGLU and the router,
not through every expert (active_param_count; param_count is the total every rank's weights and the weight sync
carry). MFU = achieved model FLOP/s per device / peak FLOP/s per device; the old-logprob forward does a third of the
train step's FLOPs (2 per parameter per token).

Torch is imported inside the functions that time something, so a tool that only counts answers --help fast.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}
SHAPES: dict[str, tuple | dict] = {
    # name: (hidden, ffn, layers, heads, kv_heads, vocab): a Qwen2 (QKV bias, head_dim = hidden / heads, untied)
    "tiny": (256, 704, 4, 4, 2, 4096),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064),
    # name: the shape fields of the model's config.json (Hugging Face Hub): Qwen3-MoE, every layer's MLP 128 experts
    # (intermediate_size, the width of a dense layer's MLP, is unused: mlp_only_layers is empty)
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "moe_intermediate_size": 768,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "moe_intermediate_size": 1536,
    },
}


SPEC_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 TFLOP/s of the card's data sheet (SXM), the denominator published MFU figures use (Megatron-LM's
tables, PaLM): a card's own measured matmul rate is lower (757-796 TFLOP/s seen here), so MFU against it reads high."""


def spec_tflops(device_name: str) -> float | None:
    """The data-sheet dense bf16 rate of a GPU named like 'NVIDIA H100 80GB HBM3', or None for a card not listed."""
    return next((v for k, v in SPEC_BF16_TFLOPS.items() if k in device_name), None)


def _mlp_params(arch, experts: int) -> int:
    """The MLP weights of all layers through which a token passes `experts` experts in each MoE layer: the dense
    layers' SwiGLU (gate, up, down), and per MoE layer the router [num_experts, hidden] and `experts` SwiGLU experts of
    moe_intermediate_size."""
    h = arch.hidden_size
    moe = len(arch.moe_layers) if arch.is_moe else 0
    dense = (arch.num_layers - moe) * 3 * h * arch.intermediate_size
    return dense + moe * (arch.num_experts * h + experts * 3 * h * arch.moe_intermediate_size)


def model_flops_per_token(arch, seq: int) -> float:
    """Training FLOPs per token at sequence length seq: 6 N_mm + 6 layers seq q_dim (forward + backward). N_mm: the
    matmul parameters a token passes through (a mixture of experts: its top-k experts and the router, not every
    expert)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    attention = h * (q + 2 * kv) + q * h
    matmul_params = arch.num_layers * attention + _mlp_params(arch, arch.num_experts_per_tok) + arch.vocab_size * h
    return 6.0 * matmul_params + 6.0 * arch.num_layers * seq * q  # the output layer is among the matmuls


def param_count(arch, experts: int | None = None) -> int:
    """Parameters of the model: matmuls, QKV biases, norms (Qwen3's q/k norms too), the routers, every expert (or
    `experts` of each MoE layer) and embeddings (the output layer unless tied)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    norms = 2 * h + 2 * d * arch.qk_layernorm
    layer = h * (q + 2 * kv) + (q + 2 * kv) * arch.qkv_bias + q * h + norms
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    mlp = _mlp_params(arch, arch.num_experts if experts is None else experts)
    return arch.num_layers * layer + mlp + embeddings + h


def active_param_count(arch) -> int:
    """Parameters a token passes through: param_count with each MoE layer's top-k experts only (the published
    "activated" count; the routers, embeddings and output layer included). A dense model's are all of them."""
    return param_count(arch, experts=arch.num_experts_per_tok)


def measure_peak_tflops(dtype: torch.dtype, device: torch.device) -> float:
    """Dense matmul TFLOP/s of this device in dtype: [n, n] @ [n, n] (n 4096 on CUDA, 1024 on CPU), timed."""
    import torch

    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    reps = 20 if device.type == "cuda" else 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def cuda_time_ms(fn: Callable[[], None], warmup: int, iters: int) -> float:
    """Median over `iters` runs of fn, each between its own CUDA events, after `warmup` runs."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of dst.copy_(src)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def shape_config(shape: str) -> dict:
    """The config.json fields of a named shape in SHAPES: a tuple is a Qwen2's, a dict is the fields themselves."""
    spec = SHAPES[shape]
    if isinstance(spec, dict):
        return dict(spec)
    h, ffn, layers, heads, kv, vocab = spec
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
    }


def shape_arch(shape: str, seq: int = 4096):
    """The ModelArch of a named shape in SHAPES, with positions for seq tokens (at least 4096)."""
    from megatron_dapo.model.arch import ModelArch

    return ModelArch.from_hf_config(
        {**shape_config(shape), "max_position_embeddings": max(seq, 4096)}, source=f"--shape {shape}"
    )


def random_samples(vocab: int, count: int, prompt: int, seq: int, seed: int) -> list:
    """count TrainSamples of `prompt` prompt and seq - prompt response tokens: random ids and advantages."""
    import torch

    from megatron_dapo.model.policy import TrainSample

    g = torch.Generator().manual_seed(seed)
    return [
        TrainSample(
            prompt_ids=torch.randint(0, vocab, (prompt,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab, (seq - prompt,), generator=g).tolist(),
            advantage=float(torch.randn((), generator=g)),
        )
        for _ in range(count)
    ]


def time_train_step(policy, samples: list, steps: int) -> tuple[float, float]:
    """Median seconds of the old-logprob forward and of the train step, over `steps` after one warm-up."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def step() -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        logps = policy.compute_logprobs(samples, 1.0)
        if logps is not None:  # None off the last pipeline stage
            for s, lp in zip(samples, logps):
                s.old_logp = lp["logp"]
        sync()
        t1 = time.perf_counter()
        policy.train_step(samples, 1.0)
        sync()
        return t1 - t0, time.perf_counter() - t1

    step()  # warm-up
    times = [step() for _ in range(steps)]
    return sorted(t[0] for t in times)[len(times) // 2], sorted(t[1] for t in times)[len(times) // 2]


def train_rates(
    arch, seq: int, tokens: int, devices: int, logprob_s: float, train_s: float, peak: float, spec: float | None = None
) -> dict:
    """Tokens/s, TFLOP/s per device and MFU of a train step over `tokens` tokens (all ranks) on `devices`
    devices; the old-logprob forward does a third of the train step's FLOPs. peak: the measured TFLOP/s per device
    (mfu, logprob_mfu); spec: the card's data-sheet rate (mfu_spec, and step_mfu_spec over the old-logprob forward
    and the train step together, what a rollout step's training phase achieves)."""
    flops = model_flops_per_token(arch, seq) * tokens
    out = {
        "train_step_s": round(train_s, 4),
        "train_tokens_per_s": round(tokens / train_s, 1),
        "logprob_tokens_per_s": round(tokens / logprob_s, 1),
        "tflops_per_device": round(flops / train_s / devices / 1e12, 3),
        "mfu": round(flops / train_s / devices / 1e12 / peak, 4),
        "logprob_mfu": round(flops / 3 / logprob_s / devices / 1e12 / peak, 4),
    }
    if spec:
        out["mfu_spec"] = round(flops / train_s / devices / 1e12 / spec, 4)
        out["step_mfu_spec"] = round(flops * 4 / 3 / (train_s + logprob_s) / devices / 1e12 / spec, 4)
    return out
