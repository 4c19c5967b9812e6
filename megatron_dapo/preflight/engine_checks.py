"""The preflight's vLLM checks: Megatron -> vLLM weight sync and logprob parity (bridge, and bridge_fp8 with FP8
rollout weights), and sleep/wake.

Run like the others (megatron_dapo/preflight/run.py), each in its own process; vLLM is imported inside them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from megatron_dapo.preflight.checks import GIB, Result, copy_gbs, init_world, step_config


def _shape_model_dir(arch, out: Path) -> Path:
    """An HF model directory for vLLM's dummy weights: the shape's config.json and a small byte-level tokenizer.

    Prompts stay inside the tokenizer's ids; sampled ids beyond it decode to nothing, which is all a check needs.
    """
    from transformers import Qwen2Config

    from megatron_dapo.model.tiny import CORPUS
    from megatron_dapo.model.tokenizer import train_byte_bpe_tokenizer

    tok = train_byte_bpe_tokenizer(CORPUS, out, vocab_size=320)
    Qwen2Config(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    ).save_pretrained(out)
    return out


def check_bridge(ctx: dict) -> Result:
    """The bridge and parity check, its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_bridge_") as tmp:
        return _bridge(ctx, Path(tmp))


def check_bridge_fp8(ctx: dict) -> Result:
    """The same with rollout.quantization=fp8: the engine starts block-FP8, every sync quantizes; its tokens/s
    against the bridge check's (same shape, prompts and lengths) is what FP8 rollouts buy."""
    # vLLM warms 1482 DeepGEMM shapes at start by default: over 4 minutes on the H100 for the 1.5B shape
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    with tempfile.TemporaryDirectory(prefix="preflight_bridge_fp8_") as tmp:
        return _bridge(ctx, Path(tmp), quantization="fp8")


def _bridge(ctx: dict, tmp: Path, quantization: str = "none") -> Result:
    import torch

    from megatron_dapo.convert.safetensors_io import LazyMegatronWeights, SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.perf import shape_arch
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    cuda = torch.cuda.is_available()
    count, plen, new = (8, 16, 8) if ctx["fast"] else (32, 16, 16)
    if cuda:  # a real shape with random weights: the sync's bandwidth matters, the weights' values do not
        shape = "qwen2.5-0.5b" if ctx["fast"] else "qwen2.5-1.5b"
        arch = shape_arch(shape, 4096)
        model_dir, weights = _shape_model_dir(arch, tmp), None
        # bf16 in both, different attention kernels; measured on the H100 (random 1.5B weights): 0.021-0.030 mean,
        # 0.095-0.127 max against 1.07 mean with stale weights
        tol_mean, tol_max = 0.05, 0.5
        if quantization == "fp8":  # FP8 weights and activations against bf16 (references, not yet measured)
            tol_mean, tol_max = 0.1, 3.0
    else:
        shape, model_dir = "tiny qwen2", build_tiny_qwen2(tmp)
        arch = ModelArch.from_hf_dir(model_dir)
        weights = LazyMegatronWeights(SafetensorsReader(model_dir), arch)
        tol_mean, tol_max = 1e-4, 1e-3  # fp32 in both
        if quantization == "fp8":  # FP8-rounded weights in the engine (measured on the tiny model: ~1e-2 mean)
            tol_mean, tol_max = 0.1, 1.0
    cfg = step_config(plen + new, f"rollout.quantization={quantization}")
    layout = init_world(arch, cfg)
    policy = MegatronPolicy(cfg, arch, layout, weights)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (plen,), generator=g).tolist() for _ in range(count)]
    engine = VLLMEngine(
        str(model_dir),
        dtype="bfloat16" if cuda else "float32",
        max_model_len=plen + new + 8,
        gpu_memory_utilization=0.3,  # next to the Megatron policy and its optimizer
        seed=0,
        load_format="dummy",
        quantization=quantization,
    )
    bridge = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes)

    def parity() -> tuple[float, float, int]:
        """|engine logprob - Megatron logprob| over every sampled token: mean, max, tokens."""
        groups = engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=new, seed=1)
        samples = [TrainSample(prompt_ids=p, response_ids=grp[0].token_ids) for p, grp in zip(prompts, groups)]
        ours = policy.compute_logprobs(samples, 1.0)
        theirs = torch.cat([torch.tensor(grp[0].logprobs) for grp in groups])
        diff = (theirs - torch.cat([o["logp"] for o in ours])).abs()
        return float(diff.mean()), float(diff.max()), int(diff.numel())

    try:
        bridge.sync(engine)
        before = parity()
        with torch.no_grad():  # a new policy: every weight moved by half its own spread
            gen = torch.Generator(device=layout.device).manual_seed(1)
            for chunk in policy.model:
                for p in chunk.parameters():
                    noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                    p.add_((noise * 0.5 * p.float().std().clamp_min(1e-3)).to(p.dtype))
        stale = parity()
        sync = bridge.sync(engine)
        after = parity()
        rate = _tokens_per_s(engine, prompts, 64 if cuda else 16)
    finally:
        engine.close()  # last: an in-process engine's shutdown takes torch.distributed's world with it
    n: dict[str, Any] = {"shape": shape, "weights": engine.weight_format, "prompts": count, "tokens": after[2]}
    n.update(gen_tokens_per_s=round(rate, 1), quantize_s=round(sync["weight_sync/quantize_seconds"], 4))
    n.update(before_mean=before[0], before_max=before[1], stale_mean=stale[0], after_mean=after[0], after_max=after[1])
    n.update(sync_s=round(sync["weight_sync/seconds"], 4), sync_gb=round(sync["weight_sync/gb"], 4))
    n.update(sync_gb_per_s=round(sync["weight_sync/gb_per_s"], 3), buckets=int(sync["weight_sync/buckets"]))
    if cuda:
        n["sync_frac_copy"] = round(sync["weight_sync/gb_per_s"] / copy_gbs(ctx), 4)
    problems = [
        f"{what} logprobs differ by {m:.3g} mean / {x:.3g} max (tolerance {tol_mean:g} / {tol_max:g})"
        for what, (m, x, _) in (("after the first sync", before), ("after the second sync", after))
        if m > tol_mean or x > tol_max
    ]
    # the stale engine must be far further off than a synced one (FP8's own mismatch is the floor there)
    if stale[0] <= (10 * tol_mean if quantization == "none" else 3 * after[0]):
        problems.append(
            f"the perturbed policy differs from the stale engine by only {stale[0]:.3g}: check not sensitive"
        )
    return Result(not problems, n, "; ".join(problems))


