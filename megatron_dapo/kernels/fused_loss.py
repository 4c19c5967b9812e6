"""The fused DAPO policy loss, host side: input checks and flattening, the launch, the autograd Function and
fused_policy_loss. The math and the Triton kernels are ratio_clip_reduce.py's (its docstring gives the design)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

import megatron_dapo.kernels.ratio_clip_reduce as rcr
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.kernels.ratio_clip_reduce import (
    GPU_BLOCK,
    GPU_NUM_WARPS,
    INTERPRET_BLOCK,
    KL_ESTIMATOR_IDS,
    NUM_ROWS,
    NUM_STATS,
    REDUCE_BLOCK,
    REDUCE_NUM_WARPS,
    _kernels,
    interpreter_enabled,
)
from megatron_dapo.loss_result import STAT_KEYS, PolicyLoss

__all__ = ["fused_policy_loss"]


@dataclass(frozen=True)
class _Params:
    """Scalars and launch configuration of one call (not tensors: they go through autograd)."""

    lo: float
    hi: float
    dual_c: Optional[float]
    lr_clamp: float
    kl_coef: float
    kl_est: int  # 0: no KL term, else KL_ESTIMATOR_IDS
    seq_len: int
    adv_per_token: bool
    block: int
    num_warps: int


def _check_block(block: int) -> int:
    if block < 16 or block & (block - 1):
        raise ValueError(f"fused_policy_loss: block={block} must be a power of two >= 16")
    return block


def _flatten_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weight: Optional[torch.Tensor],
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]:
    """Validate [B, T] inputs and flatten them to contiguous [N] (views when already contiguous).

    Returns (logp [N], old_logp [N], advantages [B] or [N], mask [N] uint8, is_weight [N] | None,
    adv_per_token). logp stays differentiable through reshape/contiguous (_flat_constant flattens the KL
    term's inputs).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"fused_policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be the same [B, T]"
        )
    if not logp.is_floating_point():
        raise TypeError(f"fused_policy_loss: logp must be floating point, got {logp.dtype}")
    others = [old_logp, advantages, mask] + ([is_weight] if is_weight is not None else [])
    if any(x.device != logp.device for x in others):
        raise ValueError(f"fused_policy_loss: all inputs must be on logp's device {logp.device}")
    b, t = logp.shape
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages.reshape(-1)
    if advantages.dim() == 1 and t + block >= 2**24:  # beyond the kernel's fp32 row-index trick
        advantages = advantages[:, None]
    if advantages.dim() == 1:
        if advantages.shape[0] != b:
            raise ValueError(f"fused_policy_loss: advantages {tuple(advantages.shape)} must be [B]={b} or [B, T]")
        adv, per_token = advantages.detach().contiguous(), False
    else:  # [B, T] (or anything that broadcasts to it)
        adv, per_token = advantages.detach().expand(b, t).contiguous().reshape(-1), True
    # bool is stored as one byte per element: reinterpret it rather than convert it
    mask_u8 = (mask if mask.dtype == torch.bool else mask != 0).contiguous().reshape(-1).view(torch.uint8)
    isw = None if is_weight is None else is_weight.detach().expand(b, t).contiguous().reshape(-1)
    return logp.contiguous().reshape(-1), old_logp.detach().contiguous().reshape(-1), adv, mask_u8, isw, per_token


def _flat_constant(x: Optional[torch.Tensor], logp: torch.Tensor, what: str) -> Optional[torch.Tensor]:
    """A [B, T] constant input (ref_logp, the KL weight) as a detached contiguous [N], or None."""
    if x is None:
        return None
    if x.device != logp.device:
        raise ValueError(f"fused_policy_loss: {what} must be on logp's device {logp.device}")
    if x.dim() != 2 or x.shape[0] != logp.shape[0] or x.shape[1] not in (1, logp.shape[1]):
        raise ValueError(f"fused_policy_loss: {what} {tuple(x.shape)} must be [B, T] like logp {tuple(logp.shape)}")
    return x.detach().expand(logp.shape).contiguous().reshape(-1)


def _compute_dtype(logp: torch.Tensor) -> torch.dtype:
    return torch.float64 if logp.dtype == torch.float64 else torch.float32


