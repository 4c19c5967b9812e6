"""The fused Triton policy loss against the reference policy_loss, in Triton's CPU interpreter.

Random inputs from each test's seed. Padding always holds NaN/inf, which must never reach the loss
or the gradient. Tolerances: float32 results to 1e-6 relative (sums: relative to the sum of
the magnitudes they add up). The gradient of bf16/fp16 logp is one rounding of the float32
gradient: each element equals the reference's float32 gradient rounded to logp's dtype, or, where
a rounding boundary lies within 1e-6 (relative) of it, the value on either side. The kernel's
exp() may differ from torch's by ~2 ulp, so a token whose ratio lies within 1e-6 of a clip
boundary may flip its clip flag (and its gradient); such tokens are counted and left out of the
element-wise gradient check.
"""

from __future__ import annotations

import os

# Before triton or the kernel module is imported (the kernels also JIT lazily, per mode).
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_dapo.algorithm.losses import policy_loss_fn, resolve_loss_impl  # noqa: E402
from megatron_dapo.algorithm.policy_loss import STAT_KEYS, loss_normalizer, policy_loss  # noqa: E402
from megatron_dapo.choices import KL_ESTIMATORS, LOSS_AGG_MODES  # noqa: E402
from megatron_dapo.kernels import fused_policy_loss, fused_runs_on  # noqa: E402
from megatron_dapo.kernels import ratio_clip_reduce as rcr  # noqa: E402

EPS_LOW, EPS_HIGH = 0.2, 0.28
DUAL_C = 3.0
BLOCK = 4096  # several programs per test batch, still fast in the interpreter


# ------------------------------------------------------------------------------ inputs


