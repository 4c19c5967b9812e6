"""The preflight's check types, the helpers its checks share, and the environment checks: versions, device limits.

The checks that need no vLLM come in families: these, the fused kernel's (kernel_checks.py), the train step's
(train_checks.py); those that need vLLM are engine_checks.py's. Each check takes the run's context (ctx: "fast", and the limits row's "copy_gbs" and "peak_tflops" once measured)
and returns a Result; megatron_dapo/preflight/run.py runs each in its own process. Torch and the rest are imported
inside the checks, so listing them (tools/preflight.py --help) loads nothing heavy.
"""

from __future__ import annotations

import gc
import math
import os
import platform
from dataclasses import dataclass
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


def free_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def all_finite(numbers: dict) -> bool:
    return all(math.isfinite(v) for v in numbers.values() if isinstance(v, float))


def peak_tflops(ctx: dict, dtype) -> float:
    """The matmul rate MFU is measured against: the limits row's on a GPU, else measured now (model.perf's)."""
    import torch

    from megatron_dapo.model.perf import measure_peak_tflops

    if ctx.get("peak_tflops") and torch.cuda.is_available():
        return ctx["peak_tflops"]
    return measure_peak_tflops(dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def copy_gbs(ctx: dict) -> float:
    from megatron_dapo.model.perf import copy_bandwidth_gbs

    return ctx.get("copy_gbs") or copy_bandwidth_gbs()


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
    return Result(all_finite(n) and n["copy_gbs"] > 0 and n["bf16_tflops"] > 0, n)