def _launch(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    isw: Optional[torch.Tensor],
    ref: Optional[torch.Tensor],
    klw: Optional[torch.Tensor],
    p: _Params,
    scale: Optional[torch.Tensor],
    write_stats: bool,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Run the token kernel (and the finalize kernel when write_stats).

    All tensors flat [N] ([B] per-response advantages); ref (reference logprobs) is read when p.kl_est. scale: [] gradient factor, or None for
    no gradient. Returns (loss [] compute dtype | None, stats [NUM_STATS] fp32 | None, grad [N] | None).
    """
    kernel, finalize = _kernels()
    n = logp.numel()
    n_blocks = max(1, -(-n // p.block))  # ceil
    cdt = _compute_dtype(logp)
    write_grad = scale is not None
    grad = torch.empty_like(logp) if write_grad else None
    part = torch.empty((NUM_ROWS, n_blocks), dtype=torch.float64, device=logp.device) if write_stats else None
    kernel[(n_blocks,)](
        logp,
        old_logp,
        adv,
        mask,
        isw if isw is not None else logp,  # placeholders are never dereferenced (constexpr-off)
        ref if ref is not None else logp,
        klw if klw is not None else logp,
        scale if write_grad else logp,
        grad if write_grad else logp,
        part if write_stats else logp,
        n,
        p.seq_len,
        1.0 / p.seq_len,
        n_blocks,
        p.lo,
        p.hi,
        p.dual_c if p.dual_c is not None else 0.0,
        p.lr_clamp,
        p.kl_coef,
        CDT=rcr.tl.float64 if cdt == torch.float64 else rcr.tl.float32,
        ADV_PER_TOKEN=p.adv_per_token,
        HAS_ISW=isw is not None,
        HAS_DUAL=p.dual_c is not None,
        KL_EST=p.kl_est,
        HAS_KLW=klw is not None,
        WRITE_STATS=write_stats,
        WRITE_GRAD=write_grad,
        GRAD_BF16=logp.dtype == torch.bfloat16,
        SKIP_PADDING=rcr.SKIP_PADDING_LOADS,  # read per call: tools/bench_kernel.py times both
        RANGE_REDUCE_EXP=cdt == torch.float32,
        IDX64=n + p.block >= 2**31,
        BLOCK=p.block,
        num_warps=p.num_warps,
    )
    if not write_stats:
        return None, None, grad
    loss = torch.empty((), dtype=cdt, device=logp.device)
    stats = torch.empty((NUM_STATS,), dtype=torch.float32, device=logp.device)
    finalize[(NUM_ROWS,)](part, loss, stats, n_blocks, RBLOCK=REDUCE_BLOCK, num_warps=REDUCE_NUM_WARPS)
    return loss, stats, grad


class _FusedPolicyLoss(torch.autograd.Function):
    """(logp [N], ...) -> (loss_sum [], stats [NUM_STATS] fp32, non-differentiable).

    With `scale` (= 1/normaliser, []) the forward also writes the scaled gradient and backward
    rescales it; without, backward recomputes the gradient from the saved inputs.
    """

    @staticmethod
    def forward(ctx, logp, old_logp, adv, mask, isw, ref, klw, scale, p: _Params):
        fuse = scale is not None and ctx.needs_input_grad[0]
        loss, stats, grad = _launch(
            logp, old_logp, adv, mask, isw, ref, klw, p, scale if fuse else None, write_stats=True
        )
        ctx.p, ctx.fused = p, fuse
        if fuse:
            ctx.save_for_backward(grad, scale)
        else:
            ctx.save_for_backward(logp, old_logp, adv, mask, isw, ref, klw)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_stats):
        if ctx.fused:
            grad, scale = ctx.saved_tensors
            # saved = g / n; grad_loss is 1/n when the caller takes the token-mean: factor exactly 1
            grad_logp = grad * (grad_loss.to(scale.dtype) / scale)
        else:
            logp, old_logp, adv, mask, isw, ref, klw = ctx.saved_tensors
            go = grad_loss.to(_compute_dtype(logp)).contiguous()
            _, _, grad_logp = _launch(logp, old_logp, adv, mask, isw, ref, klw, ctx.p, go, write_stats=False)
        return grad_logp, None, None, None, None, None, None, None, None


def _grad_scale(normalizer: Union[float, torch.Tensor], logp: torch.Tensor) -> torch.Tensor:
    """1 / max(normalizer, 1) as a [] tensor on logp's device, in the compute dtype."""
    cdt = _compute_dtype(logp)
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"fused_policy_loss: normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        n = normalizer.detach().reshape(()).to(device=logp.device, dtype=cdt)
    else:
        n = torch.full((), float(normalizer), dtype=cdt, device=logp.device)
    # reciprocal on the device rounds like autograd's grad of `loss_sum / n` does
    return n.clamp(min=1.0).reciprocal()


def fused_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = AlgorithmConfig.eps_low,
    eps_high: float = AlgorithmConfig.eps_high,
    dual_clip_c: Optional[float] = AlgorithmConfig.dual_clip_c,
    is_weight: Optional[torch.Tensor] = None,
    log_ratio_clamp: float = AlgorithmConfig.log_ratio_clamp,
    normalizer: Optional[Union[float, torch.Tensor]] = None,
    ref_logp: Optional[torch.Tensor] = None,
    kl_coef: float = AlgorithmConfig.kl_coef,
    kl_estimator: str = AlgorithmConfig.kl_estimator,
    kl_weight: Optional[torch.Tensor] = None,
    *,
    block: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> PolicyLoss:
    """policy_loss(..., loss_agg_mode='token-mean') in one Triton pass (plus a tiny finalize).

    logp:       [B, T] float32|bfloat16 (float16, float64 too), differentiable
    old_logp:   [B, T] any float, constant
    advantages: [B] per response (read as A[token // T], never expanded) or [B, T] per token
    mask:       [B, T] bool (zero-copy) or 0/1 of any dtype
    is_weight:  [B, T] optional truncated-IS weights, constant
    normalizer: the mini-batch's global valid-token count (float or [] tensor): fuses the
                gradient into the forward pass. Loss, stats and gradient are the same without it.
    ref_logp:   [B, T] optional reference logprobs, constant: adds kl_coef x k (kl_estimator) per token
    kl_weight:  [B, T] optional per-token weight of the KL term alone (not is_weight's truncated IS)
    block, num_warps: launch configuration (defaults: 4096 / 8 on GPU, 131072 in the interpreter).
    Returns PolicyLoss(loss_sum [] float32 (float64 for float64 logp), normalizer [] float32,
    stats STAT_KEYS -> [] float32).
    """
    if not logp.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            "fused_policy_loss: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set before "
            "the first call); on CPU use algorithm.loss_impl='reference' or 'auto'"
        )
    block = _check_block(block or (INTERPRET_BLOCK if interpreter_enabled() else GPU_BLOCK))
    logp_f, old_f, adv_f, mask_f, isw_f, per_token = _flatten_inputs(logp, old_logp, advantages, mask, is_weight, block)
    if ref_logp is not None and kl_estimator not in KL_ESTIMATOR_IDS:
        raise ValueError(f"fused_policy_loss: kl_estimator={kl_estimator!r}, expected one of {tuple(KL_ESTIMATOR_IDS)}")
    ref_f = _flat_constant(ref_logp, logp, "ref_logp")
    klw_f = _flat_constant(kl_weight, logp, "kl_weight") if ref_f is not None else None
    p = _Params(
        lo=1.0 - eps_low,
        hi=1.0 + eps_high,
        dual_c=None if dual_clip_c is None else float(dual_clip_c),
        lr_clamp=float(log_ratio_clamp),
        kl_coef=float(kl_coef),
        kl_est=0 if ref_f is None else KL_ESTIMATOR_IDS[kl_estimator],
        seq_len=max(1, logp.shape[1]),
        adv_per_token=per_token,
        block=block,
        num_warps=num_warps or GPU_NUM_WARPS,
    )
    scale = None if normalizer is None else _grad_scale(normalizer, logp)
    loss_sum, stats = _FusedPolicyLoss.apply(logp_f, old_f, adv_f, mask_f, isw_f, ref_f, klw_f, scale, p)
    parts = stats.unbind(0)
    return PolicyLoss(loss_sum=loss_sum, normalizer=parts[-1], stats=dict(zip(STAT_KEYS, parts[:-1])))
