"""Moving rollout data between ranks: group summaries to every rank, token payloads only where they are trained.

Every rank runs the same sampling scheduler, so every rank needs each finished group's summary
(GroupMeta: per response its length, correctness, score, shaped reward, truncation; a few
numbers per response), gathered each tick as one float64 tensor. A response's tokens and
logprobs stay on the rank of the engine that generated it until the step's batch is known; then
each goes, as int32 / float32 tensors (point to point), only to the ranks of the data-parallel
replica that trains it. Without torch.distributed (one process) nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo import progress
from megatron_dapo.model import collectives
from megatron_dapo.sampling.records import GroupMeta, Stopped
from megatron_dapo.types import Response

SampleId = tuple[int, int]
"""(group key, sample index within the group)."""


class Comm:
    """The collectives the sampler uses, over torch.distributed's world (or a single process without one).

    rank, world: this process's place in the world (the trainer's Layout; the default is a lone process).
    device: where collective tensors live (CUDA for NCCL, CPU for gloo).
    """

    def __init__(self, rank: int = 0, world: int = 1, device: Optional[torch.device] = None) -> None:
        self.rank, self.world = rank, world
        self.device = device or torch.device("cpu")
        self.bytes_gathered = 0
        """Bytes this rank received through all_gather_rows so far (the summaries' traffic)."""

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [r, w] float64 on this rank -> [sum of r over ranks, max of w], in rank order; a narrower rank's
        rows are padded with zero columns (one gather of the shapes, one of the rows)."""
        if self.world == 1:
            return rows
        with progress.waiting("the other ranks (their group summaries)"):
            return self._all_gather_rows(rows)

    def _all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
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
        dist.all_gather(parts, padded.contiguous())  # gloo sends a non-contiguous tensor wrong, silently
        self.bytes_gathered += most * width * 8 * (self.world - 1)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).cpu()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1:
            with progress.waiting("the other ranks (a sum)"):
                dist.all_reduce(t)
        return t.cpu().tolist()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """obj from rank src (ignored elsewhere) on every rank (model/collectives.py: read by the restricted
        unpickler)."""
        if self.world == 1:
            return obj
        with progress.waiting("the other ranks (an object broadcast)"):
            return collectives.broadcast_object(obj, src, what=f"an object broadcast by rank {src}")

    def gather_objects(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        """Every rank's obj, in rank order, on rank dst; None elsewhere (read by the restricted unpickler)."""
        if self.world == 1:
            return [obj]
        with progress.waiting("the other ranks (an object gather)"):
            return collectives.gather_objects(obj, dst, what=f"an object gathered on rank {dst}")

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

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise max over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1:
            with progress.waiting("the other ranks (a max)"):
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()


# ------------------------------------------------------------------ group summaries as tensor rows

_HEAD = (
    "key",
    "index",
    "engine",
    "version",
    "informative",
    "reward_timeouts",
    "reward_errors",
    "finished_in",
    "fresh_tokens",
    "versions",
)
_PER_SAMPLE = ("lengths", "acc", "scores", "rewards", "truncated")


def meta_width(group_size: int, versions: int) -> int:
    """Columns of one GroupMeta row: the head, 5 per sample, tokens per policy version (`versions` columns: the most
    versions a group of the gathered ones spans; admission bounds when a group starts, not how many versions it
    spans, so the width follows the data)."""
    return len(_HEAD) + len(_PER_SAMPLE) * group_size + versions


def metas_to_rows(metas: list[GroupMeta], group_size: int) -> torch.Tensor:
    """[len(metas), meta_width] float64 (integers and flags exact: they are far below 2**53)."""
    versions = max((len(g.version_tokens) for g in metas), default=1)
    rows = torch.zeros((len(metas), meta_width(group_size, versions)), dtype=torch.float64)
    for i, g in enumerate(metas):
        head = [g.key, g.index, g.engine, g.version, g.informative, g.reward_timeouts, g.reward_errors]
        head += [-1 if x is None else x for x in (g.finished_in, g.fresh_tokens)]  # -1: None (counts are >= 0)
        row = head + [len(g.version_tokens)]
        for name in _PER_SAMPLE:
            row += [float(x) for x in getattr(g, name)]
        row += g.version_tokens
        rows[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return rows


def rows_to_metas(rows: torch.Tensor, group_size: int) -> list[GroupMeta]:
    out = []
    for r in rows.tolist():
        key, index, engine, version, informative, timeouts, errors, step, fresh, nv = (int(x) for x in r[: len(_HEAD)])
        cols = {}
        at = len(_HEAD)
        for name in _PER_SAMPLE:
            cols[name] = r[at : at + group_size]
            at += group_size
        out.append(
            GroupMeta(
                key=key,
                index=index,
                engine=engine,
                version=version,
                lengths=[int(x) for x in cols["lengths"]],
                acc=[bool(x) for x in cols["acc"]],
                scores=cols["scores"],
                rewards=cols["rewards"],
                truncated=[bool(x) for x in cols["truncated"]],
                informative=bool(informative),
                version_tokens=[int(x) for x in r[at : at + nv]],
                reward_timeouts=timeouts,
                reward_errors=errors,
                finished_in=None if step < 0 else step,
                fresh_tokens=None if fresh < 0 else fresh,
            )
        )
    return out


def gather_metas(comm: Comm, metas: list[GroupMeta], group_size: int) -> list[GroupMeta]:
    """Every rank's finished groups, on every rank (sorted by key: the scheduler's order)."""
    rows = comm.all_gather_rows(metas_to_rows(metas, group_size))
    return sorted(rows_to_metas(rows, group_size), key=lambda g: g.key)


def gather_stopped(comm: Comm, stopped: dict[int, Stopped]) -> dict[int, Stopped]:
    """Every rank's stopped groups (key -> what its engine had), on every rank."""
    rows = torch.tensor(
        [
            [k, s.tokens, s.tokens_now, -1 if s.first_version is None else s.first_version]
            for k, s in sorted(stopped.items())
        ],
        dtype=torch.float64,
    ).reshape(-1, 4)
    out = {}
    for k, tokens, now, first in comm.all_gather_rows(rows).tolist():
        out[int(k)] = Stopped(int(tokens), int(now), None if first < 0 else int(first))
    return out


# ------------------------------------------------------------------ training payloads


@dataclass(frozen=True)
class RouteShape:
    """What a receiver needs to rebuild the responses' routes (Response.routes, routing replay R3): rows(sid), the
    positions of response sid (its prompt's tokens + its own - 1); the MoE layers, the top k and the dtype of each."""

    rows: Callable[[SampleId], int]
    layers: int
    topk: int
    dtype: torch.dtype


def deliver(
    comm: Comm,
    batch: list[GroupMeta],
    local: dict[int, list[Response]],
    owner_rank: Callable[[GroupMeta], int],
    wanted_by: Callable[[int], list[SampleId]],
    routes: Optional[RouteShape] = None,
) -> tuple[dict[SampleId, Response], int]:
    """Send each trained response to the ranks that train it; return this rank's (and the bytes it sent).

    batch: the step's groups (every rank has the same list). local: this rank's responses of the
    groups it owns, by key. owner_rank(meta): the rank holding a group's responses. wanted_by(rank):
    the samples that rank trains (every rank computes every rank's list, so senders and receivers
    agree without asking). routes: the responses carry routes of this shape, sent too. Returns
    {(key, j): Response with token_ids, logprobs (and routes)} for wanted_by(rank).
    """
    by_key = {g.key: g for g in batch}
    me = comm.rank
    mine: dict[SampleId, Response] = {}
    for sid in wanted_by(me):
        if owner_rank(by_key[sid[0]]) == me:
            mine[sid] = local[sid[0]][sid[1]]
    if comm.world == 1:
        return mine, 0
    sends, recvs, handles = [], [], []
    for peer in range(comm.world):
        if peer == me:
            continue
        out = [sid for sid in wanted_by(peer) if owner_rank(by_key[sid[0]]) == me]
        inc = [sid for sid in wanted_by(me) if owner_rank(by_key[sid[0]]) == peer]
        if out:
            responses = [local[k][j] for k, j in out]
            tokens = torch.tensor([t for r in responses for t in r.token_ids], dtype=torch.int32)
            logps = torch.tensor(
                [x for r in responses for x in (r.logprobs or [float("nan")] * len(r.token_ids))], dtype=torch.float32
            )
            payload = [tokens, logps]
            if routes is not None:
                payload.append(_routes_payload(out, responses, routes))
            sends.append((peer, [t.to(comm.device) for t in payload]))
        if inc:
            n = sum(by_key[k].lengths[j] for k, j in inc)
            bufs = [torch.empty(n, dtype=torch.int32, device=comm.device)]
            bufs.append(torch.empty(n, dtype=torch.float32, device=comm.device))
            if routes is not None:
                rows = sum(routes.rows(sid) for sid in inc)
                bufs.append(torch.empty(rows, routes.layers, routes.topk, dtype=routes.dtype, device=comm.device))
            recvs.append((inc, bufs))
            handles += [dist.irecv(b, peer) for b in bufs]
    sent = 0
    for peer, payload in sends:
        handles += [dist.isend(t, peer) for t in payload]
        sent += sum(t.numel() * t.element_size() for t in payload)
    with progress.waiting("the other ranks (responses moving to where they train)"):
        for h in handles:
            h.wait()
    for inc, bufs in recvs:
        tokens, logps, at, row = bufs[0].cpu().tolist(), bufs[1].cpu(), 0, 0
        all_routes = bufs[2].cpu() if routes is not None else None
        for k, j in inc:
            n = by_key[k].lengths[j]
            lp = logps[at : at + n]
            mine[(k, j)] = Response(
                token_ids=tokens[at : at + n],
                text="",  # the verifier read it on the engine's rank; training needs only the ids
                logprobs=None if n and torch.isnan(lp).all() else lp.tolist(),
                truncated=by_key[k].truncated[j],
            )
            if all_routes is not None:
                rows = routes.rows((k, j))
                mine[(k, j)].routes = all_routes[row : row + rows].clone()
                row += rows
            at += n
    return mine, sent


def _routes_payload(sids: list[SampleId], responses: list[Response], shape: RouteShape) -> torch.Tensor:
    """The responses' routes end to end, [sum of rows, layers, k]; a response without its routes is an error here,
    on the rank that generated it."""
    parts = []
    for sid, r in zip(sids, responses):
        if r.routes is None or tuple(r.routes.shape) != (shape.rows(sid), shape.layers, shape.topk):
            got = None if r.routes is None else tuple(r.routes.shape)
            raise RuntimeError(
                f"routing replay: response {sid} has routes of shape {got}, expected "
                f"{(shape.rows(sid), shape.layers, shape.topk)}"
            )
        parts.append(r.routes.to(shape.dtype))
    return torch.cat(parts) if parts else torch.zeros(0, shape.layers, shape.topk, dtype=shape.dtype)
