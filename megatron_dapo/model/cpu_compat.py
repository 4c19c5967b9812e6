"""Run megatron-core on a machine without CUDA (tests, the CPU demo).

megatron-core hard-codes CUDA in ~140 places: `torch.cuda.current_device()` as a device,
`device="cuda"` in tensor factories, `.cuda()`, CUDA streams and events, CUDA RNG state in
the model-parallel RNG tracker, and `Tensor.type()` asserts in the optimizer. This module
patches those, process-wide, so that the same Megatron code path runs on CPU with gloo:

- `torch.cuda.current_device` returns the CPU device; `synchronize`, streams and events
  become no-ops;
- a TorchFunctionMode rewrites `device="cuda"` arguments, `.to("cuda")` and `.cuda()` to
  CPU, drops `pin_memory`, and makes the no-argument `Tensor.type()` report
  `torch.cuda.*Tensor` (optimizer and grad-clip asserts check for it);
- the causal-mask helpers build their masks on CPU (autograd runs backward outside the
  function mode, where activation recompute calls them);
- the CUDA RNG calls of the RNG tracker use the CPU generator;
- the mixture-of-experts layers run without Transformer Engine: the router's `te_general_gemm` (a name moe_utils
  leaves undefined without TE, called on every forward) is None, so the router takes torch's matmul; the alltoall
  dispatcher's split sizes become numpy arrays as on CUDA (Megatron converts only CUDA tensors, and gloo's
  all_to_all_single refuses tensors as split sizes), and its device-to-host event is one that synchronizes;
- Megatron is imported with its JIT fuser off (`_import_megatron_eager`): its fused paths are off on CPU
  (model/provider.py), so nothing of it would be compiled, and wrapping its fusions in torch.compile at import
  costs every process ~3 s of importing dynamo and inductor; and without wandb, which it would import for logging
  of its own that this project never asks for (~0.9 s).

`enable()` does nothing when CUDA is available; call it before building models.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placement to CPU in every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.cuda or name == "cuda":
            return args[0]
        if func is torch.Tensor.to or name == "to":
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if (func is torch.Tensor.type or name == "type") and len(args) == 1 and not kwargs:
            # Megatron asserts params are torch.cuda.*Tensor; report the CUDA name of the CPU type
            return func(*args, **kwargs).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.pin_memory or name == "pin_memory":
            return args[0]
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for torch.cuda.Stream / Event on CPU: everything is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        return _NoStream()  # an event: its synchronize() is called

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _patch_moe() -> None:
    """The MoE layers' CUDA and Transformer Engine assumptions (see the module docstring)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def split_sizes_to_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy and not tensor.is_cuda:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = split_sizes_to_numpy


def _import_megatron_eager() -> None:
    """Import megatron.core with torch.compile standing as the identity and wandb absent, then turn Megatron's JIT
    fuser off.

    megatron.core.jit sets `jit_fuser = torch.compile` and its fusion modules decorate with it at import; the first
    torch.compile call imports torch._dynamo and the inductor backend. A process that imported Megatron already (or
    imports vLLM, which compiles at import too) is unaffected.
    """
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile

    def eager(model=None, **kwargs):  # torch.compile(fn, ...) and torch.compile(...)(fn) alike
        return model if model is not None else (lambda fn: fn)

    torch.compile = eager
    # Megatron's timers and inference context import wandb if installed (~0.9 s), for logging this project never
    # asks of them: they find none (train.py's MetricSinks imports it itself when trainer.wandb_project is set)
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    try:
        import megatron.core.jit
    finally:
        torch.compile = compile_
        if hide_wandb:
            del sys.modules["wandb"]
    megatron.core.jit.disable_jit_fuser()  # for the modules Megatron imports later


def enable() -> bool:
    """Apply the patches once (no-op with CUDA). Returns True when the patches are active."""
    global _ENABLED, _MODE
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # the CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all, which must stay untouched
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    _import_megatron_eager()
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cached_mask = functools.lru_cache(maxsize=8)(_causal_mask)
    transformer_utils.get_default_causal_mask = cached_mask
    fused_softmax.get_default_causal_mask = cached_mask
    _patch_moe()

    _MODE = _CudaToCpu()
    _MODE.__enter__()  # process-wide: stays active for the life of the process
    _ENABLED = True
    return True
