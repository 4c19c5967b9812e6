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

On the wire, per update: a header {"version", "weight_format"}; per bucket {"tensors": [(name, dtype, shape)],
"digest": the bridge's bucket_digest or None} then one flat uint8 buffer holding the bucket's tensors back to back,
each 16-byte aligned (any dtype, FP8 too, travels as its bytes); then {"tensors": []}. An object travels as its
length then its bytes, read by the restricted unpickler (megatron_dapo/safe_pickle.py). The receiver compares each
bucket's digest with the bytes that arrived before the engine sees any of them.

A failure inside an update can be asked for (progress.py, DAPO_FAULT): `send:V:B` on the train rank that sends,
`receive:V:B` on a rollout rank once its engine has taken bucket B of update V: the resilience tests' kill -9 or
SIGSTOP mid-weight-update, at a point no signal sent from outside could aim at.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
import time
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_dapo import progress, safe_pickle
from megatron_dapo.model.comm import broadcast_bytes

Bucket = list[tuple[str, torch.Tensor]]
"""Hugging Face (name, full tensor) pairs: what WeightBridge yields and a sender sends, one buffer at a time."""

_PRIME = (1 << 61) - 1
_WEIGHT_PERIOD = 65521  # the largest prime below 2**16: a word's weight is its position modulo this, plus 1
_CHUNK = {"cpu": _WEIGHT_PERIOD * 4, "cuda": _WEIGHT_PERIOD * 32}
"""Words per pass, by device type: a multiple of the period (so any size gives the same digest) below 2**21 (its sums
stay below 2**52, exact in float64). The host keeps its two float64 pass buffers (4 MiB), so its passes are short; a
GPU's are long (each pass is a few kernel launches, and its allocator frees the buffers' 33 MiB to the cache)."""
_cpu_buffers = threading.local()  # per thread: a pass writes into its buffer


def _buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the position weights, a pass's words) as float64: CPU keeps them (fresh host memory is slow to touch, ~5x
    here), a GPU's caching allocator makes them cheap to ask for again."""
    chunk = _CHUNK.get(device.type, _CHUNK["cuda"])
    kept = getattr(_cpu_buffers, "made", None)
    if device.type == "cpu" and kept is not None and kept[0].numel() == chunk:
        return kept
    weights = torch.arange(chunk, dtype=torch.float64, device=device).remainder_(_WEIGHT_PERIOD).add_(1)
    made = (weights, torch.empty(chunk, dtype=torch.float64, device=device))
    if device.type == "cpu":
        _cpu_buffers.made = made
    return made


def bucket_digest(bucket: Bucket) -> str:
    """A checksum of a bucket as it crosses: each tensor's name, dtype, shape and bytes, in order. The bytes, as signed
    16-bit words w_i, give sum(w_i) and sum(w_i * (i mod 65521 + 1)) modulo 2**61 - 1, computed where the tensor is
    (no copy to the host; a pass's sums are below 2**52, exact in float64): any changed word, and words moved within
    a tensor, change it. A check against damage in transit or loading, not against tampering. 32 hex digits."""
    h = hashlib.blake2b(digest_size=16)
    sums = []
    for name, t in bucket:
        h.update(f"{name}|{_dtype_name(t.dtype)}|{tuple(t.shape)};".encode())
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() % 2:
            raw = torch.cat([raw, raw.new_zeros(1)])
        words = raw.view(torch.int16)
        weights, buffer = _buffers(words.device)
        s1 = torch.zeros((), dtype=torch.int64, device=words.device)
        s2 = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), len(buffer)):
            n = min(len(buffer), words.numel() - start)
            w = buffer[:n]
            w.copy_(words[start : start + n])
            s1 = (s1 + w.sum().to(torch.int64)) % _PRIME
            s2 = (s2 + torch.dot(w, weights[:n]).to(torch.int64)) % _PRIME
        sums.append(torch.stack([s1, s2]))
    if sums:
        h.update(repr(torch.stack(sums).cpu().tolist()).encode())  # one copy to the host per bucket
    return h.hexdigest()


