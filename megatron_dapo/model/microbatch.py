"""Samples to micro-batches: packing under a token budget, the padded and packed (THD) row layouts, and context
parallel's split of the rows.

MegatronPolicy (policy.py) runs what this lays out. A MicroBatch's per-token tensors are [b, L] with b rows of
length L: one row per sequence, right-padded, or one packed row holding every sequence back to back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch


@dataclass
class TrainSample:
    """One prompt + response to score or train on."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    old_logp: Optional[torch.Tensor] = None
    """[len(response_ids)] float32: logprobs of the policy that sampled, recomputed by compute_logprobs."""
    rollout_logp: Optional[torch.Tensor] = None
    """[len(response_ids)] float32: the rollout engine's sampling logprobs (for the rollout correction)."""
    ref_logp: Optional[torch.Tensor] = None
    """[len(response_ids)] float32: the reference policy's logprobs (KL as a loss term), from compute_logprobs."""
    is_weight: Optional[torch.Tensor] = None
    """[len(response_ids)] float32: rollout-correction weights (algorithm.rollout_correction), set by train_step."""
    in_loss: bool = True
    """False masks the whole response out of the loss (overlong filtering)."""
    routes: Optional[torch.Tensor] = None
    """[len(prompt_ids) + len(response_ids) - 1, moe layers, top k] (model/routing.py route_dtype): the experts each
    position's token goes to in each MoE layer, replayed by the forward passes (model.router_replay); None: the
    trainer's routers pick."""


@dataclass
class MicroBatch:
    """Sequences laid out in rows; per-token tensors sit at the position that predicts the token.

    Padded layout: one row per sequence, right-padded. Packed (THD, Transformer Engine): one
    row holding every sequence back to back, with cumulative lengths in packed_seq_params.
    """

    spans: list[tuple[int, int, int, int]]
    """Per sample: (sample index, row, start, end): positions [start, end) of `row` predict its response."""
    tokens: torch.Tensor  # [b, L] long
    position_ids: torch.Tensor  # [b, L] long
    targets: torch.Tensor  # [b, L] long: the next token within the same sequence
    response_mask: torch.Tensor  # [b, L] bool: positions predicting a response token
    loss_mask: torch.Tensor  # [b, L] bool: response_mask and the sample is in the loss
    advantages: torch.Tensor  # [b, L] float32
    seq_index: torch.Tensor  # [b, L] long: the sequence's place in the micro-batch on its response positions, else -1
    token_mask: torch.Tensor  # [b, L] bool: a sequence's token (not row padding)
    old_logp: Optional[torch.Tensor] = None  # [b, L] float32
    ref_logp: Optional[torch.Tensor] = None  # [b, L] float32
    is_weight: Optional[torch.Tensor] = None  # [b, L] float32
    routes: Optional[torch.Tensor] = None
    """[b, L, moe layers, k] (route dtype): the samples' routes (TrainSample.routes) where they have one, placeholder
    experts elsewhere (model/routing.py); None when no sample carries routes."""
    route_mask: Optional[torch.Tensor] = None  # [b, L] bool: the positions with a sample's route
    packed_seq_params: Any = None
    """megatron.core PackedSeqParams (qkv_format 'thd') for the packed layout, else None."""


