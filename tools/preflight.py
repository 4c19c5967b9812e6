"""GPU preflight: every check this machine can run, in one command; the others are skipped with the reason.

    python tools/preflight.py                               # all checks this machine allows (CPU here: < 3 min)
    python tools/preflight.py --fast --json runs/pf.json    # tiny sizes (what the test runs)
    python tools/preflight.py --only env,kernel_equality,bridge
    PYTHONPATH=$PWD/.gpu_site python3 tools/preflight.py --deadline-s 560 --json $OUT/preflight.json   # GPU machine

Checks, in order (CUDA: needs a GPU; vLLM / TE: needs the package):
  env              versions of torch, CUDA, triton, megatron-core, vLLM (in SUPPORTED_VLLM?), TE, transformers; GPU
  limits           CUDA: device-to-device copy GB/s and bf16 matmul TFLOP/s, the denominators of the rows below
  kernel_equality  the fused Triton loss against the PyTorch reference (fp32 and bf16, loss, statistics, both
                   gradient paths): compiled on a GPU (never the interpreter there), in Triton's interpreter on CPU
  kernel_timing    CUDA: fused loss vs eager PyTorch vs torch.compile at 1M-64M tokens, bytes moved as a fraction
                   of the copy bandwidth
  train_tiny       the DAPO train step (old-logprob forward, forward + backward + AdamW) of a tiny shape: tokens/s
                   and MFU, activation recompute off and on (CPU: fp32, MFU against this CPU's own matmul rate)
  train_0.5b/1.5b  CUDA: the same, bf16, Qwen2.5-0.5B and 1.5B shapes at sequence 4096, with peak GPU memory
  determinism      the same two train steps twice from the same weights and batch: loss, gradient norm and old
                   logprobs bit-identical
  bridge           vLLM: Megatron -> vLLM weight sync into an engine started from dummy weights (GPU: the 1.5B
                   shape; GB/s against the copy bandwidth), then the engine's sampling logprobs for fixed prompts
                   against the Megatron policy's for the same tokens, after a sync, with stale weights (perturbed
                   policy, no sync: must differ) and after the next sync
  sleep_wake       CUDA + vLLM: GPU memory freed by sleep() and given back by wake(); greedy generation unchanged
                   after wake and after a weight update made while asleep (the trainer's cycle)
  te               CUDA + TE: the train step with Transformer Engine layers (packed THD sequences), and FP8 when
                   the GPU has it (compute capability 8.9+)

Each check runs in its own process (tools/preflight.py --child NAME), so a crash, a CUDA error or a hang is that
check's failure and the others still run; the parent prints one table row per check as it finishes and rewrites
the --json file after each, so a run stopped early keeps what it measured. Results: pass, fail (with the error and
the end of the check's log in the JSON) or skip (with the reason). A timing row passes when it ran and its numbers
are finite: its reference column says what to compare them with (no GPU number in it has been measured here).
Exit status 1 if any check failed; skips are fine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

GIB = 1 << 30
MIN_CHECK_S = 30
"""Under --deadline-s, a check with less time than this left is not started (skipped, with the reason)."""


@dataclass
class Row:
    """One check's result: what the table prints and the JSON keeps."""

    name: str
    status: str  # "pass" | "fail" | "skip"
    numbers: dict[str, Any] = field(default_factory=dict)
    reference: str = ""
    reason: str = ""  # why it failed or was skipped
    seconds: float = 0.0
    details: Any = None  # long results (per-size timings, the equality lines): JSON only
    log_tail: str = ""  # the end of a failed check's output


@dataclass
class Result:
    """What a check function returns: did it pass, its numbers, and anything worth keeping in the JSON."""

    ok: bool
    numbers: dict[str, Any]
    reason: str = ""
    details: Any = None


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[dict], Result]
    needs: tuple[str, ...]  # "cuda", "vllm", "te"
    reference: str
    timeout_s: int


# ----------------------------------------------------------------------------- helpers shared by the checks


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_WORLD: list = []  # this process's parallel layout, once it is set up