def check_digest(bucket: Bucket, sent: Optional[str], where: str) -> None:
    """Raise (naming the bucket's first tensor) unless the bucket that arrived has the digest it was sent with (None:
    the sender sent none)."""
    if sent is None:
        return
    got = bucket_digest(bucket)
    if got != sent:
        first = bucket[0][0] if bucket else "(none)"
        raise RuntimeError(
            f"weight sync: {where} arrived damaged: its first tensor '{first}' of {len(bucket)}, digest {got} "
            f"where {sent} was sent; nothing of it was loaded"
        )


def corrupted(bucket: Bucket) -> Bucket:
    """The bucket with one bit of its first tensor flipped (a copy: the model keeps its weights): DAPO_FAULT's
    corrupt action, what a bad link or a wrong load would do."""
    (name, first), rest = bucket[0], bucket[1:]
    damaged = first.detach().clone()
    damaged.reshape(-1).view(torch.uint8)[0] ^= 1
    return [(name, damaged), *rest]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_dtype_name(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}


class TransportGroup:
    """`size` processes (rank 0 the sender) joined over a TCP store at host:port, with a gloo or NCCL process group
    of their own; device: where buffers live (NCCL: this process's CUDA device); store: the TCP store, for keys that
    say what is ready without a collective."""

    def __init__(self, pg, rank: int, size: int, device: torch.device, store=None) -> None:
        self.pg, self.rank, self.size, self.device, self.store = pg, rank, size, device, store
        self.bytes_received = 0
        """Bytes this rank received through scatter_object so far."""

    @staticmethod
    def connect(
        host: str, port: int, rank: int, size: int, backend: str = "gloo", timeout_s: float = 600.0, name: str = ""
    ):
        """Rank 0 listens on host:port, the others connect; blocks until all `size` have joined. timeout_s bounds
        the joining and every collective after it (trainer.collective_timeout_s); name: the group in progress's
        list of armed groups ("transport:NAME")."""
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            group = TransportGroup(pg, rank, size, torch.device("cpu"), store)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # unset, NCCL's group would keep its own default
            device = torch.device("cuda", torch.cuda.current_device())
            group = TransportGroup(dist.ProcessGroupNCCL(store, rank, size, options), rank, size, device, store)
        else:
            raise ValueError(f"weight transport backend {backend!r}: expected 'gloo' or 'nccl'")
        progress.STATE.groups[f"transport:{name or port}"] = group.timeout_s()
        return group

    def timeout_s(self) -> float:
        """The group's collective timeout, as its backend holds it (-1 where it does not say)."""
        try:
            return self.pg.options._timeout.total_seconds()
        except AttributeError:
            return -1.0

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj, src: int):
        """obj from src (ignored elsewhere), to every rank: its pickle's length, then its bytes, read by the
        restricted unpickler (a pickle naming anything but plain data and the project's records is refused)."""
        is_src = self.rank == src
        data = broadcast_bytes(safe_pickle.dumps(obj) if is_src else None, is_src, lambda t: self.broadcast(t, src),
                               self.device)  # fmt: skip
        return obj if is_src else safe_pickle.loads(data, f"an object from rank {src} of the transport group")

    def scatter_object(self, objs: Optional[list], src: int):
        """objs[r] from src to each rank r (objs ignored elsewhere; src keeps objs[src]): its pickle's length, then
        its bytes, point to point, so each rank receives its own object only; read by the restricted unpickler."""
        if self.rank != src:
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.pg.recv([n], src, 0).wait()
            buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
            self.pg.recv([buf], src, 1).wait()
            self.bytes_received += buf.numel()
            return safe_pickle.loads(buf.cpu().numpy().tobytes(), f"an object from rank {src} of the transport group")
        if objs is None or len(objs) != self.size:
            raise ValueError(f"scatter_object: expected one object per rank of the group ({self.size})")
        sends = []
        for rank, obj in enumerate(objs):
            if rank == src:
                continue
            data = safe_pickle.dumps(obj)
            n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            sends.append((n, buf, self.pg.send([n], rank, 0), self.pg.send([buf], rank, 1)))
        for _, _, sent_n, sent_buf in sends:  # the tensors stay referenced until their sends complete
            sent_n.wait()
            sent_buf.wait()
        return objs[src]


