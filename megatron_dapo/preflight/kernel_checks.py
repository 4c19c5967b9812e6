"""The preflight's fused-kernel checks: the Triton policy loss against the PyTorch reference (equality), and its
speed and memory traffic at training sizes (preflight/kernel_bench.py does the work)."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace
from typing import Any

from megatron_dapo.preflight.checks import Result, all_finite, copy_gbs


def check_kernel_equality(ctx: dict) -> Result:
    import torch
    import triton

    from megatron_dapo.kernels.ratio_clip_reduce import interpreter_enabled
    from megatron_dapo.preflight.kernel_bench import equality_check

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
    from megatron_dapo.preflight.kernel_bench import bench_size

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
    ok = not ours and all_finite(n) and all(f"{s}_fused_ms" in n for s in sizes)
    return Result(ok, n, "; ".join(errors)[:500], details=rows)