def _tokens_per_s(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second for the prompts x 4 samples, after a warm-up call at the same batch."""
    import time

    engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=4, seed=2)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=3)
    return sum(len(r.token_ids) for g in groups for r in g) / (time.perf_counter() - t0)


def check_sleep_wake(ctx: dict) -> Result:
    """The sleep/wake check, its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_sleep_") as tmp:
        return _sleep_wake(Path(tmp))


def _sleep_wake(tmp: Path) -> Result:
    import torch
    from safetensors.torch import load_file

    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    # head_dim 64: FlashAttention's smallest common size (the default tiny model's 32 is a CPU-attention size)
    model_dir = build_tiny_qwen2(tmp, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    engine = VLLMEngine(str(model_dir), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.5, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (16,), generator=g).tolist() for _ in range(16)]

    def greedy() -> list[list[int]]:
        return [grp[0].token_ids for grp in engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=24)]

    def free_gib() -> float:
        return torch.cuda.mem_get_info()[0] / GIB

    try:
        first = greedy()
        awake = free_gib()
        engine.sleep()
        asleep = free_gib()
        engine.wake()
        woken = free_gib()
        after_wake = greedy()
        engine.sleep()  # the trainer's cycle: asleep while Megatron trains, weights updated, then woken
        engine.update_weights(load_file(str(model_dir / "model.safetensors")).items())
        engine.wake()
        after_update = greedy()
    finally:
        engine.close()
    n = {"freed_gib": round(asleep - awake, 2), "restored_gib": round(asleep - woken, 2)}
    n.update(same_after_wake=after_wake == first, same_after_update=after_update == first)
    problems = []
    if n["freed_gib"] < 1.0:
        problems.append(f"sleep() freed only {n['freed_gib']} GiB")
    if abs(woken - awake) > 1.0:
        problems.append(f"wake() left free memory at {woken:.1f} GiB, {awake:.1f} before sleep")
    if after_wake != first or after_update != first:
        problems.append("greedy generation changed across sleep/wake or the update")
    return Result(not problems, n, "; ".join(problems))
