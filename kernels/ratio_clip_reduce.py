"""Fused DAPO policy loss: ratio, decoupled clip, dual clip, IS weight, masked two-stage reduction.

One Triton pass over the flattened tokens (N = B*T) computes, per valid token, exactly what
``megatron_dapo.algorithm.policy_loss`` computes for ``loss_agg_mode='token-mean'``:

    log_ratio = clamp(logp - old_logp, +-log_ratio_clamp)    (zero gradient outside)
    r = exp(log_ratio)
    l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high));  l = min(l, -c A) for A < 0 (dual clip)
    l = w * l                                               (truncated-IS weight, optional)

and writes one row of block partials (loss sum, valid tokens, clip_low/high/dual counts, ratio
sum, ratio max, k3 approx-KL sum). A second one-program-per-statistic kernel folds the partials
in float64 in a fixed order: no atomics, so the results are bit-identical run to run.

Gradient, two ways:
- fused: given the mini-batch normaliser (global valid-token count n), the forward pass also
  writes d(loss_sum)/dlogp * s per token in logp's dtype, s = 1/n. loss_sum stays the plain
  sum, so backward returns ``saved * (grad_output / s)``: when the caller differentiates
  ``loss_sum / n`` (the token-mean), that factor is exactly 1, so the gradient is rounded to
  logp's dtype once, from float32, as the reference's is.
- separate: backward relaunches the same kernel with only the gradient enabled, recomputing the
  per-token gradient from the inputs (plain autograd, for callers without the normaliser).

Math is float32 whatever the input dtype (bf16 logp is upcast on load; the gradient is stored
in logp's dtype, rounded to nearest even). float64 logp runs the whole kernel in float64 (the
reference rounds to float32 there): that mode exists so ``torch.autograd.gradcheck`` can check
the kernel. exp() is range-reduced (r = 2^k * e^f, |f| <= ln2/2) because Triton's fp32 exp on
NVIDIA is ex2.approx(x*log2e), whose error grows with |x| (~7e-7 relative at |x| = 20); the
k3 KL uses the clamped log-ratio for log(r), avoiding an approximate log. old_logp,
advantages and is_weight are constants for autograd (the trainer detaches them).

Bytes moved per token (b_lp = logp's element size: 2 for bf16, 4 for fp32; old_logp fp32):

    floor (one read of each input + one write of the gradient):
        b_lp + 4 (old_logp) + 1 (mask) [+ 4 per-token advantages] [+ 4 is_weight] + b_lp (grad)
        bf16 logp, per-response A, no IS weight: 2 + 4 + 1 + 2 = 9 bytes/token.
    this kernel, forward (stats only):      mask + (logp, old_logp, A, w) of *valid* tokens only
        (masked loads: 32-byte sectors that are all padding are never fetched; SKIP_PADDING_LOADS
        = False reads them, with vector loads), + 64 B of float64 partials per block of 4096.
    separate backward:                      the same reads again + the gradient write.
    fused-gradient forward:                 the forward reads + the gradient write (= the floor);
        its backward is one elementwise scale: read + write of the gradient (2 * b_lp).
    So forward+backward moves 2 * inputs + grad (separate) or inputs + 3 * grad (fused) bytes;
    with bf16 logp and per-response A that is 16 vs 13 bytes/token against the floor of 9.
    Per-response advantages ([B]) are read once per token from L2, not from HBM.

Interpreter (TRITON_INTERPRET=1, CPU): programs run one after another, so use big blocks
(the CPU default here is 131072); no bf16 atomics, libdevice, tl.dot or device_assert are used.
The kernels are JIT-wrapped lazily, per interpreter mode, at first use: importing this module
before TRITON_INTERPRET is set does not freeze the mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_dapo.algorithm.policy_loss import STAT_KEYS, PolicyLoss
from megatron_dapo.config import AlgorithmConfig

try:  # triton is optional: without it algorithm.loss_impl='auto' resolves to the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = ["fused_policy_loss", "fused_runs_on", "interpreter_enabled"]

# Rows of the [NUM_ROWS, n_blocks] float64 partials (the kernels use these numbers): 0 loss,
# 1 valid tokens, 2 clip_low, 3 clip_high, 4 clip_dual, 5 ratio sum, 6 ratio max, 7 k3 KL sum.
NUM_ROWS = 8
# The float32 stats vector the finalize kernel writes: STAT_KEYS in order, then the normaliser.
NUM_STATS = len(STAT_KEYS) + 1

GPU_BLOCK, GPU_NUM_WARPS = 4096, 8  # 16 tokens per thread, 8 partials rows per 4096 tokens
# True: padding is never fetched (saves its bytes; loads stay coalesced but are not vectorised).
# False: bounds-masked 128-bit loads, padding read and discarded. Measure both on the GPU
# (tools/bench_kernel.py times both); the result does not depend on it.
SKIP_PADDING_LOADS = True
INTERPRET_BLOCK = 131072  # the interpreter runs programs serially: few, wide ones are fast
REDUCE_BLOCK, REDUCE_NUM_WARPS = 1024, 4


# ----------------------------------------------------------------------------- Triton kernels
# Plain functions here, wrapped by triton.jit in _kernels(): the wrapper picks compiled or
# interpreted execution when it is created, so the wrapping waits for the first call.


def _policy_loss_kernel(
    logp_ptr,  # [N] fp32|bf16|fp16|fp64
    old_ptr,  # [N] any float
    adv_ptr,  # [N] per token, or [B] per response
    mask_ptr,  # [N] uint8 (0/1)
    isw_ptr,  # [N] any float (ignored unless HAS_ISW)
    scale_ptr,  # [] factor for the gradient (ignored unless WRITE_GRAD)
    grad_ptr,  # [N] logp's dtype, out (ignored unless WRITE_GRAD)
    part_ptr,  # [NUM_ROWS, n_blocks] fp64, out (ignored unless WRITE_STATS)
    n_tokens,
    seq_len,
    inv_seq_len,  # fp32 1/T
    n_blocks,
    lo,  # 1 - eps_low
    hi,  # 1 + eps_high
    dual_c,
    lr_clamp,
    CDT: tl.constexpr,  # compute dtype: fp32, or fp64 for fp64 logp
    ADV_PER_TOKEN: tl.constexpr,
    HAS_ISW: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    WRITE_STATS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    GRAD_BF16: tl.constexpr,  # gradient stored as bfloat16
    SKIP_PADDING: tl.constexpr,  # masked loads skip padding (see the module docstring)
    RANGE_REDUCE_EXP: tl.constexpr,  # fp32 only: accurate exp without libdevice
    IDX64: tl.constexpr,  # 64-bit offsets once N + BLOCK reaches 2^31
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if IDX64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inb = offs < n_tokens
    valid = inb & (tl.load(mask_ptr + offs, mask=inb, other=0) != 0)

    # SKIP_PADDING: loads masked by `valid`, so all-padding sectors cost no memory traffic, but
    # a data-dependent mask keeps the compiler from 128-bit vector loads; else mask by bounds.
    if SKIP_PADDING:
        ld = valid
    else:
        ld = inb
    # padding is zeroed before any math, as in the reference: NaN/inf there cannot leak
    logp = tl.where(valid, tl.load(logp_ptr + offs, mask=ld, other=0.0).to(CDT), 0.0)
    old = tl.where(valid, tl.load(old_ptr + offs, mask=ld, other=0.0).to(CDT), 0.0)
    if ADV_PER_TOKEN:
        adv = tl.load(adv_ptr + offs, mask=ld, other=0.0).to(CDT)
    else:
        # response index offs // T without a per-token integer division (~20 instructions):
        # relative to the block's first response, via an fp32 reciprocal, exact after one
        # correction because local < T + BLOCK < 2^24 (the host guarantees it)
        base = start // seq_len
        local = (offs - base * seq_len).to(tl.int32)
        q = (local.to(tl.float32) * inv_seq_len).to(tl.int32)
        rem = local - q * seq_len
        q = q + (rem >= seq_len).to(tl.int32) - (rem < 0).to(tl.int32)
        adv = tl.load(adv_ptr + base + q, mask=ld, other=0.0).to(CDT)
    adv = tl.where(valid, adv, 0.0)

    raw = logp - old
    lr = tl.minimum(tl.maximum(raw, -lr_clamp), lr_clamp)
    if RANGE_REDUCE_EXP:
        # exp(x) = 2^k * exp(f), k = round(x / ln2), f = x - k*ln2 split hi/lo (Cody-Waite):
        # k*LN2_HI is exact for |k| <= 127, so f carries one rounding and |f| <= ln2/2.
        k = tl.floor(lr * 1.4426950408889634 + 0.5)
        k = tl.minimum(tl.maximum(k, -126.0), 127.0)  # 2^k stays a normal fp32 (overflow -> inf below)
        f = (lr - k * 0.693145751953125) - k * 1.428606765330187e-06
        pow2k = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        r = pow2k * tl.exp(f)
    else:
        r = tl.exp(lr)

    neg_adv = -adv
    unclipped = neg_adv * r
    clipped = neg_adv * tl.minimum(tl.maximum(r, lo), hi)
    loss = tl.maximum(unclipped, clipped)  # -min(rA, clip(r)A)
    # d loss / d r as torch.maximum's backward splits it: all to the larger branch, half each
    # at a tie (the whole clip range), and the clipped branch only where clamp passes it.
    tie = unclipped == clipped
    d_unclipped = tl.where(unclipped > clipped, 1.0, tl.where(tie, 0.5, 0.0))
    d_clipped = tl.where(clipped > unclipped, 1.0, tl.where(tie, 0.5, 0.0))
    d_clipped = tl.where((r >= lo) & (r <= hi), d_clipped, 0.0)
    coef = d_unclipped + d_clipped  # 0, 0.5 or 1
    neg = adv < 0.0
    if HAS_DUAL:
        cap = neg_adv * dual_c
        dual = neg & (loss > cap)
        d_min = tl.where(loss < cap, 1.0, tl.where(loss == cap, 0.5, 0.0))
        coef = tl.where(neg, coef * d_min, coef)
        loss = tl.where(neg, tl.minimum(loss, cap), loss)
    if HAS_ISW:
        w = tl.where(valid, tl.load(isw_ptr + offs, mask=ld, other=0.0).to(CDT), 0.0)
        loss = loss * w
    loss = tl.where(valid, loss, 0.0)

    if WRITE_GRAD:
        g = tl.load(scale_ptr).to(CDT)
        if HAS_ISW:
            g = g * w
        g = g * coef * neg_adv * r  # d/dlogp = d/dr * r
        keep = valid & (raw >= -lr_clamp) & (raw <= lr_clamp)  # clamp passes its bounds
        g = tl.where(keep, g, 0.0)
        if GRAD_BF16:
            # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates
            bits = g.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(grad_ptr + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inb)
        else:
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=inb)

    if WRITE_STATS:
        ratio = tl.where(valid, r, 0.0)
        kl = tl.where(valid, (r - 1.0) - lr, 0.0)  # k3 = (r - 1) - log r
        n_low = tl.sum((valid & neg & (r < lo)).to(tl.int32), axis=0)
        n_high = tl.sum((valid & (adv > 0.0) & (r > hi)).to(tl.int32), axis=0)
        if HAS_DUAL:
            n_dual = tl.sum((valid & dual).to(tl.int32), axis=0)
        else:
            n_dual = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
        row = part_ptr + pid
        tl.store(row + 0 * n_blocks, tl.sum(loss, axis=0).to(tl.float64))
        tl.store(row + 1 * n_blocks, tl.sum(valid.to(tl.int32), axis=0).to(tl.float64))
        tl.store(row + 2 * n_blocks, n_low.to(tl.float64))
        tl.store(row + 3 * n_blocks, n_high.to(tl.float64))
        tl.store(row + 4 * n_blocks, n_dual.to(tl.float64))
        tl.store(row + 5 * n_blocks, tl.sum(ratio, axis=0).to(tl.float64))
        tl.store(row + 6 * n_blocks, tl.max(ratio, axis=0).to(tl.float64))
        tl.store(row + 7 * n_blocks, tl.sum(kl, axis=0).to(tl.float64))


def _finalize_kernel(
    part_ptr,  # [NUM_ROWS, n_blocks] fp64
    loss_ptr,  # [] loss dtype, out
    stats_ptr,  # [NUM_STATS] fp32, out: STAT_KEYS order, then the normaliser
    n_blocks,
    RBLOCK: tl.constexpr,
):
    # One program per partials row; a fixed-order float64 fold: deterministic and exact for counts.
    row = tl.program_id(0)
    cols = tl.arange(0, RBLOCK)
    acc_sum = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_max = tl.zeros([RBLOCK], dtype=tl.float64)  # ratios are >= 0, as is the reference's empty max
    for start in range(0, n_blocks, RBLOCK):
        x = tl.load(part_ptr + row * n_blocks + start + cols, mask=start + cols < n_blocks, other=0.0)
        acc_sum += x
        acc_max = tl.maximum(acc_max, x)
    total = tl.where(row == 6, tl.max(acc_max, axis=0), tl.sum(acc_sum, axis=0))  # 6: ROW_RATIO_MAX
    tl.store(loss_ptr, total.to(loss_ptr.dtype.element_ty), mask=row == 0)
    tl.store(stats_ptr + row - 1, total.to(tl.float32), mask=row > 0)
    tl.store(stats_ptr + 7, total.to(tl.float32), mask=row == 1)  # normaliser = valid tokens


_JITTED: dict[bool, tuple] = {}


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    if triton is not None and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def fused_runs_on(device: torch.device) -> bool:
    """Whether fused_policy_loss can run on tensors of this device: triton installed, and CUDA or the interpreter."""
    return triton is not None and (device.type == "cuda" or interpreter_enabled())


def _kernels() -> tuple:
    """(policy-loss kernel, finalize kernel), JIT-wrapped for the current interpreter mode."""
    if triton is None:
        raise RuntimeError("fused_policy_loss needs triton, which is not installed")
    mode = interpreter_enabled()
    if mode not in _JITTED:
        _JITTED[mode] = (triton.jit(_policy_loss_kernel), triton.jit(_finalize_kernel))
    return _JITTED[mode]


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class _Params:
    """Scalars and launch configuration of one call (not tensors: they go through autograd)."""

    lo: float
    hi: float
    dual_c: Optional[float]
    lr_clamp: float
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
    adv_per_token). logp stays differentiable through reshape/contiguous.
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


def _compute_dtype(logp: torch.Tensor) -> torch.dtype:
    return torch.float64 if logp.dtype == torch.float64 else torch.float32


def _launch(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    isw: Optional[torch.Tensor],
    p: _Params,
    scale: Optional[torch.Tensor],
    write_stats: bool,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Run the token kernel (and the finalize kernel when write_stats).

    All tensors flat [N] ([B] per-response advantages). scale: [] gradient factor, or None for
    no gradient. Returns (loss [] compute dtype | None, stats [NUM_STATS] fp32 | None, grad [N] | None).
    """
    kernel, finalize = _kernels()
    n = logp.numel()
    n_blocks = max(1, triton.cdiv(n, p.block))
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
        CDT=tl.float64 if cdt == torch.float64 else tl.float32,
        ADV_PER_TOKEN=p.adv_per_token,
        HAS_ISW=isw is not None,
        HAS_DUAL=p.dual_c is not None,
        WRITE_STATS=write_stats,
        WRITE_GRAD=write_grad,
        GRAD_BF16=logp.dtype == torch.bfloat16,
        SKIP_PADDING=SKIP_PADDING_LOADS,
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
    def forward(ctx, logp, old_logp, adv, mask, isw, scale, p: _Params):
        fuse = scale is not None and ctx.needs_input_grad[0]
        loss, stats, grad = _launch(logp, old_logp, adv, mask, isw, p, scale if fuse else None, write_stats=True)
        ctx.p, ctx.fused = p, fuse
        if fuse:
            ctx.save_for_backward(grad, scale)
        else:
            ctx.save_for_backward(logp, old_logp, adv, mask, isw)
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
            logp, old_logp, adv, mask, isw = ctx.saved_tensors
            go = grad_loss.to(_compute_dtype(logp)).contiguous()
            _, _, grad_logp = _launch(logp, old_logp, adv, mask, isw, ctx.p, go, write_stats=False)
        return grad_logp, None, None, None, None, None, None


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
    p = _Params(
        lo=1.0 - eps_low,
        hi=1.0 + eps_high,
        dual_c=None if dual_clip_c is None else float(dual_clip_c),
        lr_clamp=float(log_ratio_clamp),
        seq_len=max(1, logp.shape[1]),
        adv_per_token=per_token,
        block=block,
        num_warps=num_warps or GPU_NUM_WARPS,
    )
    scale = None if normalizer is None else _grad_scale(normalizer, logp)
    loss_sum, stats = _FusedPolicyLoss.apply(logp_f, old_f, adv_f, mask_f, isw_f, scale, p)
    parts = stats.unbind(0)
    return PolicyLoss(loss_sum=loss_sum, normalizer=parts[-1], stats=dict(zip(STAT_KEYS, parts[:-1])))
