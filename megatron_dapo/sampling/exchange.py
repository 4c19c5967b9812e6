"""Moving rollout data between ranks: group summaries to every rank, token payloads only where they are trained.

Every rank runs the same sampling scheduler, so every rank needs each finished group's summary
(GroupMeta: per response its length, correctness, score, shaped reward, truncation; a few
numbers per response), gathered each tick as one float64 tensor. A response's tokens and
logprobs stay on the rank of the engine that generated it until the step's batch is known; then
each goes, as int32 / float32 tensors (point to point), only to the ranks of the data-parallel
replica that trains it. The collectives are model/comm.py's Comm; a lone process's moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dapo.model.comm import Comm
from megatron_dapo.sampling.records import GroupMeta, Stopped
from megatron_dapo.types import Response

SampleId = tuple[int, int]
"""(group key, sample index within the group)."""


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
    sends, recvs, incoming = [], [], []
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
            sends += [(peer, t.to(comm.device)) for t in payload]
        if inc:
            n = sum(by_key[k].lengths[j] for k, j in inc)
            bufs = [torch.empty(n, dtype=torch.int32, device=comm.device)]
            bufs.append(torch.empty(n, dtype=torch.float32, device=comm.device))
            if routes is not None:
                rows = sum(routes.rows(sid) for sid in inc)
                bufs.append(torch.empty(rows, routes.layers, routes.topk, dtype=routes.dtype, device=comm.device))
            incoming.append((inc, bufs))
            recvs += [(peer, b) for b in bufs]
    comm.send_recv(sends, recvs, "responses moving to where they train")
    sent = sum(t.numel() * t.element_size() for _, t in sends)
    for inc, bufs in incoming:
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
