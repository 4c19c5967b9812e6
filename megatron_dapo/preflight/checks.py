"""The preflight's checks that need no vLLM: versions, device limits, the fused kernel, train steps, determinism, TE.

Each check takes the run's context (ctx: "fast", and the limits row's "copy_gbs" and "peak_tflops" once measured)
and returns a Result; megatron_dapo/preflight/run.py runs each in its own process. Torch and the rest are imported
inside the checks, so listing them (tools/preflight.py --help) loads nothing heavy.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import platform
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

GIB = 1 << 30


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


def init_world(arch, cfg):
    """This process as rank 0 of a one-process world (gloo on CPU, nccl on GPU) and its Megatron groups, once."""
    from megatron_dapo.model.parallel import init_parallel

    if not _WORLD:
        _WORLD.append(init_parallel(arch, cfg.parallel, cfg.model, seed=0))
    return _WORLD[0]


def step_config(seq: int, *overrides: str):
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
    """The matmul rate MFU is measured against: the limits row's on a GPU, else measured now (model.perf's)."""
    import torch

    from megatron_dapo.model.perf import measure_peak_tflops

    if ctx.get("peak_tflops") and torch.cuda.is_available():
        return ctx["peak_tflops"]
    return measure_peak_tflops(dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def copy_gbs(ctx: dict) -> float:
    from megatron_dapo.model.perf import copy_bandwidth_gbs

    return ctx.get("copy_gbs") or copy_bandwidth_gbs()


def _time_step(peak: float, shape: str, seq: int, batch: int, steps: int, *overrides: str) -> dict:
    """tokens/s and MFU (against `peak` TFLOP/s) of the DAPO train step of a random-weight `shape`, with
    megatron_dapo/model/perf.py's FLOP accounting; peak GPU memory on CUDA."""
    import torch

    from megatron_dapo.model.perf import random_samples, shape_arch, spec_tflops, time_train_step, train_rates
    from megatron_dapo.model.policy import MegatronPolicy

    arch = shape_arch(shape, seq)
    cfg = step_config(seq, *overrides)
    layout = init_world(arch, cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    policy = MegatronPolicy(cfg, arch, layout, None)
    try:
        samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=0)
        logprob_s, train_s = time_train_step(policy, samples, steps)
    finally:
        policy.close()  # the next variant builds its own policy in this process
        del policy
        _free_memory()
    cuda = torch.cuda.is_available()
    spec = spec_tflops(torch.cuda.get_device_name()) if cuda else None
    out = train_rates(arch, seq, batch * seq, 1, logprob_s, train_s, peak, spec)
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    return out


# ----------------------------------------------------------------------------- the checks


