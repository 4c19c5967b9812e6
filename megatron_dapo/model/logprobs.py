"""Token logprobs and entropy from vocab-parallel logits in one pass, never gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary, in the model's dtype (bf16 or
fp32). One chunked pass over this rank's rows reads every logit once and yields, per row, the local max, the sum of
exp(z - max) and (when the entropy is asked for) the sum of exp(z - max) * (z - max), with z = logits / temperature
(no division at temperature 1), each chunk upcast to float32 as it is read. Two all-reduces of [N]-vectors over the
TP group combine them (the max; then the rescaled sums with the target's logit, which only its owning rank holds):

    logsumexp = M + log S,   logp = z[y] - logsumexp,   entropy = log S - W / S

where M is the global max, S = sum exp(z - M) and W = sum exp(z - M) * (z - M) over the whole vocabulary. Columns
past the real vocabulary (padding for GEMM shapes, on the last ranks) are sliced off, never read.

Backward needs no communication: d logp / d logits = (onehot(y) - softmax(z)) / temperature, rebuilt chunk by chunk
from the logits (saved by reference, not copied) and the per-row logsumexp. What autograd keeps between forward and
backward is the logits tensor itself plus [N]-vectors; never an [N, V] float32 tensor. The entropy is a metric:
non-differentiable.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.model.comm import Comm

CHUNK_ELEMENTS = 1 << 26
"""Rows of at most this many logits (256 MiB as float32) are upcast and processed at a time, forward and backward:
each chunk costs two float32 temporaries of its size, whatever the micro-batch (a whole [4096, 151936] micro-batch
at once held 2.3 GiB per float32 temporary)."""


def _shifted(chunk: torch.Tensor, temperature: float, shift: torch.Tensor) -> torch.Tensor:
    """float32 chunk / temperature - shift[:, None]: [r, v] (any float dtype), [r] -> a fresh [r, v] float32 tensor,
    the only temporary (the chunk itself is never written)."""
    z = chunk.float()
    fresh = chunk.dtype != torch.float32  # .float() of a float32 tensor is the tensor itself
    if temperature != 1.0:
        z = z.div_(temperature) if fresh else z / temperature
        fresh = True
    return z.sub_(shift.unsqueeze(-1)) if fresh else z - shift.unsqueeze(-1)


class _VocabParallelLogprobs(torch.autograd.Function):
    """(logits [N, V/tp], targets [N]) -> (logp [N] float32, entropy [N] float32 or None); see the module."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, vocab_size: int, comm: Comm, with_entropy: bool):
        n, part = logits.shape
        rank = comm.layout.tp_rank
        valid = max(0, min(part, vocab_size - rank * part))  # this rank's real columns; the rest is padding
        top = torch.full((n,), float("-inf"), device=logits.device)  # local max of z per row
        total = torch.zeros(n, device=logits.device)  # sum exp(z - top)
        weighted = torch.zeros(n, device=logits.device) if with_entropy else None  # sum exp(z - top) * (z - top)
        if valid > 0:
            step = max(1, CHUNK_ELEMENTS // valid)
            start = 0
            for c in logits[:, :valid].split(step):
                rows = slice(start, start + c.shape[0])
                m = c.amax(dim=-1).float()  # max(c) / T is max(c / T) to the bit: division by T > 0 is monotone
                top[rows] = m / temperature if temperature != 1.0 else m
                e = _shifted(c, temperature, top[rows])  # <= 0, exactly 0 at the max: exp cannot overflow
                p = e.exp()
                total[rows] = p.sum(dim=-1)
                if weighted is not None:
                    weighted[rows] = e.mul_(p).sum(dim=-1)
                del e, p
                start += c.shape[0]
        local = targets - rank * part
        mine = (local >= 0) & (local < valid)
        target_z = torch.zeros(n, device=logits.device)
        if valid > 0:
            picked = logits.gather(-1, local.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1).float()
            picked = picked / temperature if temperature != 1.0 else picked
            target_z = torch.where(mine, picked, target_z)
        if comm.size("tp") > 1:
            top_all = comm.all_reduce(top.clone(), "tp", "max")
            scale = torch.exp(top - top_all)  # 0 on a rank without real columns (top = -inf)
            parts = [total * scale, target_z]
            if weighted is not None:  # sum exp(z - M)(z - M) = scale * (weighted + (top - M) * total)
                parts.append(torch.where(scale > 0, scale * (weighted + (top - top_all) * total), 0.0))
            sums = comm.all_reduce(torch.stack(parts), "tp")
            top, total, target_z = top_all, sums[0], sums[1]
            weighted = sums[2] if weighted is not None else None
        log_total = torch.log(total)
        lse = top + log_total
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rank, ctx.valid = temperature, rank, valid
        logp = target_z - lse
        if weighted is None:
            return logp, None
        entropy = log_total - weighted / total
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with torch.profiler.record_function("vocab"):  # the vocabulary path's range in a profile (preflight's)
            return _VocabParallelLogprobs._backward(ctx, grad_logp)

    @staticmethod
    def _backward(ctx, grad_logp):
        logits, targets, lse = ctx.saved_tensors
        temperature, rank, valid = ctx.temperature, ctx.rank, ctx.valid
        n, part = logits.shape
        grad = torch.empty_like(logits)
        grad[:, valid:].zero_()  # padded columns: no gradient
        if valid > 0:
            coef = grad_logp.float() / temperature  # d logp / d z = onehot - softmax; dz / dlogits = 1 / T
            local = targets - rank * part
            mine = (local >= 0) & (local < valid)
            index = local.clamp(0, valid - 1).unsqueeze(-1)
            step = max(1, CHUNK_ELEMENTS // valid)
            for start in range(0, n, step):
                rows = slice(start, min(start + step, n))
                g = _shifted(logits[rows, :valid], temperature, lse[rows]).exp_()  # softmax(z)
                g.mul_(-coef[rows].unsqueeze(-1))
                g.scatter_add_(-1, index[rows], torch.where(mine[rows], coef[rows], 0.0).unsqueeze(-1))
                grad[rows, :valid] = g
                del g
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    comm: Optional[Comm] = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token logprobs (and entropies) of softmax(logits / temperature) over the full vocabulary.

    logits: [..., V/tp] (bf16 or fp32; this rank's columns rank * V/tp ... of the padded vocabulary), targets:
    [...] global token ids (< vocab_size) -> (logp [...] float32, differentiable in logits; entropy [...] float32,
    not differentiable, or None unless with_entropy). vocab_size: the real vocabulary (columns at or past it are
    padding, ignored). comm: this rank's collectives, whose tensor-parallel group holds the vocabulary's slices (None:
    a lone process, the whole vocabulary here). Every rank of the group must call with the same rows.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # a view of the contiguous logits a model returns
    with torch.profiler.record_function("vocab"):
        logp, entropy = _VocabParallelLogprobs.apply(
            flat, targets.reshape(-1), float(temperature), vocab_size, comm or Comm(), with_entropy
        )
    return logp.view(lead), entropy.view(lead) if entropy is not None else None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    comm: Comm,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """vocab_parallel_logprobs on this rank's tensor-parallel group: logits [B, T, V/tp], targets [B, T] ->
    (logp [B, T] float32, entropy [B, T] float32 or None unless with_entropy)."""
    return vocab_parallel_logprobs(logits, targets, temperature, vocab_size, comm, with_entropy)
