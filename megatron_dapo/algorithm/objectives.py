"""The objectives (algorithm.policy_loss): each one's loss per response token, before masking and aggregation.

With r_t = pi(y_t) / pi_old(y_t) = exp(logp_t - old_logp_t) (its log clamped to +-log_ratio_clamp) and the
response's advantage A:

    dapo        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)                  (DAPO eq. 8)
                l_t = min(l_t, -c A) for A < 0 with dual clip c
    gspo        s = exp(mean over the response's valid tokens of log r_t)                  (GSPO eq. 7)
                l_t = -min(s A, clip(s, 1 - gspo_eps_low, 1 + gspo_eps_high) A) on every token of the response
    gspo_token  s_t = sg(s) x pi(y_t) / sg(pi(y_t)): the value of s, the gradient of one token  (GSPO eq. 13)
                l_t = -min(s_t A_t, clip(s_t, ...) A_t)
    cispo       l_t = -sg(clip(r_t, 1 - eps_low_is, 1 + eps_high_is)) A logp_t             (MiniMax-M1 eq. 4)

sg is the stop-gradient. Under seq-mean-token-mean a response's tokens average to its own l: GSPO's per-sequence
loss exactly, and with a per-response A gspo and gspo_token have the same value and gradient (they part only with
per-token advantages). CISPO keeps every token's gradient, each weighted by the clipped ratio; its loss value is
not a surrogate of the return (only its gradient is used). Each takes a TokenLossInput (registry.py) and returns
(loss [B, T] float32, flags) where flags holds ratio [B, T] (r_t; s for gspo, broadcast to its tokens) and
clip_low / clip_high / clip_dual [B, T] bool: the tokens where the clip or cap is active (gspo: every token of a
clipped response). Each registers itself (registry.objective) with the config keys of its bounds; torch is
imported inside the functions so that the config reads the registry without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_dapo.algorithm.registry import Flags, TokenLossInput, objective

if TYPE_CHECKING:
    import torch


def sequence_index(mask: torch.Tensor, seq_index: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T] long: which response each position belongs to (seq_index as given, packed rows holding several);
    None means one response a row (its row number)."""
    import torch

    if seq_index is not None:
        if seq_index.shape != mask.shape:
            raise ValueError(f"seq_index {tuple(seq_index.shape)} must match mask {tuple(mask.shape)}")
        return seq_index.long()
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)


def sequence_sum(x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """[B, T]: at each valid position, the sum of x over the valid positions of its response (0 elsewhere).
    Differentiable in x. x: [B, T] float32; mask: [B, T] bool; seq_index: [B, T] long (sequence_index)."""
    import torch

    idx = torch.where(mask, seq_index, 0)
    count = int(idx.max()) + 1 if idx.numel() else 1
    sums = torch.zeros(count, dtype=x.dtype, device=x.device).index_add(0, idx[mask], x[mask])
    return torch.where(mask, sums[idx], torch.zeros((), dtype=x.dtype, device=x.device))


@objective("dapo", low="eps_low", high="eps_high", dual_clip=True, fused=True)
def dapo_loss(x: TokenLossInput) -> tuple[torch.Tensor, Flags]:
    """DAPO's decoupled clip per token, capped at -c A for A < 0 with dual clip c."""
    import torch

    adv, dual_clip_c = x.adv, x.dual_clip_c
    loss, flags = _clipped(torch.exp(x.log_ratio), adv, x.eps_low, x.eps_high)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c  # > 0 where A < 0
        flags["clip_dual"] = (adv < 0) & (loss.detach() > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return loss, flags


@objective("gspo", low="gspo_eps_low", high="gspo_eps_high", whole_responses=True)
def gspo_loss(x: TokenLossInput, token_level: bool = False) -> tuple[torch.Tensor, Flags]:
    """GSPO (token_level False) or GSPO-token: the sequence's ratio s, the geometric mean of its token ratios."""
    import torch

    log_ratio, mask, seq_index = x.log_ratio, x.mask, x.seq_index
    tokens = sequence_sum(mask.float(), mask, seq_index).clamp(min=1.0)
    log_s = sequence_sum(log_ratio, mask, seq_index) / tokens  # a mean, not a sum: s stays near 1 at any length
    if token_level:  # the value of log s, the gradient of this token's log-likelihood alone
        log_s = log_s.detach() + log_ratio - log_ratio.detach()
    return _clipped(torch.exp(log_s), x.adv, x.eps_low, x.eps_high)


@objective("gspo_token", low="gspo_eps_low", high="gspo_eps_high", whole_responses=True)
def gspo_token_loss(x: TokenLossInput) -> tuple[torch.Tensor, Flags]:
    """GSPO-token: gspo_loss's value, each token's own gradient."""
    return gspo_loss(x, token_level=True)


@objective("cispo", low="eps_low_is", high="eps_high_is", low_optional=True)
def cispo_loss(x: TokenLossInput) -> tuple[torch.Tensor, Flags]:
    """CISPO: the importance weight clipped and detached, every token's log-likelihood (x.logp) kept in the
    gradient. Its bounds are eps_low_is (None: no lower bound, the paper's setting) and eps_high_is."""
    import torch

    log_ratio, eps_low_is, eps_high_is = x.log_ratio, x.eps_low, x.eps_high
    ratio = torch.exp(log_ratio).detach()
    low = 0.0 if eps_low_is is None else 1.0 - eps_low_is
    weight = ratio.clamp(min=low, max=1.0 + eps_high_is)  # detached: a weight, not a path for the gradient
    flags = {"ratio": ratio, "clip_low": ratio < low, "clip_high": ratio > 1.0 + eps_high_is}
    return -weight * x.adv * x.logp, flags


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, Flags]:
    """-min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) and where the clip is the min's active branch (it
    zeroes the gradient there). ratio, adv: [B, T] float32."""
    import torch

    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    r = ratio.detach()
    flags = {
        "ratio": r,
        "clip_low": (adv < 0) & (r < 1.0 - eps_low),
        "clip_high": (adv > 0) & (r > 1.0 + eps_high),
    }
    return loss, flags