def _init_world(arch, cfg):
    """This process as rank 0 of a one-process world (gloo on CPU, nccl on GPU) and its Megatron groups, once."""
    from megatron_dapo.model.parallel import init_parallel

    if not _WORLD:
        _WORLD.append(init_parallel(arch, cfg.parallel, cfg.model, seed=0))
    return _WORLD[0]


def _config(seq: int, *overrides: str):
    """The trainer's config for a benchmark step: micro-batches of one sequence, no warm-up, this machine's dtype."""
    from megatron_dapo.config import load_config

    dtype = "bf16" if _cuda() else "fp32"  # CPU bf16 matmuls are emulated: neither fast nor representative
    return load_config(
        overrides=[f"train.max_tokens_per_microbatch={seq}", "optim.warmup_steps=0", f"model.dtype={dtype}", *overrides]
    )


def _free_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _finite(numbers: dict) -> bool:
    return all(math.isfinite(v) for v in numbers.values() if isinstance(v, float))


def _peak_tflops(ctx: dict, dtype) -> float:
    """The matmul rate MFU is measured against: the limits row's on a GPU, else measured now (bench_train's)."""
    import torch
    from bench_train import measure_peak_tflops

    if ctx.get("peak_tflops") and torch.cuda.is_available():
        return ctx["peak_tflops"]
    return measure_peak_tflops(dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _copy_gbs(ctx: dict) -> float:
    from bench_kernel import copy_bandwidth_gbs

    return ctx.get("copy_gbs") or copy_bandwidth_gbs()


def _time_step(peak: float, shape: str, seq: int, batch: int, steps: int, *overrides: str) -> dict:
    """tokens/s and MFU (against `peak` TFLOP/s) of the DAPO train step of a random-weight `shape`, with
    tools/bench_train.py's FLOP accounting; peak GPU memory on CUDA."""
    import torch
    from bench_train import random_samples, shape_arch, time_train_step, train_rates

    from megatron_dapo.model.policy import MegatronPolicy

    arch = shape_arch(shape, seq)
    cfg = _config(seq, *overrides)
    layout = _init_world(arch, cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    policy = MegatronPolicy(cfg, arch, layout, None)
    samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=0)
    logprob_s, train_s = time_train_step(policy, samples, steps)
    out = train_rates(arch, seq, batch * seq, 1, logprob_s, train_s, peak)
    if torch.cuda.is_available():
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    del policy
    _free_memory()
    return out


# ----------------------------------------------------------------------------- the checks


def check_env(ctx: dict) -> Result:
    """Versions of everything the GPU paths use; fails only on a vLLM outside the supported range."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from megatron_dapo.rollout.vllm_engine import SUPPORTED_VLLM, vllm_supported, vllm_version

    def dist(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    n: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "triton": dist("triton"),
        "megatron_core": dist("megatron-core"),
        "vllm": vllm_version() or "-",
        "transformer_engine": dist("transformer-engine"),  # metadata only: TE is never imported without CUDA
        "transformers": dist("transformers"),
        "cpus": os.cpu_count(),
        "mode": "fast" if ctx["fast"] else "full",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        n.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            capability=f"{props.major}.{props.minor}",
            gpus=torch.cuda.device_count(),
        )
    if n["vllm"] != "-" and not vllm_supported(n["vllm"]):
        return Result(False, n, f"vLLM {n['vllm']} is outside megatron_dapo's supported range {SUPPORTED_VLLM}")
    return Result(True, n)


def check_limits(ctx: dict) -> Result:
    import torch
    from bench_kernel import copy_bandwidth_gbs
    from bench_train import measure_peak_tflops

    n = {
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "bf16_tflops": round(measure_peak_tflops(torch.bfloat16, torch.device("cuda")), 1),
    }
    return Result(_finite(n) and n["copy_gbs"] > 0 and n["bf16_tflops"] > 0, n)


def check_kernel_equality(ctx: dict) -> Result:
    import torch
    import triton
    from bench_kernel import equality_check

    from megatron_dapo.kernels.ratio_clip_reduce import interpreter_enabled

    cuda = torch.cuda.is_available()
    if cuda and interpreter_enabled():
        return Result(False, {}, "TRITON_INTERPRET is set on a GPU machine: the kernel would not be compiled")
    b, t = (4, 1001) if ctx["fast"] and not cuda else (8, 4099)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = equality_check("cuda" if cuda else "cpu", b=b, t=t)
    lines = [line.strip() for line in out.getvalue().splitlines() if line.strip()]
    n = {"mode": "compiled" if cuda else "interpreter", "triton": triton.__version__, "tokens": b * t}
    n["paths_ok"] = f"{sum(line.endswith('ok') for line in lines)}/{len(lines)}"
    return Result(ok, n, "" if ok else "kernel and reference differ: " + "; ".join(lines), details=lines)


def check_kernel_timing(ctx: dict) -> Result:
    import torch
    from bench_kernel import bench_size, parse_tokens

    sizes = ["1M", "4M"] if ctx["fast"] else ["1M", "4M", "16M", "64M"]
    args = SimpleNamespace(
        seq_len=4096,
        per_token_adv=False,
        is_weight=False,
        valid=0.8,
        dual_clip=None,
        warmup=5,
        iters=20,
        no_compile=False,
    )
    copy = _copy_gbs(ctx)
    if hasattr(torch._dynamo.config, "cache_size_limit"):  # torch.compile recompiles per size and phase
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows = []
    n: dict[str, Any] = {"copy_gbs": round(copy, 1)}
    for size in sizes:
        mine = bench_size(parse_tokens(size), args, copy, torch.bfloat16)
        torch.cuda.empty_cache()
        rows += mine
        by = {r["impl"]: r for r in mine if r["phase"] == "fwd+bwd"}
        fused = by.get("fused[skip-pad]/fused-grad", {})  # what the trainer runs
        if "ms" in fused:
            n[f"{size}_fused_ms"] = round(fused["ms"], 3)
            n[f"{size}_frac_copy"] = round(fused["frac_copy_bw"], 3)
            n[f"{size}_x_eager"] = round(fused.get("speedup_vs_eager", float("nan")), 2)
            if "ms" in by.get("compiled", {}):
                n[f"{size}_x_compiled"] = round(by["compiled"]["ms"] / fused["ms"], 2)
    errors = [f"{r['impl']} {r['phase']} @{r['tokens']}: {r['error']}" for r in rows if "error" in r]
    ours = [e for e in errors if not e.startswith("compiled")]  # torch.compile failing is torch's, reported only
    ok = not ours and _finite(n) and all(f"{s}_fused_ms" in n for s in sizes)
    return Result(ok, n, "; ".join(errors)[:500], details=rows)


def _train_check(shape: str) -> Callable[[dict], Result]:
    def run(ctx: dict) -> Result:
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            seq, batch, steps = (4096, 2, 1) if ctx["fast"] else (4096, 8, 3)
            seq = min(seq, 1024) if shape == "tiny" else seq
        else:
            seq, batch, steps = (128, 4, 1) if ctx["fast"] else (256, 4, 2)
        peak = _peak_tflops(ctx, torch.bfloat16 if cuda else torch.float32)
        n: dict[str, Any] = {"seq": seq, "batch": batch, "peak_tflops": round(peak, 2)}
        for prefix, overrides in (("", ()), ("recompute_", ("model.recompute=full",))):
            rates = _time_step(peak, shape, seq, batch, steps, *overrides)
            keys = ("train_tokens_per_s", "mfu", "logprob_mfu", "train_step_s", "peak_gib")
            n.update({prefix + k: rates[k] for k in keys if k in rates})
        return Result(_finite(n) and n["mfu"] > 0 and n["recompute_mfu"] > 0, n)

    return run


def check_determinism(ctx: dict) -> Result:
    """Two fresh policies from the same weights take the same two steps on the same batch: bit-identical?"""
    import torch
    from bench_train import random_samples, shape_arch

    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.provider import tp_gathered_tensors

    cuda = torch.cuda.is_available()
    if cuda:
        shape, seq, batch = ("tiny", 1024, 4) if ctx["fast"] else ("qwen2.5-0.5b", 4096, 4)
    else:
        shape, seq, batch = ("tiny", 128, 2) if ctx["fast"] else ("tiny", 256, 4)
    arch = shape_arch(shape, seq)
    cfg = _config(seq)
    layout = _init_world(arch, cfg)

    def two_steps(weights):
        policy = MegatronPolicy(cfg, arch, layout, weights)
        start = (
            weights
            if weights is not None
            else {k: v.cpu() for k, v in tp_gathered_tensors(policy.model, arch, layout).items()}
        )
        samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=0)
        trace = []
        for _ in range(2):
            logps = policy.compute_logprobs(samples, 1.0)
            for s, lp in zip(samples, logps):
                s.old_logp = lp["logp"]
            m = policy.train_step(samples, 1.0)
            trace.append((m["actor/loss"], m["actor/grad_norm"], torch.cat([lp["logp"] for lp in logps])))
        del policy
        _free_memory()
        return start, trace

    weights, first = two_steps(None)
    _, second = two_steps(weights)
    same = [a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(first, second)]
    n = {"shape": shape, "seq": seq, "batch": batch, "loss_1": first[0][0], "grad_norm_1": first[0][1]}
    n.update(loss_2=first[1][0], grad_norm_2=first[1][1], identical_steps=f"{sum(same)}/2")
    why = ""
    if not all(same):
        k = same.index(False)
        why = f"step {k + 1} differs: loss {first[k][0]!r} vs {second[k][0]!r}, grad norm {first[k][1]!r} vs {second[k][1]!r}"
    return Result(all(same), n, why)


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


def _bridge(ctx: dict, tmp: Path) -> Result:
    import torch
    from bench_train import shape_arch

    from megatron_dapo.convert.checkpoint_io import LazyMegatronWeights, SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
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
        tol_mean, tol_max = 0.02, 0.5  # bf16 in both; different attention kernels (references, not yet measured)
    else:
        shape, model_dir = "tiny qwen2", build_tiny_qwen2(tmp)
        arch = ModelArch.from_hf_dir(model_dir)
        weights = LazyMegatronWeights(SafetensorsReader(model_dir), arch)
        tol_mean, tol_max = 1e-4, 1e-3  # fp32 in both
    cfg = _config(plen + new)
    layout = _init_world(arch, cfg)
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
    finally:
        engine.close()  # last: an in-process engine's shutdown takes torch.distributed's world with it
    n: dict[str, Any] = {"shape": shape, "prompts": count, "tokens": after[2]}
    n.update(before_mean=before[0], before_max=before[1], stale_mean=stale[0], after_mean=after[0], after_max=after[1])
    n.update(sync_s=round(sync["weight_sync/seconds"], 4), sync_gb=round(sync["weight_sync/gb"], 4))
    n.update(sync_gb_per_s=round(sync["weight_sync/gb_per_s"], 3), buckets=int(sync["weight_sync/buckets"]))
    if cuda:
        n["sync_frac_copy"] = round(sync["weight_sync/gb_per_s"] / _copy_gbs(ctx), 4)
    problems = [
        f"{what} logprobs differ by {m:.3g} mean / {x:.3g} max (tolerance {tol_mean:g} / {tol_max:g})"
        for what, (m, x, _) in (("after the first sync", before), ("after the second sync", after))
        if m > tol_mean or x > tol_max
    ]
    if stale[0] <= 10 * tol_mean:
        problems.append(
            f"the perturbed policy differs from the stale engine by only {stale[0]:.3g}: check not sensitive"
        )
    return Result(not problems, n, "; ".join(problems))


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


def check_te(ctx: dict) -> Result:
    import torch

    shape, seq, batch = ("tiny", 512, 2) if ctx["fast"] else ("qwen2.5-0.5b", 4096, 4)
    n: dict[str, Any] = {"shape": shape, "seq": seq}
    te = ("model.transformer_impl=transformer_engine",)
    peak = _peak_tflops(ctx, torch.bfloat16)
    rates = _time_step(peak, shape, seq, batch, 2, *te)
    n.update(te_tokens_per_s=rates["train_tokens_per_s"], te_mfu=rates["mfu"], te_peak_gib=rates["peak_gib"])
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        rates = _time_step(peak, shape, seq, batch, 2, *te, "model.fp8=hybrid")
        n.update(fp8_tokens_per_s=rates["train_tokens_per_s"], fp8_mfu=rates["mfu"])
    else:
        n["fp8"] = f"not run: compute capability {major}.{minor} < 8.9"
    return Result(_finite(n) and n["te_mfu"] > 0, n)


CHECKS = [
    Check("env", check_env, (), "vLLM in megatron_dapo.rollout.vllm_engine.SUPPORTED_VLLM", 120),
    Check(
        "limits",
        check_limits,
        ("cuda",),
        "KINDS.md: H100 ~3000 GB/s copy, ~800 TFLOP/s (8192^3); H200 ~4300 GB/s, ~790 (this times 4096^3)",
        180,
    ),
    Check("kernel_equality", check_kernel_equality, (), "loss/stats 2e-6 relative; grad 1e-6 (fp32), 2^-7 (bf16)", 300),
    Check(
        "kernel_timing",
        check_kernel_timing,
        ("cuda",),
        "fused fwd+bwd: x eager and x compiled > 1; bytes moved / copy bandwidth -> 1 at large sizes",
        480,
    ),
    Check("train_tiny", _train_check("tiny"), (), "MFU vs this device's own matmul rate; recompute costs ~1/3", 300),
    Check("train_0.5b", _train_check("qwen2.5-0.5b"), ("cuda",), "bf16 MFU; compare with 1.5b and recompute", 420),
    Check("train_1.5b", _train_check("qwen2.5-1.5b"), ("cuda",), "bf16 MFU, peak GiB at seq 4096", 480),
    Check("determinism", check_determinism, (), "bit-identical loss, grad norm and logprobs, two steps", 420),
    Check(
        "bridge",
        check_bridge,
        ("vllm",),
        "|vLLM - Megatron| logprob: fp32 1e-4 mean / 1e-3 max; bf16 0.02 / 0.5; stale > 10x tolerance",
        480,
    ),
    Check("sleep_wake", check_sleep_wake, ("cuda", "vllm"), "freed > 1 GiB, restored within 1 GiB, same tokens", 420),
    Check("te", check_te, ("cuda", "te"), "TE MFU vs train_0.5b's local layers; FP8 on 8.9+", 480),
]
BY_NAME = {c.name: c for c in CHECKS}


# ----------------------------------------------------------------------------- the child: one check


def run_child(name: str, ctx: dict, out: Path) -> None:
    """Run one check in this process and write its Row as JSON to out; an exception is a failed row."""
    check = BY_NAME[name]
    t0 = time.perf_counter()
    try:
        res = check.run(ctx)
        row = Row(name, "pass" if res.ok else "fail", res.numbers, check.reference, res.reason, details=res.details)
    except Exception as e:
        traceback.print_exc()
        row = Row(name, "fail", reference=check.reference, reason=f"{type(e).__name__}: {e}"[:1000])
    row.seconds = round(time.perf_counter() - t0, 2)
    out.write_text(json.dumps(asdict(row), default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM and torch.distributed can leave threads that block a normal exit; the row is written
    os._exit(0)


# ----------------------------------------------------------------------------- the parent: orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(name: str, cuda: bool) -> dict[str, str]:
    """The check's environment: rank 0 of a one-process torchrun-style world (so a GPU engine uses the trainer's
    external_launcher path), and Triton's interpreter for the CPU kernel check only."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if name == "kernel_equality" and not cuda:
        env["TRITON_INTERPRET"] = "1"  # read when the kernel is first compiled: set before the child starts
    return env


