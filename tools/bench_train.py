"""Training throughput of the Megatron policy: tokens/s and model FLOPs utilisation (MFU).

Runs the real DAPO train step (old-logprob forward, then forward + backward + AdamW) on a
random-weight model of a given shape and parallel layout, and prints a table on rank 0.

    python tools/bench_train.py --shape tiny                                  # CPU, 1 process
    torchrun --nproc-per-node 2 tools/bench_train.py --shape tiny parallel.tp=2
    torchrun --nproc-per-node 8 tools/bench_train.py --shape qwen2.5-1.5b --seq 4096 --batch 16 parallel.tp=1

MFU = achieved model FLOP/s per device / peak FLOP/s per device. Model FLOPs per trained
token = 6 x (matmul parameters) + 6 x layers x seq x q_heads x head_dim (causal attention:
half of the 12 L s d of full attention), the usual accounting (Megatron-LM, PaLM); for a
mixture of experts (--shape qwen3-30b-a3b ...) the matmul parameters a token passes through,
its top-k experts and the router (model/perf.py active_param_count). The peak
is --peak-tflops if given, else measured here with a large matmul in the run's dtype, so
on CPU the figure is relative to this machine's own matmul speed. The old-logprob forward
does a third of the train step's FLOPs (2 per parameter per token); its MFU is reported too.
"""

from __future__ import annotations

import json

import torch

from megatron_dapo.cli import argument_parser
from megatron_dapo.model.perf import (
    SHAPES,
    active_param_count,
    measure_peak_tflops,
    param_count,
    random_samples,
    shape_arch,
    time_train_step,
    train_rates,
)


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sample (prompt + response)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per optimizer step, all data-parallel ranks")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense FLOP/s per device, in TFLOP/s")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides: parallel.tp=2 model.dtype=bf16 ...")
    args = ap.parse_args()

    from megatron_dapo.config import load_config
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.trainer import policy_options

    arch = shape_arch(args.shape, args.seq)
    defaults = [f"train.max_tokens_per_microbatch={args.seq}", "optim.warmup_steps=0"]
    if not torch.cuda.is_available():
        defaults.append("model.dtype=fp32")  # CPU bf16 matmuls are emulated and unrepresentative
    cfg = load_config(overrides=[*defaults, *args.overrides])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    policy = MegatronPolicy(arch, layout, None, **policy_options(cfg))

    samples = random_samples(arch.vocab_size, args.batch // layout.dp, args.prompt, args.seq, seed=layout.dp_rank)
    logprob_s, train_s = time_train_step(policy, samples, args.steps)
    peak = args.peak_tflops or measure_peak_tflops(policy.model[0].config.params_dtype, layout.device)
    result = {
        "shape": args.shape,
        "params_b": round(param_count(arch) / 1e9, 3),
        "active_params_b": round(active_param_count(arch) / 1e9, 3),
        "layout": f"tp{layout.tp} pp{layout.pp} dp{layout.dp}"
        + (f" vpp{layout.vpp}" if layout.vpp else "")
        + (f" ep{layout.ep} etp{layout.etp}" if arch.is_moe else ""),
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
    policy.comm.barrier()
    destroy_parallel()


if __name__ == "__main__":
    main()
