"""Weights from the train ranks to engines in other processes (asynchronous DAPO, issue 27): one code path whose
transport is a process group of either backend (gloo on CPU, NCCL on GPU).

The transport group is its own: built from a TCP store and the backend's ProcessGroup directly
(`TransportGroup.connect`), outside torch.distributed's default world, because each side already has a world of its
own (Megatron's on the train side; on the rollout side the one an in-process vLLM engine creates, whose set-up is
collective over whatever world it finds: an engine built in a world shared with the trainer waits for it forever).

The train side's end, `WeightSender`, stands in for an engine in `WeightBridge.sync`: the bridge hands it the
Hugging Face buckets it would hand a colocated engine (already encoded in the receiving engine's weight_format,
FP8 included), and the sender broadcasts each from its rank. Every train rank iterates the bridge (it is
collective); only the sending rank has a group, the others pass `None` and send nothing. The rollout side's end,
`WeightReceiver`, yields the same (name, tensor) pairs in the same order, lazily, so an engine applies them as they
arrive without holding the model twice:

    train rank:     sender.begin(version); bridge.sync(sender)
    rollout rank:   version = receiver.begin()
                    engine.update_weights_in_flight(receiver.tensors(), version, recompute_kv)

On the wire, per update: a header {"version", "weight_format"}; per bucket a list of (name, dtype, shape) then one
flat uint8 buffer holding the bucket's tensors back to back, each 16-byte aligned (any dtype, FP8 too, travels as
its bytes); then an empty list. An object travels pickled, as its length then its bytes.

A crash inside an update can be asked for: with DAPO_FAULT=send:V:B (or receive:V:B) the train rank that sends (a
rollout rank that receives) kills itself with SIGKILL once bucket B of update V is sent (applied): the resilience
tests' kill -9 mid-weight-update, at a point no signal sent from outside could aim at.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import signal
import time
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]
"""Hugging Face (name, full tensor) pairs: what WeightBridge yields and a sender sends, one buffer at a time."""


FAULT_ENV = "DAPO_FAULT"


def _fault_point(where: str, version: int, bucket: int) -> None:
    """SIGKILL this process here if DAPO_FAULT asks for it (no handler runs, nothing is flushed: a crash)."""
    if os.environ.get(FAULT_ENV) == f"{where}:{version}:{bucket}":
        os.kill(os.getpid(), signal.SIGKILL)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_dtype_name(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}


class TransportGroup:
    """`size` processes (rank 0 the sender) joined over a TCP store at host:port, with a gloo or NCCL process group
    of their own; device: where buffers live (NCCL: this process's CUDA device); store: the TCP store, for keys that
    say what is ready without a collective."""

    def __init__(self, pg, rank: int, size: int, device: torch.device, store=None) -> None:
        self.pg, self.rank, self.size, self.device, self.store = pg, rank, size, device, store

    @staticmethod
    def connect(host: str, port: int, rank: int, size: int, backend: str = "gloo", timeout_s: float = 600.0):
        """Rank 0 listens on host:port, the others connect; blocks until all `size` have joined."""
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            return TransportGroup(pg, rank, size, torch.device("cpu"), store)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            return TransportGroup(dist.ProcessGroupNCCL(store, rank, size), rank, size, device, store)
        raise ValueError(f"weight transport backend {backend!r}: expected 'gloo' or 'nccl'")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj, src: int):
        """obj from src (ignored elsewhere), to every rank: its pickle's length, then its bytes."""
        data = pickle.dumps(obj) if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(n, src)
        buf = torch.empty(int(n), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())


class WeightSender:
    """The train side: WeightBridge.sync(sender) broadcasts every bucket over `group` from its rank (None: this rank
    sends nothing). weight_format: what the receiving engines load (their VLLMEngine.weight_format)."""

    def __init__(self, group: Optional[TransportGroup], weight_format: str = "none") -> None:
        self.group, self.weight_format = group, weight_format
        self.version: Optional[int] = None
        self.stats: dict[str, float] = {}

    def begin(self, version: int) -> None:
        """Open the next update: the weights that follow are policy version `version`."""
        if self.version is not None:
            raise RuntimeError(f"WeightSender.begin({version}) while version {self.version} is still being sent")
        self.version, self._t0, self._bytes, self._buckets = version, time.perf_counter(), 0, 0
        if self.group is not None:
            self.group.broadcast_object({"version": version, "weight_format": self.weight_format}, self.group.rank)

    def update_weights(self, bucket: Bucket) -> None:
        """One bucket of full Hugging Face tensors (the bridge's), sent as its names and one flat buffer."""
        if self.version is None:
            raise RuntimeError("WeightSender.update_weights() before begin(version)")
        if self.group is None or not bucket:
            return
        for name, t in bucket:
            if _dtype_name(t.dtype) not in _DTYPES:
                raise ValueError(f"weight transport: tensor '{name}' has dtype {t.dtype}; sends {sorted(_DTYPES)}")
        specs = [(n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in bucket]
        self.group.broadcast_object(specs, self.group.rank)
        size = sum(_padded(t.numel() * t.element_size()) for _, t in bucket)
        flat = torch.zeros(size, dtype=torch.uint8, device=self.group.device)
        at = 0
        for _, t in bucket:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[at : at + raw.numel()].copy_(raw)
            at += _padded(raw.numel())
        self.group.broadcast(flat, self.group.rank)
        _fault_point("send", self.version, self._buckets)
        self._bytes += flat.numel()
        self._buckets += 1

    def finish_weight_update(self) -> None:
        """Close the update: the receivers' tensors() ends."""
        if self.version is None:
            raise RuntimeError("WeightSender.finish_weight_update() before begin(version)")
        if self.group is not None:
            self.group.broadcast_object([], self.group.rank)
        seconds = time.perf_counter() - self._t0
        self.stats = {
            "weight_transport/seconds": seconds,
            "weight_transport/gb": self._bytes / 1e9,
            "weight_transport/buckets": float(self._buckets),
        }
        self.version = None


class WeightReceiver:
    """The rollout side: begin() waits for the next update's header from rank `src`; tensors() yields its
    (name, tensor) pairs as the buckets arrive, on the group's device."""

    def __init__(self, group: TransportGroup, src: int = 0) -> None:
        self.group, self.src = group, src
        self.weight_format: Optional[str] = None
        self.version: Optional[int] = None
        self._open = False

    def begin(self) -> int:
        """Block until the train side opens an update; returns its policy version."""
        header = self.group.broadcast_object(None, self.src)
        if not isinstance(header, dict) or "version" not in header:
            raise RuntimeError(f"weight transport: expected an update's header from rank {self.src}, got {header!r}")
        self.weight_format, self._open = header["weight_format"], True
        self.version = int(header["version"])
        return self.version

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The update's tensors in the sender's order, one bucket received at a time; ends with the update."""
        if not self._open:
            raise RuntimeError("WeightReceiver.tensors() before begin()")
        for bucket in itertools.count():
            specs = self.group.broadcast_object(None, self.src)
            if not specs:
                self._open = False
                return
            sizes = [_DTYPES[d].itemsize * math.prod(shape) for _, d, shape in specs]
            flat = torch.empty(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(flat, self.src)
            at = 0
            for (name, d, shape), n in zip(specs, sizes):
                yield name, flat[at : at + n].view(_DTYPES[d]).reshape(shape)
                at += _padded(n)
            _fault_point("receive", self.version, bucket)  # the engine has taken this bucket's tensors


def _padded(nbytes: int) -> int:
    """Each tensor starts 16-byte aligned in a bucket's buffer, so its bytes view back as its own dtype."""
    return -(-nbytes // 16) * 16