def spawn(check: Check, ctx: dict, timeout: float, cuda: bool) -> Row:
    """Run a check in a fresh process group; a crash, a hang past timeout or a missing row is a failed row."""
    with tempfile.TemporaryDirectory(prefix="preflight_") as tmp:
        row_file, log_file = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--ctx", json.dumps(ctx)]
        t0 = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.Popen(
                [*cmd, "--row", str(row_file)],
                env=child_env(check.name, cuda),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: whatever it started goes with it below
            )
            try:
                proc.wait(timeout=timeout)
                why = None if row_file.is_file() else f"the check's process exited with status {proc.returncode}"
            except subprocess.TimeoutExpired:
                why = f"timed out after {timeout:.0f} s"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # leftovers would hold GPU memory the next check needs
                proc.wait()
        seconds = round(time.perf_counter() - t0, 1)
        log_tail = log_file.read_text(errors="replace")[-4000:]
        if why is not None:
            return Row(check.name, "fail", reference=check.reference, reason=why, seconds=seconds, log_tail=log_tail)
        row = Row(**json.loads(row_file.read_text()))
        if row.status == "fail":
            row.log_tail = log_tail
        return row


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_row(row: Row) -> None:
    """One check: name, result, seconds, then its numbers (or reason) and reference, wrapped under it."""
    import textwrap

    head = f"{row.name:<16} {row.status:<5} {row.seconds:7.1f}s  "
    body = ", ".join(f"{k} {_fmt(v)}" for k, v in row.numbers.items() if not isinstance(v, (list, dict)))
    if row.reason:
        body = (body + " | " if body else "") + row.reason
    lines = textwrap.wrap(body or "-", 100) or ["-"]
    print(head + lines[0])
    indent = " " * len(head)
    for line in lines[1:]:
        print(indent + line)
    if row.reference and row.status != "skip":
        for line in textwrap.wrap("ref: " + row.reference, 100):
            print(indent + line)
    sys.stdout.flush()


