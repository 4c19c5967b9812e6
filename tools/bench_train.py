"""Training throughput of the Megatron policy: tokens/s and model FLOPs utilisation (MFU).

Runs the real DAPO train step (old-logprob forward, then forward + backward + AdamW) on a
random-weight model of a given shape and parallel layout, and prints a table on rank 0.

    python tools/bench_train.py --shape tiny                                  # CPU, 1 process
    torchrun --nproc-per-node 2 tools/bench_train.py --shape tiny parallel.tp=2
    torchrun --nproc-per-node 8 tools/bench_train.py --shape qwen2.5-1.5b --seq 4096 --batch 16 parallel.tp=1

MFU = achieved model FLOP/s per device / peak FLOP/s per device. Model FLOPs per trained
token = 6 x (matmul parameters) + 6 x layers x seq x q_heads x head_dim (causal attention:
half of the 12 L s d of full attention), the usual accounting (Megatron-LM, PaLM). The peak
is --peak-tflops if given, else measured here with a large matmul in the run's dtype, so
on CPU the figure is relative to this machine's own matmul speed. The old-logprob forward
does a third of the train step's FLOPs (2 per parameter per token); its MFU is reported too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

SHAPES = {
    # name: (hidden, ffn, layers, heads, kv_heads, vocab)
    "tiny": (256, 704, 4, 4, 2, 4096),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064),
}


def model_flops_per_token(arch, seq: int) -> float:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size
    matmul_params = arch.num_layers * per_layer + arch.vocab_size * h  # + the output layer
    return 6.0 * matmul_params + 6.0 * arch.num_layers * seq * q


def param_count(arch) -> int:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    layer = h * (q + 2 * kv) + (q + 2 * kv) * arch.qkv_bias + q * h + 3 * h * arch.intermediate_size + 2 * h
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * layer + embeddings + h


def measure_peak_tflops(dtype: torch.dtype, device: torch.device) -> float:
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


def shape_arch(shape: str, seq: int):
    """The ModelArch of a named shape in SHAPES (a Qwen2), with positions for seq tokens."""
    from megatron_dapo.model.arch import ModelArch

    h, ffn, layers, heads, kv, vocab = SHAPES[shape]
    return ModelArch.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": h,
            "intermediate_size": ffn,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": max(seq, 4096),
        },
        source=f"--shape {shape}",
    )


def random_samples(vocab: int, count: int, prompt: int, seq: int, seed: int) -> list:
    """count TrainSamples of `prompt` prompt and seq - prompt response tokens: random ids and advantages."""
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


def train_rates(arch, seq: int, tokens: int, devices: int, logprob_s: float, train_s: float, peak: float) -> dict:
    """Tokens/s, TFLOP/s per device and MFU of a train step over `tokens` tokens (all ranks) on `devices`
    devices; the old-logprob forward does a third of the train step's FLOPs. peak: TFLOP/s per device."""
    flops = model_flops_per_token(arch, seq) * tokens
    return {
        "train_step_s": round(train_s, 4),
        "train_tokens_per_s": round(tokens / train_s, 1),
        "logprob_tokens_per_s": round(tokens / logprob_s, 1),
        "tflops_per_device": round(flops / train_s / devices / 1e12, 3),
        "mfu": round(flops / train_s / devices / 1e12 / peak, 4),
        "logprob_mfu": round(flops / 3 / logprob_s / devices / 1e12 / peak, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sample (prompt + response)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per optimizer step, all data-parallel ranks")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense FLOP/s per device, in TFLOP/s")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides: parallel.tp=2 model.dtype=bf16 ...")
    args = ap.parse_args()

    from megatron.core import parallel_state

    from megatron_dapo.config import load_config
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy

    arch = shape_arch(args.shape, args.seq)
    defaults = [f"train.max_tokens_per_microbatch={args.seq}", "optim.warmup_steps=0"]
    if not torch.cuda.is_available():
        defaults.append("model.dtype=fp32")  # CPU bf16 matmuls are emulated and unrepresentative
    cfg = load_config(overrides=[*defaults, *args.overrides])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    policy = MegatronPolicy(cfg, arch, layout, None)

    dp_rank = parallel_state.get_data_parallel_rank()
    samples = random_samples(arch.vocab_size, args.batch // layout.dp, args.prompt, args.seq, seed=dp_rank)
    logprob_s, train_s = time_train_step(policy, samples, args.steps)
    peak = args.peak_tflops or measure_peak_tflops(policy.model[0].config.params_dtype, layout.device)
    result = {
        "shape": args.shape,
        "params_b": round(param_count(arch) / 1e9, 3),
        "layout": f"tp{layout.tp} pp{layout.pp} dp{layout.dp}" + (f" vpp{layout.vpp}" if layout.vpp else ""),
        "dtype": cfg.model.dtype,
        "seq": args.seq,
        "batch": args.batch,
        **train_rates(arch, args.seq, args.batch * args.seq, layout.world_size, logprob_s, train_s, peak),
        "peak_tflops_per_device": round(peak, 2),
        "peak_source": "given" if args.peak_tflops else "measured matmul",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if layout.rank == 0:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:<{width}}  {v}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    main()
