"""Megatron shards -> full Hugging Face tensors for the rollout engine, streamed in buckets.

Every rank walks the model's tensors in the same order. The pipeline stage that owns a
tensor all-gathers it over its tensor-parallel group (regrouping fc1's gate/up halves,
dropping vocabulary padding), then broadcasts it over the pipeline group, so every rank
(and the vLLM worker colocated with it, which re-slices for its own tensor parallel) sees
it. Megatron names become Hugging Face names (QKV split per query group, fc1 split into
gate and up) and are packed into buckets of at most `bucket_bytes`. No rank ever holds
more than one bucket plus the tensor in flight, never the whole model.

A mixture-of-experts model's experts are split over the expert-parallel ranks of each stage: an expert's tensor is
gathered over its expert-TP group by the EP rank that holds it, broadcast over the EP group, then over the pipeline
like any other, one tensor at a time, so no rank ever holds more of a layer's experts than one bucket and the
tensor in flight.

An engine that takes quantized weights says so in its `weight_format` (rollout/quantize.py): each
tensor is then encoded on the fly as it joins its bucket (FP8: the weight plus its scales, or the
FP8-rounded weight dequantized), so quantizing never holds more than one tensor either.

Each bucket goes with its digest (weight_transport.bucket_digest of the bytes sent); the engine side computes it
again over what it received and refuses a bucket that differs before anything of it is loaded.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from megatron_dapo import progress
from megatron_dapo.convert.layouts import megatron_names, megatron_shape, megatron_to_hf
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.comm import Comm
from megatron_dapo.model.parallel import Layout
from megatron_dapo.model.provider import gather_tp, local_slots
from megatron_dapo.model.sharding import expert_of
from megatron_dapo.rollout.engine import WeightSink
from megatron_dapo.rollout.quantize import encode
from megatron_dapo.rollout.weight_transport import Bucket, bucket_digest, corrupted


class WeightBridge:
    """Streams a Megatron model (any TP/PP layout) as Hugging Face-named full tensors."""

    def __init__(
        self, model_chunks: list, arch: ModelArch, layout: Layout, bucket_bytes: int = 1 << 30, digest: bool = True
    ) -> None:
        self.arch, self.layout, self.bucket_bytes, self.digest = arch, layout, bucket_bytes, digest
        self.comm = Comm(layout)
        self.params = {}
        for slot in local_slots(model_chunks, arch, layout.ep_rank):
            self.params.setdefault(slot.full_name, slot.param)  # a tied embedding: either copy will do
        self.pp_rank = layout.pp_rank
        # Which pipeline rank owns each tensor, and its dtype: learnt once, by exchanging what each stage holds, so
        # the other stages can allocate receive buffers.
        mine = sorted((name, str(p.dtype).removeprefix("torch.")) for name, p in self.params.items())
        held = self.comm.all_gather_objects(mine, "the tensors each pipeline stage holds", over="pp")
        self.owner: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for rank, entries in enumerate(held):
            for name, dtype in entries:
                if name not in self.owner:
                    self.owner[name], self.dtypes[name] = rank, getattr(torch, dtype)
        if arch.is_moe:  # an expert lives where its layer's router does, on EP rank expert // (experts per rank)
            for name in megatron_names(arch):
                expert = expert_of(name)
                if expert is not None:
                    router = f"decoder.layers.{expert[0]}.mlp.router.weight"
                    self.owner[name], self.dtypes[name] = self.owner[router], self.dtypes[router]
        missing = [n for n in megatron_names(arch) if n not in self.owner]
        if missing:
            raise RuntimeError(f"weight bridge: no pipeline stage holds {missing[:3]} ({len(missing)} tensors)")
        self.last_sync: dict[str, float] = {}
        self._encode_seconds = 0.0

    def _full_tensor(self, name: str) -> torch.Tensor:
        """The full Megatron tensor on every rank (collective over the TP, EP and PP groups)."""
        expert = expert_of(name)
        holder = expert[1] // (self.arch.num_experts // self.layout.ep) if expert else self.layout.ep_rank
        if self.owner[name] == self.pp_rank and holder == self.layout.ep_rank:
            t = gather_tp(name, self.params[name], self.arch, self.comm)
        else:
            t = torch.empty(megatron_shape(name, self.arch), dtype=self.dtypes[name], device=self.layout.device)
        if expert and self.owner[name] == self.pp_rank:
            self.comm.broadcast(t, holder, "ep")
        return self.comm.broadcast(t, self.owner[name], "pp")

    def _encoded(self, name: str, weight_format: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The Hugging Face tensors of one Megatron tensor, encoded for the engine (timed)."""
        for hf_name, t in megatron_to_hf(name, self._full_tensor(name), self.arch):
            t0 = time.perf_counter()
            encoded = list(encode(hf_name, t, weight_format))
            if t.is_cuda and weight_format != "none":
                torch.cuda.synchronize()  # time the kernels, not their launch
            self._encode_seconds += time.perf_counter() - t0
            yield from encoded

    def buckets(self, weight_format: str = "none") -> Iterator[Bucket]:
        """Hugging Face (name, tensor) buckets of at most bucket_bytes each, encoded in weight_format
        (rollout/quantize.py); collective: every rank must iterate."""
        bucket: Bucket = []
        size = 0
        for name in megatron_names(self.arch):
            for hf_name, t in self._encoded(name, weight_format):
                nbytes = t.numel() * t.element_size()
                if nbytes > self.bucket_bytes:
                    raise ValueError(
                        f"weight bridge: tensor '{hf_name}' ({nbytes} bytes) is larger than one bucket "
                        f"(rollout.bucket_bytes={self.bucket_bytes}); raise rollout.bucket_bytes"
                    )
                if size + nbytes > self.bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((hf_name, t.contiguous()))
                size += nbytes
        if bucket:
            yield bucket

    def sync(self, engine: WeightSink, version: int = 0) -> dict[str, float]:
        """Stream every bucket into engine.update_weights(bucket, digest), encoded in the engine's weight_format
        (default "none"); version: the policy version these weights are (the fault places name it). Returns seconds,
        GB and GB/s of this sync, the seconds spent quantizing and computing digests."""
        t0 = time.perf_counter()
        total = 0
        buckets = 0
        self._encode_seconds = digest_seconds = 0.0
        for bucket in self.buckets(getattr(engine, "weight_format", "none")):
            t1 = time.perf_counter()
            digest = bucket_digest(bucket) if self.digest and getattr(engine, "takes_digest", True) else None
            digest_seconds += time.perf_counter() - t1
            if progress.fault("sync", version, buckets):  # DAPO_FAULT=corrupt:sync:V:B, after the digest
                bucket = corrupted(bucket)
            engine.update_weights(bucket, digest)
            progress.point("bucket")
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            buckets += 1
        engine.finish_weight_update()  # an incomplete update fails here, not at the next generate()
        seconds = time.perf_counter() - t0
        self.last_sync = {
            "weight_sync/seconds": seconds,
            "weight_sync/gb": total / 1e9,
            "weight_sync/gb_per_s": total / 1e9 / seconds if seconds > 0 else 0.0,
            "weight_sync/buckets": float(buckets),
            "weight_sync/quantize_seconds": self._encode_seconds,
            "weight_sync/digest_seconds": digest_seconds,
        }
        return self.last_sync
