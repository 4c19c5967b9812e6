"""The one communication object: every collective of the package, over the groups of this process's Layout.

`Comm` is built from the Layout (model/parallel.py, where the groups are made) and names a group by its parallel
dimension: 'world', 'tp', 'pp', 'cp', 'dp', 'dp_cp' (data x context parallel), 'ep', 'etp'. A group of one rank
is no collective at all (a lone process needs no torch.distributed), and a group as large as the world is the world
(the asynchronous rollout side's plain world, a test's). Every wait is marked for the stall watchdog
(progress.waiting). Outside this module torch.distributed is called only where the groups are made
(model/parallel.py) and by the weight transport (rollout/weight_transport.py), besides torch.distributed.checkpoint
and the launchers' torch.distributed.run (tests/test_layers.py checks it).

Counting each replica once (`count_once`), the one rule: a value that several ranks hold copies of (the ranks of a
tensor-parallel group; of a context-parallel group once the positions are gathered; the pipeline stages, of what
the last stage computes) is summed over the world from one of them, the last stage's first rank of each group in
`copies`; the others add the op's identity. One world all-reduce, and every rank has the result.

Python objects travel pickled by megatron_dapo/safe_pickle.py as uint8 tensors and are read back by its restricted
unpickler (torch.distributed's own object collectives unpickle whatever arrives); `broadcast_bytes` serves the weight
transport's own groups too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dapo import progress, safe_pickle
from megatron_dapo.model.parallel import Layout, world_layout

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_IDENTITY = {"sum": 0.0, "max": float("-inf")}


def _group_device(group: Any = None) -> torch.device:
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


class Comm:
    """The collectives of one process, over the groups of its Layout (None: a lone process).

    Tensor collectives act on the caller's tensors where they are; the collectives of plain numbers and of objects
    put theirs on the group's device (_group_device). `src` and `dst` are ranks within the named group.
    """

    def __init__(self, layout: Optional[Layout] = None) -> None:
        self.layout = layout or world_layout()
        self.rank, self.world = self.layout.rank, self.layout.world_size
        self.device = _group_device() if self.world > 1 else torch.device("cpu")
        """The world's device: where the number and row collectives over it, and deliver's payloads, live."""
        self.bytes_gathered = 0
        """Bytes this rank received through all_gather_rows so far (the group summaries' traffic)."""

    # ---------------------------------------------------------------- groups

    def size(self, over: str) -> int:
        """Ranks in the group `over`."""
        layout = self.layout
        sizes = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "dp": layout.dp, "ep": layout.ep}
        sizes.update(world=layout.world_size, dp_cp=layout.dp * layout.cp, etp=layout.etp)
        return sizes[over]

    def _group(self, over: str) -> Any:
        """The process group `over` (None: the world's)."""
        if over == "world" or self.size(over) == self.world:
            return None
        from megatron.core import parallel_state as ps

        getters = {
            "tp": ps.get_tensor_model_parallel_group,
            "pp": ps.get_pipeline_model_parallel_group,
            "cp": ps.get_context_parallel_group,
            "dp": ps.get_data_parallel_group,
            "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "ep": ps.get_expert_model_parallel_group,
            "etp": ps.get_expert_tensor_parallel_group,
        }
        return getters[over]()

    def _waiting(self, over: str, what: str) -> contextlib.AbstractContextManager:
        return progress.waiting(f"the other ranks{'' if over == 'world' else ' of ' + over} ({what})")

    # ---------------------------------------------------------------- tensors

    def all_reduce(self, t: torch.Tensor, over: str = "world", op: str = "sum") -> torch.Tensor:
        """t reduced (op: 'sum' or 'max') over the group, in place; returns t."""
        if self.size(over) == 1:
            return t
        work = t.contiguous()  # gloo reduces a non-contiguous view wrong, silently
        with self._waiting(over, f"a {op}"):
            dist.all_reduce(work, op=_OPS[op], group=self._group(over))
        if work is not t:
            t.copy_(work)
        return t

    def all_gather(self, t: torch.Tensor, over: str) -> list[torch.Tensor]:
        """Every rank's t (the same shape on each) in the group's rank order."""
        if self.size(over) == 1:
            return [t]
        t = t.contiguous()  # gloo sends a non-contiguous tensor wrong, silently
        parts = [torch.empty_like(t) for _ in range(self.size(over))]
        with self._waiting(over, "a gather"):
            dist.all_gather(parts, t, group=self._group(over))
        return parts

    def broadcast(self, t: torch.Tensor, src: int, over: str) -> torch.Tensor:
        """Group rank src's t into every rank's t (contiguous, the same shape and dtype), in place; returns t."""
        if self.size(over) == 1:
            return t
        with self._waiting(over, f"a broadcast from its rank {src}"):
            dist.broadcast(t, group=self._group(over), group_src=src)
        return t

    def count_once(self, t: torch.Tensor, copies: Sequence[str], op: str = "sum") -> torch.Tensor:
        """t: [...] float -> a new tensor: its sum (or max) over the world, each value counted once (the module's
        rule). copies: the groups, of 'tp', 'cp' and 'pp', whose ranks hold copies of this rank's values ('pp': the
        last stage holds them, the other stages anything); of each set of copies the one that is first in its tp and
        cp groups and on the last stage counts."""
        layout = self.layout
        first = {"tp": layout.tp_rank == 0, "cp": layout.cp_rank == 0, "pp": layout.pp_rank == layout.pp - 1}
        counts = all(first[d] for d in copies)
        out = t.clone() if counts else torch.full_like(t, _IDENTITY[op])
        return self.all_reduce(out, "world", op)

    def send_recv(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], what: str
    ) -> None:
        """Point to point over the world: each (peer, tensor) of sends to that rank, each of recvs filled from that
        rank (in the order the peer sends them); returns when all are done. what: what moves, for the watchdog."""
        handles = [dist.irecv(t, peer) for peer, t in recvs]
        handles += [dist.isend(t, peer) for peer, t in sends]
        with self._waiting("world", what):
            for h in handles:
                h.wait()

    # ---------------------------------------------------------------- plain numbers

    def sum(self, values: Sequence[float], over: str = "world", what: str = "a sum") -> list[float]:
        """Element-wise sum over the group."""
        return self._reduce(values, over, "sum", what)

    def max(self, values: Sequence[float], over: str = "world", what: str = "a max") -> list[float]:
        """Element-wise max over the group."""
        return self._reduce(values, over, "max", what)

    def _reduce(self, values: Sequence[float], over: str, op: str, what: str) -> list[float]:
        if self.size(over) == 1:
            return [float(x) for x in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=_group_device(self._group(over)))
        with self._waiting(over, what):
            dist.all_reduce(t, op=_OPS[op], group=self._group(over))
        return t.cpu().tolist()

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [r, w] float64 on this rank -> [sum of r over the world's ranks, max of w], in rank order; a
        narrower rank's rows are padded with zero columns (one gather of the shapes, one of the rows)."""
        if self.world == 1:
            return rows
        with progress.waiting("the other ranks (their group summaries)"):
            shape = torch.tensor([rows.shape[0], rows.shape[1]], dtype=torch.int64, device=self.device)
            shapes = [torch.zeros_like(shape) for _ in range(self.world)]
            dist.all_gather(shapes, shape)
            sizes = [int(s[0].item()) for s in shapes]
            most, width = max(sizes), max(int(s[1].item()) for s in shapes)
            if most == 0:
                return rows.new_zeros((0, width))
            padded = torch.zeros((most, width), dtype=torch.float64, device=self.device)
            padded[: rows.shape[0], : rows.shape[1]] = rows.to(self.device)
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded)
        self.bytes_gathered += most * width * 8 * (self.world - 1)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).cpu()

    def barrier(self, what: str = "a barrier") -> None:
        """Every rank of the world arrives before any leaves."""
        if self.world > 1:
            with self._waiting("world", what):
                dist.barrier()

    # ---------------------------------------------------------------- objects (the restricted unpickler's)

    def broadcast_object(self, obj: Any, src: int = 0, what: Optional[str] = None, over: str = "world") -> Any:
        """Group rank src's obj (ignored elsewhere) on every rank of the group; what: the object, in a refusal."""
        if self.size(over) == 1:
            return obj
        what = what or f"an object broadcast by rank {src}"
        group, is_src = self._group(over), self._rank_in(over) == src
        data = safe_pickle.dumps(obj) if is_src else None
        with self._waiting(over, what):
            got = broadcast_bytes(
                data, is_src, lambda t: dist.broadcast(t, group=group, group_src=src), _group_device(group)
            )
        return obj if is_src else safe_pickle.loads(got, what)

    def all_gather_objects(self, obj: Any, what: str, over: str = "world") -> list[Any]:
        """Every rank's obj, in the group's rank order, on every rank of it."""
        if self.size(over) == 1:
            return [obj]
        with self._waiting(over, what):
            mine, lengths = self._padded_pickle(obj, over)
            parts = [torch.empty_like(mine) for _ in lengths]
            dist.all_gather(parts, mine, group=self._group(over))
        return [safe_pickle.loads(p[:n].cpu().numpy().tobytes(), what) for p, n in zip(parts, lengths)]

    def gather_objects(self, obj: Any, dst: int = 0, what: Optional[str] = None) -> Optional[list[Any]]:
        """Every world rank's obj, in rank order, on rank dst; None elsewhere."""
        if self.world == 1:
            return [obj]
        what = what or f"an object gathered on rank {dst}"
        here = self.rank == dst
        with self._waiting("world", what):
            mine, lengths = self._padded_pickle(obj, "world")
            parts = [torch.empty_like(mine) for _ in lengths] if here else None
            dist.gather(mine, parts, group_dst=dst)
        if not here:
            return None
        return [safe_pickle.loads(p[:n].cpu().numpy().tobytes(), what) for p, n in zip(parts, lengths)]

    def _padded_pickle(self, obj: Any, over: str) -> tuple[torch.Tensor, list[int]]:
        """This rank's pickle, padded to the longest of the group's, and every rank's length."""
        data = safe_pickle.dumps(obj)
        device = _group_device(self._group(over))
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [int(s.item()) for s in self.all_gather(size, over)]
        mine = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        return mine, lengths

    def _rank_in(self, over: str) -> int:
        """This rank's place in the group `over`."""
        layout = self.layout
        ranks = {"world": layout.rank, "tp": layout.tp_rank, "pp": layout.pp_rank, "cp": layout.cp_rank}
        ranks.update(dp=layout.dp_rank, ep=layout.ep_rank, etp=layout.etp_rank)
        return ranks[over]

    # ---------------------------------------------------------------- host signals beside an engine's NCCL work

    def host_groups(self, size: int) -> tuple[Any, Any]:
        """Two gloo groups for signals that must not queue behind (or between) an engine's NCCL work: the whole
        world's, and this rank's among the consecutive blocks of `size` ranks (an engine's rollout.tp ranks; None
        when size is 1). Collective: every rank builds every group, in the same order."""
        world = dist.new_group(list(range(self.world)), backend="gloo")
        mine = None
        for first in range(0, self.world, size) if size > 1 else ():
            group = dist.new_group(list(range(first, first + size)), backend="gloo")
            if first <= self.rank < first + size:
                mine = group
        return world, mine

    @staticmethod
    def arrive(group: Any) -> Any:
        """A barrier over `group` (host_groups' world) that does not block: a handle whose is_completed() turns
        true once every rank has arrived; wait() blocks until then."""
        return dist.all_reduce(torch.zeros(1), group=group, async_op=True)

    @staticmethod
    def broadcast_flag(flag: bool, group: Any) -> bool:
        """The flag of the first rank of `group` (host_groups' block) on every rank of it."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        with progress.waiting("the engine's first rank (a flag)"):
            dist.broadcast(t, group=group, group_src=0)
        return bool(t.item())
