"""Python objects between processes: pickled by megatron_dapo/safe_pickle.py, sent as uint8 tensors, read back by its
restricted unpickler (torch.distributed's own object collectives unpickle whatever arrives).

Every object collective of the package goes through here: over a torch.distributed group (the world, Megatron's
pipeline group) or, through `broadcast_bytes`, over a process group of its own (rollout/weight_transport.py).
Each call is collective over its group, as torch's are; `what` names the object in a refusal.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dapo import safe_pickle


def group_device(group: Any = None) -> torch.device:
    """Where a group's tensors live: this process's CUDA device for NCCL, else the CPU (gloo; a world of both
    backends carries CPU tensors over gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(
    data: Optional[bytes], is_src: bool, broadcast: Callable[[torch.Tensor], None], device: torch.device
) -> bytes:
    """data from the source (ignored elsewhere) on every member: its length, then its bytes, each one call of
    broadcast(tensor), which sends the source's tensor into everyone else's."""
    n = torch.tensor([len(data) if is_src else 0], dtype=torch.int64, device=device)
    broadcast(n)
    buf = torch.empty(int(n), dtype=torch.uint8, device=device)
    if is_src and len(data):
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    broadcast(buf)
    return data if is_src else buf.cpu().numpy().tobytes()


def broadcast_object(obj: Any, src: int, what: str, group: Any = None) -> Any:
    """obj from global rank src (ignored elsewhere) on every rank of group."""
    is_src = dist.get_rank() == src
    data = safe_pickle.dumps(obj) if is_src else None
    got = broadcast_bytes(data, is_src, lambda t: dist.broadcast(t, src=src, group=group), group_device(group))
    return obj if is_src else safe_pickle.loads(got, what)


def _padded_parts(obj: Any, group: Any) -> tuple[torch.Tensor, list[int], torch.device]:
    """This rank's pickle padded to the longest of the group's, and every rank's length."""
    device = group_device(group)
    data = safe_pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    return mine, lengths, device


def all_gather_objects(obj: Any, what: str, group: Any = None) -> list[Any]:
    """Every rank's obj, in group rank order, on every rank of group."""
    mine, lengths, _ = _padded_parts(obj, group)
    parts = [torch.empty_like(mine) for _ in lengths]
    dist.all_gather(parts, mine, group=group)
    return [safe_pickle.loads(p[:n].cpu().numpy().tobytes(), what) for p, n in zip(parts, lengths)]


def gather_objects(obj: Any, dst: int, what: str, group: Any = None) -> Optional[list[Any]]:
    """Every rank's obj, in group rank order, on global rank dst; None elsewhere."""
    mine, lengths, _ = _padded_parts(obj, group)
    here = dist.get_rank() == dst
    parts = [torch.empty_like(mine) for _ in lengths] if here else None
    dist.gather(mine, parts, dst=dst, group=group)
    if not here:
        return None
    return [safe_pickle.loads(p[:n].cpu().numpy().tobytes(), what) for p, n in zip(parts, lengths)]
