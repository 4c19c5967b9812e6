"""The preflight's train-step checks: tokens/s and MFU per attention and recompute variant, determinism of two
fresh policies, Transformer Engine's layers against the local ones, and a profile of one step.

Each builds MegatronPolicy at a named shape (model/perf.py's SHAPES) with random weights, in this check's process.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from megatron_dapo.preflight.checks import GIB, Result, all_finite, free_memory, init_world, peak_tflops, step_config


def _time_step(peak: float, shape: str, seq: int, batch: int, steps: int, *overrides: str) -> dict:
    """tokens/s and MFU (against `peak` TFLOP/s) of the DAPO train step of a random-weight `shape`, with
    megatron_dapo/model/perf.py's FLOP accounting; peak GPU memory on CUDA."""
    import torch

    from megatron_dapo.model.perf import random_samples, shape_arch, spec_tflops, time_train_step, train_rates
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.trainer import policy_options

    arch = shape_arch(shape, seq)
    cfg = step_config(seq, *overrides)
    layout = init_world(arch, cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    policy = MegatronPolicy(arch, layout, None, **policy_options(cfg))
    try:
        samples = random_samples(arch.vocab_size, batch, seq // 4, seq, seed=0)
        logprob_s, train_s = time_train_step(policy, samples, steps)
    finally:
        policy.close()  # the next variant builds its own policy in this process
        del policy
        free_memory()
    cuda = torch.cuda.is_available()
    spec = spec_tflops(torch.cuda.get_device_name()) if cuda else None
    out = train_rates(arch, seq, batch * seq, 1, logprob_s, train_s, peak, spec)
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    return out


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
            free_memory()  # out of the except block: its traceback no longer holds the failed step's tensors
            continue
        keys = ("train_tokens_per_s", "mfu", "mfu_spec", "step_mfu_spec", "logprob_mfu", "train_step_s", "peak_gib")
        n.update({prefix + k: rates[k] for k in keys if k in rates})
        ran.append(prefix + "mfu")
    ok = bool(ran) and all_finite(n) and all(n[k] > 0 for k in ran)
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
        peak = peak_tflops(ctx, torch.bfloat16 if cuda else torch.float32)
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
    from megatron_dapo.trainer import policy_options

    policy = MegatronPolicy(arch, layout, weights, **policy_options(cfg))
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
    free_memory()
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
    from megatron_dapo.trainer import policy_options

    n: dict[str, Any] = {"cuda": torch.version.cuda, "te": version("transformer-engine")}
    peak = peak_tflops(ctx, torch.bfloat16)
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
        policy = MegatronPolicy(arch, init_world(arch, cfg), weights, **policy_options(cfg))
        if weights is None:
            weights = {k: v.cpu() for k, v in tp_gathered_tensors(policy.model, arch, policy.layout).items()}
        logps[name] = torch.cat([lp["logp"] for lp in policy.compute_logprobs(samples, 1.0)])
        policy.close()
        del policy
        free_memory()
    n["te_vs_local_logp_mean"] = round(float((logps["te"] - logps["local"]).abs().mean()), 5)
    n["packed_vs_padded_logp_max"] = round(float((logps["te"] - logps["te_padded"]).abs().max()), 5)
    cfg = step_config(seq, *TE)
    layout = init_world(arch, cfg)
    _, first = _two_steps(cfg, arch, layout, weights, batch, seq)
    _, second = _two_steps(cfg, arch, layout, weights, batch, seq)
    n["te_identical_steps"], why = _identical(first, second)
    # bf16 both ways, different GEMM and attention kernels: the same policy up to bf16 rounding (the bridge's 0.05)
    ok = all_finite(n) and not why and n["te_vs_local_logp_mean"] < 0.05 and n["packed_vs_padded_logp_max"] < 0.05
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
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_dapo.model.perf import random_samples, shape_arch, time_train_step
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.trainer import policy_options

    shape, seq, batch = ("tiny", 512, 2) if ctx["fast"] else ("qwen2.5-1.5b", 4096, 8)
    arch = shape_arch(shape, seq)
    cfg = step_config(seq)
    policy = MegatronPolicy(arch, init_world(arch, cfg), None, **policy_options(cfg))
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
    return Result(all_finite(n) and total > 1.0, n, details=details)