class WeightSender:
    """The train side: WeightBridge.sync(sender) broadcasts every bucket over `group` from its rank (None: this rank
    sends nothing). weight_format: what the receiving engines load (their VLLMEngine.weight_format)."""

    def __init__(self, group: Optional[TransportGroup], weight_format: str = "none") -> None:
        self.group, self.weight_format = group, weight_format
        self.version: Optional[int] = None
        self.stats: dict[str, float] = {}

    @property
    def takes_digest(self) -> bool:
        """Whether the bridge should compute each bucket's digest for this sender: only where it sends."""
        return self.group is not None

    def begin(self, version: int) -> None:
        """Open the next update: the weights that follow are policy version `version`."""
        if self.version is not None:
            raise RuntimeError(f"WeightSender.begin({version}) while version {self.version} is still being sent")
        self.version, self._t0, self._bytes, self._buckets = version, time.perf_counter(), 0, 0
        if self.group is not None:
            self.group.broadcast_object({"version": version, "weight_format": self.weight_format}, self.group.rank)

    def update_weights(self, bucket: Bucket, digest: Optional[str] = None) -> None:
        """One bucket of full Hugging Face tensors (the bridge's), sent as its names, its digest (bucket_digest, which
        the receivers check; None: unchecked) and one flat buffer."""
        if self.version is None:
            raise RuntimeError("WeightSender.update_weights() before begin(version)")
        if self.group is None or not bucket:
            return
        for name, t in bucket:
            if _dtype_name(t.dtype) not in _DTYPES:
                raise ValueError(f"weight transport: tensor '{name}' has dtype {t.dtype}; sends {sorted(_DTYPES)}")
        specs = [(n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in bucket]
        self.group.broadcast_object({"tensors": specs, "digest": digest}, self.group.rank)
        size = sum(_padded(t.numel() * t.element_size()) for _, t in bucket)
        flat = torch.zeros(size, dtype=torch.uint8, device=self.group.device)
        at = 0
        for _, t in bucket:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[at : at + raw.numel()].copy_(raw)
            at += _padded(raw.numel())
        self.group.broadcast(flat, self.group.rank)
        progress.point("bucket")
        progress.fault("send", self.version, self._buckets)
        self._bytes += flat.numel()
        self._buckets += 1

    def finish_weight_update(self) -> None:
        """Close the update: the receivers' tensors() ends."""
        if self.version is None:
            raise RuntimeError("WeightSender.finish_weight_update() before begin(version)")
        if self.group is not None:
            self.group.broadcast_object({"tensors": []}, self.group.rank)
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
        for index in itertools.count():
            message = self.group.broadcast_object(None, self.src)
            specs = message["tensors"]
            if not specs:
                self._open = False
                return
            sizes = [_DTYPES[d].itemsize * math.prod(shape) for _, d, shape in specs]
            flat = torch.empty(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(flat, self.src)
            bucket, at = [], 0
            for (name, d, shape), n in zip(specs, sizes):
                bucket.append((name, flat[at : at + n].view(_DTYPES[d]).reshape(shape)))
                at += _padded(n)
            check_digest(bucket, message["digest"], f"bucket {index} of weight update {self.version}")
            yield from bucket
            progress.point("bucket")
            progress.fault("receive", self.version, index)  # the engine has taken this bucket's tensors


def _padded(nbytes: int) -> int:
    """Each tensor starts 16-byte aligned in a bucket's buffer, so its bytes view back as its own dtype."""
    return -(-nbytes // 16) * 16