def parse_only(text: str | None) -> list[Check]:
    if not text:
        return list(CHECKS)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in BY_NAME]
    if unknown:
        raise SystemExit(f"--only: unknown checks {unknown}; known: {', '.join(BY_NAME)}")
    return [c for c in CHECKS if c.name in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="tiny sizes everywhere (the test's mode)")
    ap.add_argument("--only", default=None, help=f"comma-separated checks: {','.join(BY_NAME)}")
    ap.add_argument("--json", default=None, help="write every row here (rewritten after each check)")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="finish within this many seconds: a check still running is stopped",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args.child, json.loads(args.ctx), Path(args.row))

    import torch

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    have = {"cuda": cuda, "vllm": importlib.util.find_spec("vllm") is not None}
    # TE's mere presence breaks `import megatron.core` without CUDA: only looked for on a GPU machine
    have["te"] = cuda and importlib.util.find_spec("transformer_engine") is not None
    why_not = {
        "cuda": f"needs CUDA: torch {torch.__version__} sees no GPU here",
        "vllm": "needs vLLM: not installed",
        "te": "needs Transformer Engine: not installed (not staged for the GPU machine: README, GPU preflight)",
    }
    ctx: dict[str, Any] = {"fast": args.fast}
    rows: list[Row] = []
    report = {"argv": sys.argv[1:], "fast": args.fast, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{'check':<16} {'result':<5} {'time':>8}  numbers")
    for check in parse_only(args.only):
        missing = [need for need in check.needs if not have[need]]
        elapsed = time.perf_counter() - t0
        if missing:
            row = Row(check.name, "skip", reference=check.reference, reason=why_not[missing[0]])
        elif args.deadline_s is not None and args.deadline_s - elapsed < MIN_CHECK_S:
            reason = (
                f"not started: {max(0.0, args.deadline_s - elapsed):.0f} s left of --deadline-s {args.deadline_s:g}"
            )
            row = Row(check.name, "skip", reference=check.reference, reason=reason)
        else:
            left = check.timeout_s if args.deadline_s is None else min(check.timeout_s, args.deadline_s - elapsed)
            row = spawn(check, ctx, left, cuda)
        if check.name == "limits" and row.status == "pass":  # the denominators of the later rows
            ctx.update(copy_gbs=row.numbers["copy_gbs"], peak_tflops=row.numbers["bf16_tflops"])
        rows.append(row)
        print_row(row)
        if args.json:
            report["seconds"] = round(time.perf_counter() - t0, 1)
            report["summary"] = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**report, "rows": [asdict(r) for r in rows]}, indent=1, default=str))
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
    print(f"\n{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip in {time.perf_counter() - t0:.0f} s")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
