"""Fused DAPO policy loss: ratio, decoupled clip, dual clip, IS weight, masked two-stage reduction.

One Triton pass over the flattened tokens (N = B*T) computes, per valid token, exactly what
``megatron_dapo.algorithm.policy_loss`` computes for ``loss_agg_mode='token-mean'``:

    log_ratio = clamp(logp - old_logp, +-log_ratio_clamp)    (zero gradient outside)
    r = exp(log_ratio)
    l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high));  l = min(l, -c A) for A < 0 (dual clip)
    l = w * l                                               (truncated-IS weight, optional)
    l = l + beta * v * k                                    (KL to a reference, optional: k = kl.py's
                                                             k1/k2/k3 of d = ref_logp - logp, v a per-token
                                                             weight for seq-mean-token-mean, else 1)

and writes one row of block partials (loss sum, valid tokens, clip_low/high/dual counts, ratio
sum, ratio max, k3 approx-KL sum, reference KL sum, the KL term's loss sum). A second one-program-per-statistic kernel folds the partials
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

import torch

from megatron_dapo.choices import KL_ESTIMATORS
from megatron_dapo.loss_result import STAT_KEYS

try:  # triton is optional: without it algorithm.loss_impl='auto' resolves to the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = ["fused_runs_on", "interpreter_enabled"]

# Rows of the [NUM_ROWS, n_blocks] float64 partials (the kernels use these numbers): 0 loss,
# 1 valid tokens, 2 clip_low, 3 clip_high, 4 clip_dual, 5 ratio sum, 6 ratio max, 7 k3 KL sum,
# 8 reference KL sum, 9 the KL term's loss sum.
NUM_ROWS = 10
# The float32 stats vector the finalize kernel writes: STAT_KEYS in order, then the normaliser.
NUM_STATS = len(STAT_KEYS) + 1

GPU_BLOCK, GPU_NUM_WARPS = 4096, 8  # 16 tokens per thread, 8 partials rows per 4096 tokens
# True: padding is never fetched (saves its bytes; loads stay coalesced but are not vectorised).
# False: bounds-masked 128-bit loads, padding read and discarded. Measure both on the GPU
# (tools/bench_kernel.py times both); the result does not depend on it.
SKIP_PADDING_LOADS = True
INTERPRET_BLOCK = 131072  # the interpreter runs programs serially: few, wide ones are fast
REDUCE_BLOCK, REDUCE_NUM_WARPS = 1024, 4
KL_CLAMP, K3_CLAMP = 20.0, 10.0  # algorithm/kl.py's clamps of d and of k3
# The kernel's KL_EST per estimator: 0 is no KL term, then KL_ESTIMATORS in order (k1, k2, k3: the kernel's
# branches test 1, 2, 3; tests/test_kernel.py checks each against algorithm/kl.py).
KL_ESTIMATOR_IDS = {name: i for i, name in enumerate(KL_ESTIMATORS, start=1)}


# ----------------------------------------------------------------------------- Triton kernels
# Plain functions here, wrapped by triton.jit in _kernels(): the wrapper picks compiled or
# interpreted execution when it is created, so the wrapping waits for the first call.


def _policy_loss_kernel(
    logp_ptr,  # [N] fp32|bf16|fp16|fp64
    old_ptr,  # [N] any float
    adv_ptr,  # [N] per token, or [B] per response
    mask_ptr,  # [N] uint8 (0/1)
    isw_ptr,  # [N] any float (ignored unless HAS_ISW)
    ref_ptr,  # [N] any float, reference logprobs (ignored unless KL_EST)
    klw_ptr,  # [N] any float, the KL term's per-token weight (ignored unless HAS_KLW)
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
    kl_coef,
    CDT: tl.constexpr,  # compute dtype: fp32, or fp64 for fp64 logp
    ADV_PER_TOKEN: tl.constexpr,
    HAS_ISW: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    KL_EST: tl.constexpr,  # 0: no KL term; 1, 2, 3: k1, k2, k3
    HAS_KLW: tl.constexpr,
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
    if KL_EST != 0:
        ref = tl.where(valid, tl.load(ref_ptr + offs, mask=ld, other=0.0).to(CDT), 0.0)
        draw = ref - logp
        d = tl.minimum(tl.maximum(draw, -20.0), 20.0)  # KL_CLAMP
        if KL_EST == 1:
            kv = -d
            dk = tl.full(d.shape, 1.0, CDT)  # d k / d logp
        elif KL_EST == 2:
            kv = 0.5 * d * d
            dk = -d
        else:
            if RANGE_REDUCE_EXP:  # as for r above
                kd = tl.floor(d * 1.4426950408889634 + 0.5)
                fd = (d - kd * 0.693145751953125) - kd * 1.428606765330187e-06
                ed = ((kd.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True) * tl.exp(fd)
            else:
                ed = tl.exp(d)
            k3 = (ed - 1.0) - d
            kv = tl.minimum(tl.maximum(k3, -10.0), 10.0)  # K3_CLAMP
            dk = tl.where((k3 >= -10.0) & (k3 <= 10.0), 1.0 - ed, 0.0)
        dk = tl.where(valid & (draw >= -20.0) & (draw <= 20.0), dk, 0.0)
        kv = tl.where(valid, kv, 0.0)
        if HAS_KLW:
            klw = tl.where(valid, tl.load(klw_ptr + offs, mask=ld, other=0.0).to(CDT), 0.0)
            kl_term = kl_coef * (klw * kv)
        else:
            kl_term = kl_coef * kv
        loss = loss + kl_term
    loss = tl.where(valid, loss, 0.0)

    if WRITE_GRAD:
        g = tl.load(scale_ptr).to(CDT)
        if HAS_ISW:
            g = g * w
        g = g * coef * neg_adv * r  # d/dlogp = d/dr * r
        keep = valid & (raw >= -lr_clamp) & (raw <= lr_clamp)  # clamp passes its bounds
        g = tl.where(keep, g, 0.0)
        if KL_EST != 0:
            gk = tl.load(scale_ptr).to(CDT) * kl_coef * dk
            if HAS_KLW:
                gk = gk * klw
            g = g + gk
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
        if KL_EST != 0:
            tl.store(row + 8 * n_blocks, tl.sum(kv, axis=0).to(tl.float64))
            tl.store(row + 9 * n_blocks, tl.sum(kl_term, axis=0).to(tl.float64))
        else:
            tl.store(row + 8 * n_blocks, 0.0)
            tl.store(row + 9 * n_blocks, 0.0)


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
    tl.store(stats_ptr + 9, total.to(tl.float32), mask=row == 1)  # normaliser (NUM_STATS - 1) = valid tokens


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