def make_batch(g, b, t, dtype=torch.float32, adv_per_token=False, with_isw=False, poison=True):
    """Random [B, T] inputs drawn from torch.Generator g, with ragged padding; log-ratios mostly small, 10% wide
    (clips fire).

    Per-response advantages alternate in sign (row 0 positive); with B >= 3 the last response
    is empty (all padding). Every row but that one has at least T // 4 valid tokens.
    """
    old = torch.randn(b, t, generator=g) * 2.0 - 3.0
    d = torch.randn(b, t, generator=g) * 0.3
    wide = torch.rand(b, t, generator=g) < 0.1
    d[wide] *= 6.0
    logp = (old + d).to(dtype)
    if adv_per_token:
        adv = torch.randn(b, t, generator=g)
    else:
        adv = torch.randn(b, generator=g).abs() * torch.tensor([1.0, -1.0]).repeat(b)[:b]
    lengths = torch.randint(max(1, t // 4), t + 1, (b,), generator=g)
    if b >= 3:
        lengths[-1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    isw = torch.rand(b, t, generator=g) * 2.0 if with_isw else None
    if poison:  # what lies in padding must not matter
        logp[~mask] = float("nan")
        old[~mask] = float("inf")
        if adv_per_token:
            adv[~mask] = float("nan")
        if isw is not None:
            isw[~mask] = float("-inf")
    return {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask, "is_weight": isw}


def ambiguous_tokens(batch, dual_clip_c=None, clamp=20.0):
    """[B, T] bool: valid tokens whose ratio is within 1e-6 of a clip boundary."""
    d = (batch["logp"].float() - batch["old_logp"].float()).clamp(-clamp, clamp)
    r = torch.exp(d.double())
    near = ((r / (1 - EPS_LOW) - 1).abs() < 1e-6) | ((r / (1 + EPS_HIGH) - 1).abs() < 1e-6)
    if dual_clip_c is not None:
        near |= (r / dual_clip_c - 1).abs() < 1e-6
    return near & batch["mask"]


def magnitudes(batch, clamp=20.0):
    """Per-valid-token scales the summed statistics are compared against (float64)."""
    mask = batch["mask"]
    d = torch.where(mask, batch["logp"].float() - batch["old_logp"].float(), 0.0).clamp(-clamp, clamp).double()
    r = torch.exp(d)
    adv = batch["advantages"].double()
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    w = torch.ones_like(r) if batch["is_weight"] is None else batch["is_weight"].double()
    z = torch.zeros((), dtype=torch.float64)
    return {
        "loss": torch.where(mask, adv.abs() * (r + 1) * w, z).sum().item(),
        "kl": torch.where(mask, r + 1 + d.abs(), z).sum().item(),
        "ratio": torch.where(mask, r, z).sum().item(),
    }


# ------------------------------------------------------------------------------ running both


def run_both(batch, dual_clip_c=None, fused_grad=False, grad_out=0.37, block=BLOCK, clamp=20.0):
    """(kernel PolicyLoss, its grad [B, T] logp's dtype, reference PolicyLoss, its grad [B, T] float32) for
    d(loss_sum * grad_out)/dlogp.

    The reference runs on logp upcast to float32 (policy_loss computes in float32 whatever the dtype, so its
    loss is the same): its gradient is the float32 one, before any rounding to logp's dtype.
    fused_grad: pass normalizer = 1/grad_out (the trainer's token-mean), taking the fused path.
    """
    kw = dict(dual_clip_c=dual_clip_c, is_weight=batch["is_weight"], log_ratio_clamp=clamp)
    args = (batch["old_logp"], batch["advantages"], batch["mask"])
    lp = batch["logp"].clone().requires_grad_()
    norm = 1.0 / grad_out if fused_grad else None
    out = fused_policy_loss(lp, *args, EPS_LOW, EPS_HIGH, normalizer=norm, block=block, **kw)
    (out.loss_sum * grad_out).backward()
    lp_ref = batch["logp"].float().requires_grad_()
    ref = policy_loss(lp_ref, *args, EPS_LOW, EPS_HIGH, **kw)
    (ref.loss_sum * grad_out).backward()
    return out, lp.grad, ref, lp_ref.grad


def assert_same_loss(batch, out, ref, dual_clip_c=None, clamp=20.0):
    """The loss, the normaliser and every statistic of the kernel against the reference (the module docstring's
    tolerances)."""
    n_amb = int(ambiguous_tokens(batch, dual_clip_c, clamp).sum())
    scale = magnitudes(batch, clamp)
    assert out.loss_sum.dtype == torch.float32 and out.normalizer.dtype == torch.float32
    assert set(out.stats) == set(STAT_KEYS)
    assert torch.isfinite(out.loss_sum)
    assert abs(out.loss_sum.item() - ref.loss_sum.item()) <= 1e-6 * scale["loss"] + 1e-30
    assert out.normalizer.item() == ref.normalizer.item()
    assert out.stats["tokens"].item() == ref.stats["tokens"].item()
    for k in ("clip_low", "clip_high", "clip_dual"):
        assert abs(out.stats[k].item() - ref.stats[k].item()) <= n_amb, k
    torch.testing.assert_close(out.stats["ratio_max"], ref.stats["ratio_max"], rtol=1e-6, atol=0)
    # against the float64 sum: the kernel accumulates in float64, while the reference's float32 sum can be 1e-5 off
    # when one ratio is hundreds of times the rest (seen once in a full run, with its thread split)
    assert abs(out.stats["ratio_sum"].item() - scale["ratio"]) <= 1e-6 * scale["ratio"]
    assert abs(out.stats["approx_kl_sum"].item() - ref.stats["approx_kl_sum"].item()) <= 1e-6 * scale["kl"] + 1e-30


def assert_one_rounding(grad, ref_grad32, rel=1e-6):
    """grad [...] bf16/fp16 is ref_grad32 [...] float32 rounded to grad's dtype: exactly, or where a rounding
    boundary lies within `rel` of ref_grad32 (the kernel's float32 value may sit on its other side), the value on
    either side. Truncation instead of round-to-nearest, or any other error of one ulp, fails."""
    below, above = (ref_grad32 * (1 - rel)).to(grad.dtype), (ref_grad32 * (1 + rel)).to(grad.dtype)
    wrong = (grad != below) & (grad != above)
    assert not wrong.any(), (
        f"{int(wrong.sum())} of {grad.numel()} elements are not one rounding of the float32 gradient: "
        f"got {grad[wrong][:5].tolist()}, float32 {ref_grad32[wrong][:5].tolist()}"
    )


def assert_matches(batch, out, grad, ref, ref_grad, dual_clip_c=None, clamp=20.0):
    """assert_same_loss, and the gradient (the module docstring's tolerances); ref_grad is float32 (run_both)."""
    assert_same_loss(batch, out, ref, dual_clip_c, clamp)
    assert grad.dtype == batch["logp"].dtype and grad.shape == batch["logp"].shape
    assert torch.isfinite(grad).all()
    assert (grad[~batch["mask"]] == 0).all()
    keep = ~ambiguous_tokens(batch, dual_clip_c, clamp)
    if batch["logp"].dtype == torch.float32:
        torch.testing.assert_close(grad[keep], ref_grad[keep], rtol=1e-6, atol=1e-30)
    else:
        assert_one_rounding(grad[keep], ref_grad[keep])


# ------------------------------------------------------------------------------ tests


def test_kernel_runs_in_interpreter():
    """Nothing here is silently skipped: the kernels really run interpreted on this CPU."""
    assert rcr.interpreter_enabled()
    assert type(rcr._kernels()[0]).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("adv_per_token", [False, True], ids=["adv_resp", "adv_token"])
@pytest.mark.parametrize("dual_clip_c", [None, DUAL_C], ids=["nodual", "dual"])
@pytest.mark.parametrize("with_isw", [False, True], ids=["noisw", "isw"])
@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_matches_reference(seed, dtype, adv_per_token, dual_clip_c, with_isw, fused_grad):
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(g, 5, 3001, dtype, adv_per_token, with_isw)  # 15005 tokens: 4 blocks, the last partial
    out, grad, ref, ref_grad = run_both(batch, dual_clip_c, fused_grad)
    assert_matches(batch, out, grad, ref, ref_grad, dual_clip_c)
    # The batch exercises every branch. At least 1300 valid tokens have A < 0 (as many A > 0); each is clipped low
    # with p = 0.25 (d < ln 0.8), high likewise with p = 0.23, and dual-clipped with p = 0.027 (d > ln 3, mostly
    # from the 10% wide ones): no dual clip at all has probability (1 - 0.027)^1300 < 1e-15, the others far less.
    assert ref.stats["clip_low"] > 0 and ref.stats["clip_high"] > 0
    if dual_clip_c is not None:
        assert ref.stats["clip_dual"] > 0


@pytest.mark.parametrize("adv_per_token", [False, True], ids=["adv_resp", "adv_token"])
@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_matches_reference_reading_padding(seed, monkeypatch, adv_per_token, fused_grad):
    """SKIP_PADDING_LOADS=False (vector loads that fetch the NaN padding) gives the same results."""
    monkeypatch.setattr(rcr, "SKIP_PADDING_LOADS", False)
    batch = make_batch(torch.Generator().manual_seed(seed), 5, 3001, torch.bfloat16, adv_per_token, with_isw=True)
    out, grad, ref, ref_grad = run_both(batch, DUAL_C, fused_grad)
    assert_matches(batch, out, grad, ref, ref_grad, DUAL_C)


def test_empty_batch():
    for shape in [(0, 5), (3, 0)]:
        lp = torch.zeros(shape, requires_grad=True)
        out = fused_policy_loss(lp, torch.zeros(shape), torch.zeros(shape[0]), torch.ones(shape, dtype=torch.bool))
        out.loss_sum.backward()
        assert out.loss_sum.item() == 0.0 and all(v.item() == 0.0 for v in out.stats.values())
        assert lp.grad.shape == shape


def test_large_batch_default_block(seed):
    """1M tokens at the interpreter's default block (8 programs)."""
    batch = make_batch(torch.Generator().manual_seed(seed), 64, 16411, torch.bfloat16, with_isw=True)
    out, grad, ref, ref_grad = run_both(batch, DUAL_C, fused_grad=True, block=None)
    assert_matches(batch, out, grad, ref, ref_grad, DUAL_C)


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_fp16_logp(seed, fused_grad):
    batch = make_batch(torch.Generator().manual_seed(seed), 3, 777, torch.float16)
    out, grad, ref, ref_grad = run_both(batch, DUAL_C, fused_grad)
    assert_matches(batch, out, grad, ref, ref_grad, DUAL_C)


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_masked_is_zero_without_nan(seed, dtype, fused_grad):
    batch = make_batch(torch.Generator().manual_seed(seed), 4, 1000, dtype, adv_per_token=True, with_isw=True)
    batch["mask"][:] = False
    for k in ("logp", "old_logp", "advantages", "is_weight"):
        batch[k].fill_(float("nan"))
    out, grad, ref, _ = run_both(batch, DUAL_C, fused_grad)
    assert out.loss_sum.item() == 0.0 and ref.loss_sum.item() == 0.0
    assert out.normalizer.item() == 0.0
    assert all(v.item() == 0.0 for v in out.stats.values())
    assert (grad == 0).all() and not grad.isnan().any()


def test_global_normalizer_zero_gives_zero_grad(seed):
    """A mini-batch with no valid token at all: normalizer 0 must not turn into inf/NaN."""
    batch = make_batch(torch.Generator().manual_seed(seed), 2, 50, with_isw=True)
    batch["mask"][:] = False
    lp = batch["logp"].clone().requires_grad_()
    out = fused_policy_loss(lp, batch["old_logp"], batch["advantages"], batch["mask"], normalizer=0)
    out.loss_sum.backward()
    assert (lp.grad == 0).all()


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_one_token(seed, fused_grad):
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):
        batch = make_batch(g, 1, 1, adv_per_token=False)
        batch["advantages"] = torch.randn(1, generator=g)
        out, grad, ref, ref_grad = run_both(batch, DUAL_C, fused_grad)
        assert_matches(batch, out, grad, ref, ref_grad, DUAL_C)


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_extreme_log_ratios_are_clamped(seed, fused_grad):
    """Log-ratios of +-50: the ratio saturates at exp(+-20) and the gradient is zero there."""
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(g, 4, 500, with_isw=True, adv_per_token=True)
    sign = torch.where(torch.rand(4, 500, generator=g) < 0.5, -1.0, 1.0)
    extreme = torch.rand(4, 500, generator=g) < 0.3
    batch["logp"] = torch.where(extreme, batch["old_logp"] + 50.0 * sign, batch["logp"])
    out, grad, ref, ref_grad = run_both(batch, DUAL_C, fused_grad)
    assert_matches(batch, out, grad, ref, ref_grad, DUAL_C)
    assert (grad[extreme & batch["mask"]] == 0).all()
    # ratio_max saturates: >= 375 valid tokens (3 rows of >= 125), each at +50 with p = 0.15: none has p < 1e-26
    assert math.isclose(out.stats["ratio_max"].item(), math.exp(20.0), rel_tol=1e-6)


def test_fused_grad_with_other_grad_output(seed):
    """The fused path's backward honours any grad_output, not only 1/normalizer."""
    batch = make_batch(torch.Generator().manual_seed(seed), 3, 999, with_isw=True)
    args = (batch["old_logp"], batch["advantages"], batch["mask"])
    lp = batch["logp"].clone().requires_grad_()
    out = fused_policy_loss(lp, *args, is_weight=batch["is_weight"], normalizer=torch.tensor(777.0), block=BLOCK)
    (out.loss_sum * -2.5).backward()
    lp_ref = batch["logp"].clone().requires_grad_()
    (policy_loss(lp_ref, *args, is_weight=batch["is_weight"]).loss_sum * -2.5).backward()
    keep = ~ambiguous_tokens(batch)
    torch.testing.assert_close(lp.grad[keep], lp_ref.grad[keep], rtol=2e-6, atol=1e-30)


def test_no_grad_needed(seed):
    """logp without requires_grad (e.g. evaluation): the loss and every statistic, on both paths."""
    batch = make_batch(torch.Generator().manual_seed(seed), 3, 500, adv_per_token=True, with_isw=True)
    kw = dict(dual_clip_c=DUAL_C, is_weight=batch["is_weight"])
    args = (batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"])
    ref = policy_loss(*args, **kw)
    for norm in (None, 100.0):
        out = policy_loss_fn("fused")(*args, normalizer=norm, **kw)
        assert not out.loss_sum.requires_grad
        assert_same_loss(batch, out, ref, DUAL_C)


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_bit_identical_runs(seed, fused_grad):
    batch = make_batch(torch.Generator().manual_seed(seed), 6, 4097, torch.bfloat16, adv_per_token=True, with_isw=True)
    runs = [run_both(batch, DUAL_C, fused_grad)[:2] for _ in range(2)]
    (a, ga), (b, gb) = runs
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.normalizer, b.normalizer)
    assert all(torch.equal(a.stats[k], b.stats[k]) for k in STAT_KEYS)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("block", [32, 1024, 4096])
def test_response_index_of_every_token(seed, block):
    """Per-response advantages reach exactly their own tokens, for awkward T and blocks.

    With logp == old_logp every ratio is 1 and the gradient of loss_sum is -A[b] per token.
    """
    g = torch.Generator().manual_seed(seed)
    for t in (1, 2, 3, 7, 100, 1023, 4097):
        if 2 * t > 40 * block:  # the interpreter runs ~50 programs a second: keep launches small
            continue
        b = max(2, min(40, 40 * block // t))
        adv = torch.arange(1, b + 1, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(b)[:b]
        old = torch.randn(b, t, generator=g)
        lp = old.clone().requires_grad_()
        fused_policy_loss(lp, old, adv, torch.ones(b, t, dtype=torch.bool), block=block).loss_sum.backward()
        assert torch.equal(lp.grad, (-adv)[:, None].expand(b, t)), t


def test_mask_and_advantage_layouts(seed):
    """Float/uint8 masks, [B, 1] advantages and non-contiguous inputs mean the same thing."""
    batch = make_batch(torch.Generator().manual_seed(seed), 4, 300, adv_per_token=False)
    base = fused_policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"])
    wide = torch.cat([batch["logp"], batch["logp"]], dim=1)[:, :300]  # non-contiguous
    for mask in (batch["mask"].float(), batch["mask"].to(torch.uint8)):
        for adv in (batch["advantages"][:, None], batch["advantages"][:, None].expand(4, 300)):
            out = fused_policy_loss(wide, batch["old_logp"], adv, mask)
            assert torch.equal(out.loss_sum, base.loss_sum)
            assert all(torch.equal(out.stats[k], base.stats[k]) for k in STAT_KEYS)


def test_bad_shapes_raise(seed):
    batch = make_batch(torch.Generator().manual_seed(seed), 2, 10)
    with pytest.raises(ValueError, match="same"):
        fused_policy_loss(batch["logp"], batch["old_logp"][:, :5], batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="advantages"):
        fused_policy_loss(batch["logp"], batch["old_logp"], torch.zeros(3), batch["mask"])
    with pytest.raises(ValueError, match="power of two"):
        fused_policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], block=1000)


def _smooth_batch(g, b, t, dtype):
    """Inputs from generator g whose ratios are at least 1% away from every kink (clip bounds, dual cap; no clamp)."""
    batch = make_batch(g, b, t, adv_per_token=True, with_isw=True, poison=False)
    d = torch.randn(b, t, dtype=torch.float64, generator=g) * 0.6
    r = d.exp()
    for kink in (1 - EPS_LOW, 1 + EPS_HIGH, DUAL_C):
        d = torch.where((r / kink - 1).abs() < 1e-2, d + 0.05, d)  # kinks lie > 0.2 apart in log space
    batch["old_logp"] = batch["old_logp"].to(dtype)
    batch["logp"] = (batch["old_logp"] + d).to(dtype)
    batch["advantages"] = batch["advantages"].to(dtype)
    batch["is_weight"] = batch["is_weight"].to(dtype)
    return batch


@pytest.mark.parametrize("fused_grad", [False, True], ids=["sep_bwd", "fused_bwd"])
def test_gradcheck_float64(seed, fused_grad):
    """The kernel runs in float64 for float64 logp, so autograd.gradcheck applies: in fast mode, the Jacobian against
    central differences along random directions (a wrong gradient entry shows in any of them), two forwards each
    instead of two per token: the interpreted kernel's forward is the cost."""
    batch = _smooth_batch(torch.Generator().manual_seed(seed), 3, 7, torch.float64)
    norm = 13.0 if fused_grad else None
    args = (batch["old_logp"], batch["advantages"], batch["mask"])

    def f(lp):
        return fused_policy_loss(lp, *args, dual_clip_c=DUAL_C, is_weight=batch["is_weight"], normalizer=norm).loss_sum

    lp = batch["logp"].clone().requires_grad_()
    assert f(lp).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (lp,), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_finite_differences_float32(seed):
    """The float32 kernel's gradient against central differences of its own forward, token by token."""
    batch = _smooth_batch(torch.Generator().manual_seed(seed), 2, 9, torch.float32)
    lp = batch["logp"].clone().requires_grad_()
    kw = dict(dual_clip_c=DUAL_C, is_weight=batch["is_weight"])
    fused_policy_loss(lp, batch["old_logp"], batch["advantages"], batch["mask"], **kw).loss_sum.backward()
    h = 4e-3  # moves r by 0.4%: inside the 1% margin, so no kink lies between the two points
    for i, j in batch["mask"].nonzero().tolist():
        alone = torch.zeros_like(batch["mask"])  # the loss is a sum over tokens: this token's term alone
        alone[i, j] = True
        up, dn = batch["logp"].clone(), batch["logp"].clone()
        up[i, j] += h
        dn[i, j] -= h
        step = up[i, j].double().item() - dn[i, j].double().item()  # what float32 made of +-h
        terms = [fused_policy_loss(x, batch["old_logp"], batch["advantages"], alone, **kw).loss_sum for x in (up, dn)]
        fd = (terms[0] - terms[1]).item() / step
        grad = lp.grad[i, j].item()
        # An unclipped term is C * e^logp, its own gradient; a clipped one is constant (fd and grad exactly 0). Each
        # float32 forward is within a few ulps (exp, two products) of the exact term: 8 ulps of it over the step;
        # the central difference's own error is (step/2)^2/6 < step^2 of the gradient.
        assert abs(grad - fd) <= (8 * 2**-24 / step + step**2) * abs(grad), (i, j, grad, fd)


# ------------------------------------------------------------------------------ the loss registry


def test_auto_resolves_to_the_kernel_where_it_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert fused_runs_on(cpu)  # the tests run Triton's interpreter (conftest)
    assert resolve_loss_impl("auto", fused_runs_on(cpu)) == "fused"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fused_runs_on(cpu) and resolve_loss_impl("auto", fused_runs_on(cpu)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused_runs_on(cpu)
    assert resolve_loss_impl("reference", True) == "reference" and resolve_loss_impl("fused", True) == "fused"


def test_fused_where_it_cannot_run_and_unknown_names_are_clear_errors(seed, monkeypatch):
    with pytest.raises(RuntimeError, match="algorithm.loss_impl='fused' needs CUDA"):
        resolve_loss_impl("fused", False)
    with pytest.raises(ValueError, match="algorithm.loss_impl='triton'"):
        resolve_loss_impl("triton", True)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        policy_loss_fn("auto")
    batch = make_batch(torch.Generator().manual_seed(seed), 2, 64)
    for impl in ("fused", "reference"):
        with pytest.raises(ValueError, match="'seq-mean-token-sum-norm' needs max_response_length >= 1, got None"):
            policy_loss_fn(impl)(
                batch["logp"],
                batch["old_logp"],
                batch["advantages"],
                batch["mask"],
                loss_agg_mode="seq-mean-token-sum-norm",
            )
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_the_registered_losses_agree(mode, seed):
    """Every aggregation through the kernel equals the reference: loss sum, divisor, statistics and the gradient of
    the mini-batch loss (with the gradient fused into the forward pass, as the trainer runs it)."""
    batch = make_batch(torch.Generator().manual_seed(seed), 3, 555, adv_per_token=True, with_isw=True)
    mask = batch["mask"]
    kw = dict(dual_clip_c=DUAL_C, is_weight=batch["is_weight"], loss_agg_mode=mode, max_response_length=600)
    results = {}
    for impl in ("fused", "reference"):
        logp = batch["logp"].clone().requires_grad_(True)
        args = (logp, batch["old_logp"], batch["advantages"], mask)
        normalizer = loss_normalizer(mask.bool().sum(1), mode, 600)  # one micro-batch: the whole divisor
        out = policy_loss_fn(impl)(*args, normalizer=normalizer, **kw)  # the reference ignores `normalizer`
        (out.loss_sum / normalizer).backward()
        results[impl] = (out, logp.grad)
    (out, grad), (ref, ref_grad) = results["fused"], results["reference"]
    if mode == "seq-mean-token-mean":  # the loss scale assert_same_loss knows is the token sum's
        torch.testing.assert_close(out.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-6)
        assert out.normalizer.item() == ref.normalizer.item()
    else:
        assert_same_loss(batch, out, ref, DUAL_C)
    want = {
        "token-mean": mask.sum(),
        "seq-mean-token-mean": 2,  # the third response is empty
        "seq-mean-token-sum": 2,
        "seq-mean-token-sum-norm": 3 * 600,
    }[mode]
    assert ref.normalizer.item() == float(want)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    # packed: the three responses back to back in one row, told apart by the sequence index (the empty one counted)
    seq = torch.arange(3)[:, None].expand(mask.shape).reshape(1, -1)
    logp = batch["logp"].reshape(1, -1).clone().requires_grad_(True)
    flat = {k: batch[k].reshape(1, -1) for k in ("old_logp", "advantages", "mask", "is_weight")}
    kw |= {"is_weight": flat["is_weight"], "seq_index": seq}
    out = policy_loss_fn("fused")(logp, flat["old_logp"], flat["advantages"], flat["mask"], normalizer=normalizer, **kw)
    (out.loss_sum / normalizer).backward()
    torch.testing.assert_close(out.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
    assert out.normalizer.item() == ref.normalizer.item()
    torch.testing.assert_close(logp.grad.reshape(mask.shape), ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("est", KL_ESTIMATORS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_kl_term_through_the_kernel_equals_the_reference(est, mode, seed):
    """With a reference policy the kernel adds kl_coef x k per token (weighted per response in seq-mean-token-mean,
    never by the truncated-IS weight): loss, divisor, the KL statistics and the gradient, fused into the forward pass
    and recomputed in backward, equal the reference's; d past +-20 and k3 past its clamp included."""
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(g, 3, 555, adv_per_token=True, with_isw=True)
    mask = batch["mask"]
    ref_logp = batch["old_logp"].clone() + torch.randn(mask.shape, generator=g) * 0.7
    ref_logp[0, :3] = batch["logp"][0, :3] + torch.tensor([3.0, 25.0, -25.0])
    ref_logp[~mask] = float("nan")  # padding must not matter
    kw = dict(dual_clip_c=DUAL_C, is_weight=batch["is_weight"], loss_agg_mode=mode, max_response_length=600)
    kw |= dict(ref_logp=ref_logp, kl_coef=0.3, kl_estimator=est)
    normalizer = loss_normalizer(mask.bool().sum(1), mode, 600)
    results = {}
    for impl, norm in (("fused", normalizer), ("fused_separate", None), ("reference", None)):
        logp = batch["logp"].clone().requires_grad_(True)
        out = policy_loss_fn(impl.split("_")[0])(
            logp, batch["old_logp"], batch["advantages"], mask, normalizer=norm, **kw
        )
        (out.loss_sum / normalizer).backward()
        results[impl] = (out, logp.grad)
    ref, ref_grad = results["reference"]
    assert float(ref.stats["kl_sum"]) != 0.0 and float(ref.stats["kl_loss_sum"]) != 0.0
    for impl in ("fused", "fused_separate"):
        out, grad = results[impl]
        torch.testing.assert_close(out.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
        assert out.normalizer.item() == ref.normalizer.item()
        for k in ("kl_sum", "kl_loss_sum", "approx_kl_sum", "tokens"):
            torch.testing.assert_close(out.stats[k], ref.stats[k], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_a_bad_kl_input_is_a_clear_error(seed):
    batch = make_batch(torch.Generator().manual_seed(seed), 2, 40)
    args = (batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        fused_policy_loss(*args, ref_logp=batch["logp"], kl_estimator="k4")
    with pytest.raises(ValueError, match=r"ref_logp \(2, 39\) must be \[B, T\]"):
        fused_policy_loss(*args, ref_logp=batch["logp"][:, 1:])
