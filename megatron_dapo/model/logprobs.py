"""Token logprobs and entropy from vocab-parallel logits, never gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. The
log-softmax needs only three all-reduces over the TP group: the max, the sum of exps, and
the target's logit (held by one rank). Columns past the real vocabulary (padding for GEMM
shapes) are excluded. Logits are divided by the rollout temperature first, so the logprobs
are those of the distribution the responses were sampled from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp(layout):
    """(the tensor-parallel group or None alone, this rank's place in it, its size): ranks from the Layout."""
    if layout.tp == 1:
        return None, 0, 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), layout.tp_rank, layout.tp


def _scaled(logits: torch.Tensor, temperature: float, vocab_size: int, rank: int) -> torch.Tensor:
    """fp32 logits / temperature with padded-vocabulary columns at -inf."""
    z = logits.float() / temperature
    part = z.shape[-1]
    start = rank * part
    if start + part > vocab_size:
        col = torch.arange(start, start + part, device=z.device)
        z = z.masked_fill(col >= vocab_size, float("-inf"))
    return z


class _VocabParallelLogprob(torch.autograd.Function):
    """logp[t] = z[t, y_t] - logsumexp(z[t]) over the full vocabulary, z sharded on the last dim."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, targets: torch.Tensor, group, rank: int):
        part = z.shape[-1]
        z_max = z.max(dim=-1).values
        if group is not None:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        exp = (z - z_max.unsqueeze(-1)).exp_()  # in place: one [T, V] temporary fewer
        sum_exp = exp.sum(dim=-1)
        local = targets - rank * part
        mine = (local >= 0) & (local < part)
        target_z = torch.gather(z, -1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        target_z = torch.where(mine, target_z, torch.zeros_like(target_z))
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target_z, group=group)
        logp = target_z - z_max - torch.log(sum_exp)
        ctx.save_for_backward(exp, sum_exp, local, mine)
        return logp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, sum_exp, local, mine = ctx.saved_tensors
        # d logp / d z = onehot(y) - softmax(z), on this rank's columns. Built in place in the saved exp: it is
        # [T, V/tp] float32 (2.3 GiB for 4096 tokens of Qwen2.5's vocabulary) and this backward is its last use.
        g = exp.div_(sum_exp.unsqueeze(-1)).mul_(-grad.unsqueeze(-1))
        g.scatter_add_(-1, local.clamp(0, g.shape[-1] - 1).unsqueeze(-1), (grad * mine).unsqueeze(-1))
        return g, None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, layout
) -> torch.Tensor:
    """logits: [B, T, V/tp] (any float dtype), targets: [B, T] global token ids -> logp [B, T] float32, differentiable.
    layout: this rank's model.parallel.Layout (its tensor-parallel rank and size)."""
    group, rank, _ = _tp(layout)
    z = _scaled(logits, temperature, vocab_size, rank)
    return _VocabParallelLogprob.apply(z, targets, group, rank)


ENTROPY_CHUNK_ELEMENTS = 1 << 26
"""token_entropy works on rows of at most this many logits (256 MiB in float32) at a time: a whole micro-batch at
once held five [T, V] float32 temporaries (about 12 GiB for 4096 tokens of Qwen2.5's vocabulary)."""


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float, vocab_size: int, layout) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [B, T, V/tp] -> [B, T] float32 (a metric, no grad).
    layout: this rank's model.parallel.Layout."""
    group, rank, size = _tp(layout)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    chunks = flat.split(max(1, ENTROPY_CHUNK_ELEMENTS // max(1, flat.shape[-1])))
    z_max = torch.cat([_scaled(c, temperature, vocab_size, rank).max(dim=-1).values for c in chunks])
    if size > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp, weighted = torch.empty_like(z_max), torch.empty_like(z_max)
    start = 0
    for c in chunks:
        rows = slice(start, start + c.shape[0])
        shifted = _scaled(c, temperature, vocab_size, rank).sub_(z_max[rows].unsqueeze(-1))
        exp = shifted.exp()
        sum_exp[rows] = exp.sum(dim=-1)
        # sum p * shifted; padded columns have exp = 0, so 0 * -inf must not become NaN
        weighted[rows] = exp.mul_(shifted.masked_fill_(exp == 0, 0.0)).sum(dim=-1)
        start += c.shape[0]
    if size > 1:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(weighted, group=group)
    return (torch.log(sum_exp) - weighted / sum_exp).view(logits.shape[:-1])