def check_env(ctx: dict) -> Result:
    """Versions of everything the GPU paths use; fails only on a vLLM outside the supported range."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from megatron_dapo.rollout.vllm_env import SUPPORTED_VLLM, vllm_supported, vllm_version

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

    from megatron_dapo.model.perf import copy_bandwidth_gbs, measure_peak_tflops

    n = {
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "bf16_tflops": round(measure_peak_tflops(torch.bfloat16, torch.device("cuda")), 1),
    }
    return Result(_finite(n) and n["copy_gbs"] > 0 and n["bf16_tflops"] > 0, n)


def check_kernel_equality(ctx: dict) -> Result:
    import torch
    import triton

    from megatron_dapo.kernels.bench import equality_check
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
    paths = [line for line in lines if line.startswith("equality")]
    n["paths_ok"] = f"{sum(line.endswith('ok') for line in paths)}/{len(paths)}"
    return Result(ok, n, "" if ok else "kernel and reference differ: " + "; ".join(lines), details=lines)


def check_kernel_timing(ctx: dict) -> Result:
    import torch

    from megatron_dapo.cli import parse_tokens
    from megatron_dapo.kernels.bench import bench_size

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
    copy = copy_gbs(ctx)
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


TRAIN_VARIANTS = (
    ("", ()),
    ("unfused_", ("model.attention=unfused",)),
    ("unfused_selective_", ("model.attention=unfused", "model.recompute=selective")),
    ("recompute_", ("model.recompute=full",)),
)
"""The train rows' variants (key prefix, overrides): the default SDPA attention, Megatron's unfused attention (it
holds [heads, seq, seq] scores per layer) without and with selective recompute (which drops them: the best-fitting
unfused run at 1.5B), and SDPA with whole layers recomputed."""


def variants_result(n: dict[str, Any], time_variant: Callable[[tuple[str, ...]], dict]) -> Result:
    """A train row from time_variant(overrides) -> rates, per TRAIN_VARIANTS. A variant that runs out of GPU
    memory is a capacity fact of this layout on this GPU, reported as `<prefix>oom` (what it asked for); the row
    passes if at least one variant ran and every number is finite and positive where it must be."""
    import torch

    ran, oom = [], []
    for prefix, overrides in TRAIN_VARIANTS:
        try:
            rates = time_variant(overrides)
        except torch.OutOfMemoryError as e:
            asked = re.search(r"Tried to allocate [\d.]+ \w+", str(e))
            n[prefix + "oom"] = asked.group(0) if asked else str(e)[:120]
            oom.append(prefix + "oom")
            rates = None
        if rates is None:
            _free_memory()  # out of the except block: its traceback no longer holds the failed step's tensors
            continue
        keys = ("train_tokens_per_s", "mfu", "mfu_spec", "step_mfu_spec", "logprob_mfu", "train_step_s", "peak_gib")
        n.update({prefix + k: rates[k] for k in keys if k in rates})
        ran.append(prefix + "mfu")
    ok = bool(ran) and _finite(n) and all(n[k] > 0 for k in ran)
    return Result(ok, n, f"out of memory: {', '.join(oom)}" if oom else "")


def train_check(shape: str) -> Callable[[dict], Result]:
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
        return variants_result(n, lambda overrides: _time_step(peak, shape, seq, batch, steps, *overrides))

    return run


def _two_steps(cfg, arch, layout, weights, batch: int, seq: int):
    """A fresh policy (from `weights`, or Megatron's random init when None) takes two train steps on a fixed random
    batch: (its starting weights, [(loss, grad norm, old logprobs)] per step)."""
    import torch

    from megatron_dapo.model.perf import random_samples
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.provider import tp_gathered_tensors

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
    policy.close()  # the second policy needs the memory of the first
    del policy
    _free_memory()
    return start, trace


def _identical(first: list, second: list) -> tuple[str, str]:
    """('k/2' steps bit-identical, why not) of two _two_steps traces."""
    import torch

    same = [a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(first, second)]
    why = ""
    if not all(same):
        k = same.index(False)
        why = f"step {k + 1} differs: loss {first[k][0]!r} vs {second[k][0]!r}, grad norm {first[k][1]!r} vs {second[k][1]!r}"
    return f"{sum(same)}/2", why


def check_determinism(ctx: dict) -> Result:
    """Two fresh policies from the same weights take the same two steps on the same batch: bit-identical?"""
    import torch

    from megatron_dapo.model.perf import shape_arch

    cuda = torch.cuda.is_available()
    if cuda:
        shape, seq, batch = ("tiny", 1024, 4) if ctx["fast"] else ("qwen2.5-0.5b", 4096, 4)
    else:
        shape, seq, batch = ("tiny", 128, 2) if ctx["fast"] else ("tiny", 256, 4)
    arch = shape_arch(shape, seq)
    cfg = step_config(seq)
    layout = init_world(arch, cfg)
    weights, first = _two_steps(cfg, arch, layout, None, batch, seq)
    _, second = _two_steps(cfg, arch, layout, weights, batch, seq)
    identical, why = _identical(first, second)
    n = {"shape": shape, "seq": seq, "batch": batch, "attention": layout.attention, "loss_1": first[0][0]}
    n.update(grad_norm_1=first[0][1], loss_2=first[1][0], grad_norm_2=first[1][1], identical_steps=identical)
    return Result(not why, n, why)


TE = ("model.transformer_impl=transformer_engine",)
FP8 = ("model.fp8=hybrid", "model.fp8_recipe=tensorwise")


def check_te(ctx: dict) -> Result:
    """Transformer Engine's layers: the train step at the 0.5B and 1.5B shapes in bf16 and FP8 (current scaling,
    compute capability 8.9+), against the local layers with SDPA; then, at the 0.5B shape and sequence 1024, the TE
    policy's logprobs against the local policy's on the same weights, packed rows against padded, and determinism
    (TE's fused attention backward under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, which child_env sets)."""
    from importlib.metadata import version

    import torch
    import transformer_engine.pytorch  # noqa: F401 - the first thing to fail on a bad install: say so plainly

    from megatron_dapo.model.perf import random_samples, shape_arch
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.provider import tp_gathered_tensors

    n: dict[str, Any] = {"cuda": torch.version.cuda, "te": version("transformer-engine")}
    peak = _peak_tflops(ctx, torch.bfloat16)
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    if not fp8:
        n["fp8"] = "not run: compute capability below 8.9"
    runs = [("tiny", 512, 2)] if ctx["fast"] else [("qwen2.5-0.5b", 4096, 8), ("qwen2.5-1.5b", 4096, 8)]
    for shape, seq, batch in runs:
        key = shape.removeprefix("qwen2.5-").replace(".", "")
        for name, overrides in [("te", TE)] + ([("te_fp8", (*TE, *FP8))] if fp8 else []):
            rates = _time_step(peak, shape, seq, batch, 3, *overrides)
            for k in ("train_tokens_per_s", "mfu", "mfu_spec", "step_mfu_spec", "peak_gib"):
                if k in rates:
                    n[f"{key}_{name}_{k}"] = rates[k]
        if fp8:
            n[f"{key}_fp8_x_bf16"] = round(n[f"{key}_te_fp8_train_tokens_per_s"] / n[f"{key}_te_train_tokens_per_s"], 3)

    shape, seq, batch = ("tiny", 512, 2) if ctx["fast"] else ("qwen2.5-0.5b", 1024, 4)
    arch = shape_arch(shape, seq)
    samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=1)
    logps, weights = {}, None
    for name, overrides in (("local", ()), ("te", TE), ("te_padded", (*TE, "train.packed_sequences=false"))):
        cfg = step_config(seq, *overrides)
        policy = MegatronPolicy(cfg, arch, init_world(arch, cfg), weights)
        if weights is None:
            weights = {k: v.cpu() for k, v in tp_gathered_tensors(policy.model, arch, policy.layout).items()}
        logps[name] = torch.cat([lp["logp"] for lp in policy.compute_logprobs(samples, 1.0)])
        policy.close()
        del policy
        _free_memory()
    n["te_vs_local_logp_mean"] = round(float((logps["te"] - logps["local"]).abs().mean()), 5)
    n["packed_vs_padded_logp_max"] = round(float((logps["te"] - logps["te_padded"]).abs().max()), 5)
    cfg = step_config(seq, *TE)
    layout = init_world(arch, cfg)
    _, first = _two_steps(cfg, arch, layout, weights, batch, seq)
    _, second = _two_steps(cfg, arch, layout, weights, batch, seq)
    n["te_identical_steps"], why = _identical(first, second)
    # bf16 both ways, different GEMM and attention kernels: the same policy up to bf16 rounding (the bridge's 0.05)
    ok = _finite(n) and not why and n["te_vs_local_logp_mean"] < 0.05 and n["packed_vs_padded_logp_max"] < 0.05
    return Result(ok, n, why)