def pack_microbatches(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Group sequence indices into micro-batches whose size fits max_tokens.

    Size: count x longest (padded layout) or the sum of lengths (packed). First-fit in
    decreasing length order; a sequence longer than the budget gets a micro-batch of its own.
    Deterministic. lengths: tokens per sequence (prompt + response).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    used: list[int] = []  # tokens of each batch so far (packed) or its count (padded)
    for i in order:
        for b, batch in enumerate(batches):
            size = used[b] + lengths[i] if packed else (used[b] + 1) * lengths[batch[0]]
            if size <= max_tokens:
                batch.append(i)
                used[b] = used[b] + lengths[i] if packed else used[b] + 1
                break
        else:
            batches.append([i])
            used.append(lengths[i] if packed else 1)
    return batches


FP8_GEMM_TOKENS = 16
"""FP8 GEMMs (Transformer Engine) need each rank's token count divisible by this."""


def row_multiple(layout, fp8: bool) -> int:
    """What a micro-batch's row length is rounded up to (each padded row, or the THD pack): tp under sequence
    parallel (a rank holds length / tp positions), 2 cp under context parallel (two chunks a rank), and under FP8
    16 tokens for each rank's GEMMs after both splits: the product, since each split divides by its own factor."""
    multiple = layout.tp if layout.sequence_parallel else 1
    multiple *= 2 * layout.cp if layout.cp > 1 else 1
    return multiple * (FP8_GEMM_TOKENS if fp8 else 1)


def collate(
    samples: list[TrainSample], indices: list[int], device: torch.device, multiple: int = 1, packed: bool = False
) -> MicroBatch:
    """Lay out samples[indices]; row lengths are rounded up to `multiple` (row_multiple). The padding predicts no
    response token: it is out of every mask, so it carries no loss, no gradient and no count."""
    seqs = [samples[i] for i in indices]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in seqs]
    if packed:
        starts = [sum(lengths[:k]) for k in range(len(seqs))]
        rows, width = [0] * len(seqs), sum(lengths)
    else:
        starts, rows, width = [0] * len(seqs), list(range(len(seqs))), max(lengths)
    width = -(-width // multiple) * multiple
    b = 1 if packed else len(seqs)
    tokens = torch.zeros(b, width, dtype=torch.long)
    targets = torch.zeros(b, width, dtype=torch.long)
    position_ids = torch.zeros(b, width, dtype=torch.long)
    response_mask = torch.zeros(b, width, dtype=torch.bool)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    advantages = torch.zeros(b, width)
    seq_index = torch.full((b, width), -1, dtype=torch.long)
    old_logp = torch.zeros(b, width) if all(s.old_logp is not None for s in seqs) else None
    ref_logp = torch.zeros(b, width) if seqs and all(s.ref_logp is not None for s in seqs) else None
    is_weight = torch.zeros(b, width) if seqs and all(s.is_weight is not None for s in seqs) else None
    token_mask = torch.zeros(b, width, dtype=torch.bool)
    routes, route_mask = _empty_routes(seqs, b, width)
    spans = []
    for k, s in enumerate(seqs):
        row, st, p, r = rows[k], starts[k], len(s.prompt_ids), len(s.response_ids)
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        tokens[row, st : st + p + r] = ids
        targets[row, st : st + p + r - 1] = ids[1:]
        position_ids[row, st : st + p + r] = torch.arange(p + r)
        span = slice(st + p - 1, st + p + r - 1)  # position t predicts token t + 1
        response_mask[row, span] = True
        loss_mask[row, span] = s.in_loss
        advantages[row, span] = s.advantage
        seq_index[row, span] = k
        if old_logp is not None:
            old_logp[row, span] = s.old_logp.float()
        if ref_logp is not None:
            ref_logp[row, span] = s.ref_logp.float()
        if is_weight is not None:
            is_weight[row, span] = s.is_weight.float()
        token_mask[row, st : st + p + r] = True
        if routes is not None:  # position t's route is its own token's: the last token has none
            if s.routes.shape[0] != p + r - 1:
                raise ValueError(f"sample {indices[k]}: routes for {s.routes.shape[0]} positions, expected {p + r - 1}")
            routes[row, st : st + p + r - 1] = s.routes
            route_mask[row, st : st + p + r - 1] = True
        spans.append((indices[k], row, span.start, span.stop))
    to = partial(torch.Tensor.to, device=device)
    return MicroBatch(
        spans=spans,
        tokens=to(tokens),
        position_ids=to(position_ids),
        targets=to(targets),
        response_mask=to(response_mask),
        loss_mask=to(loss_mask),
        advantages=to(advantages),
        seq_index=to(seq_index),
        old_logp=None if old_logp is None else to(old_logp),
        ref_logp=None if ref_logp is None else to(ref_logp),
        is_weight=None if is_weight is None else to(is_weight),
        token_mask=to(token_mask),
        routes=routes,  # stays on the host: each router takes its layer's share (model/routing.py)
        route_mask=route_mask,
        packed_seq_params=thd_params(lengths, width, device) if packed else None,
    )


def _empty_routes(seqs: list[TrainSample], b: int, width: int):
    """(routes [b, width, layers, k] of placeholder experts, route_mask [b, width] all False) when the samples carry
    routes, (None, None) when none does; a mix is an error (a pass replays every sample's routes or none)."""
    have = [s.routes is not None for s in seqs]
    if not any(have):
        return None, None
    if not all(have):
        raise ValueError(f"routes on {sum(have)} of {len(seqs)} samples of a micro-batch: replay needs every one's")
    from megatron_dapo.model.routing import placeholder_routes

    _, layers, topk = seqs[0].routes.shape
    routes = placeholder_routes(b * width, layers, topk).to(seqs[0].routes.dtype).view(b, width, layers, topk)
    return routes, torch.zeros(b, width, dtype=torch.bool)


def thd_params(lengths: list[int], width: int, device: torch.device):
    """Cumulative sequence lengths for Transformer Engine's THD attention; row padding is one more segment."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    if width > bounds[-1]:
        bounds.append(width)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def cp_slice(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Context parallel's load-balanced split of [b, L] (L divisible by 2 cp): chunks rank and 2cp-1-rank.

    Causal attention makes late positions costlier, so each rank takes one early and one late
    chunk (Megatron-LM's get_batch_on_this_cp_rank). Returns [b, L / cp].
    """
    b, length = t.shape[:2]
    chunks = t.reshape(b, 2 * cp, length // (2 * cp), *t.shape[2:])
    return chunks[:, [rank, 2 * cp - 1 - rank]].reshape(b, length // cp, *t.shape[2:])


def cp_unslice(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of cp_slice: every rank's [b, L / cp] slice (in rank order) -> the full [b, L]."""
    cp = len(parts)
    b, local = parts[0].shape[:2]
    chunk = local // 2
    out = parts[0].new_empty(b, 2 * cp, chunk, *parts[0].shape[2:])
    for rank, part in enumerate(parts):
        halves = part.reshape(b, 2, chunk, *part.shape[2:])
        out[:, rank], out[:, 2 * cp - 1 - rank] = halves[:, 0], halves[:, 1]
    return out.reshape(b, 2 * cp * chunk, *parts[0].shape[2:])


def slice_for_cp(mb: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """This context-parallel rank's share of every per-position tensor (spans stay global)."""
    fields = (
        "tokens",
        "position_ids",
        "targets",
        "response_mask",
        "loss_mask",
        "advantages",
        "seq_index",
        "token_mask",
        "old_logp",
        "ref_logp",
        "is_weight",
        "routes",
        "route_mask",
    )
    sliced = {f: None if getattr(mb, f) is None else cp_slice(getattr(mb, f), cp, rank) for f in fields}
    return MicroBatch(spans=mb.spans, packed_seq_params=None, **sliced)