PROFILE_KERNELS = {
    "attention": r"flash|fmha|attention|softmax|sdpa|bmm",
    "gemm": r"gemm|cutlass|xmma|nvjet|cublas|matmul",
    "optimizer": r"multi_tensor|adam|foreach",
}
"""Device kernels by name (regex, lower case), first match wins; the vocabulary path is read from its own
record_function range ("vocab", model/logprobs.py), the optimizer from "optimizer" (model/policy.py) when present."""


def check_profile(ctx: dict) -> Result:
    """One profiled train step (old-logprob forward included) of the 1.5B shape at sequence 4096 with the default
    attention: the share of device time in attention, GEMMs, the vocabulary path and the optimizer."""
    import re

    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_dapo.model.perf import random_samples, shape_arch, time_train_step
    from megatron_dapo.model.policy import MegatronPolicy

    shape, seq, batch = ("tiny", 512, 2) if ctx["fast"] else ("qwen2.5-1.5b", 4096, 8)
    arch = shape_arch(shape, seq)
    cfg = step_config(seq)
    policy = MegatronPolicy(cfg, arch, init_world(arch, cfg), None)
    samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=0)
    time_train_step(policy, samples, 1)  # warm-up steps: the allocator's pools, kernels chosen
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s, lp in zip(samples, policy.compute_logprobs(samples, 1.0)):
            s.old_logp = lp["logp"]
        policy.train_step(samples, 1.0)
        torch.cuda.synchronize()
    policy.close()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) or 1.0
    share = dict.fromkeys((*PROFILE_KERNELS, "other"), 0.0)
    for e in kernels:
        kind = next((k for k, rx in PROFILE_KERNELS.items() if re.search(rx, e.key.lower())), "other")
        share[kind] += e.self_device_time_total / total
    ranges = {e.key: e.device_time_total / total for e in events if e.key in ("vocab", "optimizer")}
    n: dict[str, Any] = {"shape": shape, "seq": seq, "batch": batch, "device_ms": round(total / 1e3, 1)}
    n.update({f"{k}_share": round(v, 3) for k, v in share.items()})
    n.update({f"{k}_range_share": round(v, 3) for k, v in ranges.items()})
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    details = [f"{e.self_device_time_total / total:6.1%}  {e.key[:120]}" for e in top]
    return Result(_finite(n) and total > 1.0, n, details=details)
