"""DAPO math against float64 references written out here, with fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm.advantages import group_advantages
from megatron_dapo.algorithm.filters import informative_groups
from megatron_dapo.algorithm.kl import kl_estimate, kl_penalized_rewards
from megatron_dapo.algorithm.overlong import excess_overlong_penalty, overlong_filter_mask, soft_overlong_punishment
from megatron_dapo.algorithm.policy_loss import loss_metrics, loss_normalizer, policy_loss, reduce_stats
from megatron_dapo.choices import KL_ESTIMATORS, LOSS_AGG_MODES

# ------------------------------------------------------------------ references (float64, plain Python)


def ref_advantages(row: list[float], eps: float = 1e-6) -> list[float]:
    g = len(row)
    mean = sum(row) / g
    std = math.sqrt(sum((x - mean) ** 2 for x in row) / (g - 1))
    return [(x - mean) / (std + eps) for x in row]


def ref_overlong(length: int, l_max: int, l_cache: int, factor: float) -> float:
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache * factor
    return -factor


def ref_token(lp, olp, a, eps_low, eps_high, c=None, w=1.0, clamp=20.0):
    """Piecewise form (seed 001's): A>=0 clips only above, A<0 only below. Returns (loss, dloss/dlogp)."""
    d = lp - olp
    clamped = abs(d) > clamp
    r = math.exp(max(-clamp, min(clamp, d)))
    if a >= 0:
        loss = -a * min(r, 1 + eps_high)
        grad = -a * r if r < 1 + eps_high else 0.0
    else:
        loss = -a * max(r, 1 - eps_low)
        grad = -a * r if r > 1 - eps_low else 0.0
        if c is not None and loss > -a * c:
            loss, grad = -a * c, 0.0
    if clamped:
        grad = 0.0
    return w * loss, w * grad


def ref_kl(lp, rlp, est, clamp=20.0):
    """One token's KL estimate to the reference and its derivative in lp, written out (d = rlp - lp, clamped)."""
    d = max(-clamp, min(clamp, rlp - lp))
    if est == "k1":
        k, dk = -d, 1.0
    elif est == "k2":
        k, dk = d * d / 2, -d
    else:
        k3 = math.exp(d) - 1 - d
        k, dk = max(-10.0, min(10.0, k3)), (1 - math.exp(d) if -10 <= k3 <= 10 else 0.0)
    return k, (0.0 if abs(rlp - lp) > clamp else dk)


def ref_policy_loss(
    lp, olp, adv, mask, eps_low, eps_high, c=None, w=None, mode="token-mean", max_len=None, rlp=None, beta=0.0, est="k3"
):
    """Returns (loss_sum, normalizer, dL/dlogp of loss_sum/normalizer, tol): float64, and the absolute tolerance of a
    float32 loss_sum (its terms cancel, so it is relative to the sum of their magnitudes, not to loss_sum).
    mode: the four aggregations, as verl defines them (max_len: seq-mean-token-sum-norm's constant).
    rlp: reference logprobs: each token's loss gains beta x ref_kl (not weighted by w)."""
    b, t = len(lp), len(lp[0])
    losses = [[0.0] * t for _ in range(b)]
    grads = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if mask[i][j]:
                wij = 1.0 if w is None else w[i][j]
                losses[i][j], grads[i][j] = ref_token(lp[i][j], olp[i][j], adv[i], eps_low, eps_high, c, wij)
                if rlp is not None:
                    k, dk = ref_kl(lp[i][j], rlp[i][j], est)
                    losses[i][j] += beta * k
                    grads[i][j] += beta * dk
    tol = 1e-6 * max(1.0, sum(abs(x) for row in losses for x in row))
    lens = [sum(1 for m in row if m) for row in mask]
    if mode == "token-mean":  # every valid token of the batch weighs the same
        n = sum(lens)
        total = sum(map(sum, losses))
        scale = [[1.0 / n if n else 0.0] * t for _ in range(b)]
    elif mode == "seq-mean-token-mean":  # the mean over responses of their token means
        n = sum(1 for k in lens if k)
        total = sum(sum(losses[i]) / lens[i] for i in range(b) if lens[i])
        scale = [[1.0 / (lens[i] * n) if lens[i] else 0.0] * t for i in range(b)]
    elif mode == "seq-mean-token-sum":  # the mean over responses of their token sums
        n = sum(1 for k in lens if k)
        total = sum(map(sum, losses))
        scale = [[1.0 / n if n else 0.0] * t for _ in range(b)]
    else:  # seq-mean-token-sum-norm (Dr. GRPO): token sums over every response x the length limit
        n = b * max_len
        total = sum(map(sum, losses))
        scale = [[1.0 / n] * t for _ in range(b)]
    grad = [[grads[i][j] * scale[i][j] for j in range(t)] for i in range(b)]
    return total, float(n), grad, tol


CLIP_BOUNDS = (0.8, 1.28, 3.0, 10.0)
"""The ratios where some test's loss changes branch: 1 - eps_low, 1 + eps_high (the defaults), dual clip c = 3 and 10."""


def near_bound(logp: torch.Tensor, old_logp: torch.Tensor, rel: float = 1e-4) -> torch.Tensor:
    """[B, T] bool: tokens whose ratio lies within rel of a clip bound, where float32 and float64 may take different
    branches (one float32 ulp there flips a clip count and a gradient between r*A and 0)."""
    r = torch.exp(logp.double() - old_logp.double())
    return torch.stack([(r / b - 1).abs() < rel for b in CLIP_BOUNDS]).any(dim=0)


def random_batch(seed: int, b=6, t=23, spread=0.4):
    """float64 logp, old_logp [b, t], advantages [b] and a mask [b, t] (80% valid) drawn from seed; tokens within
    rounding of a clip bound are masked out (near_bound), so the float64 reference and float32 agree on every branch."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    old_logp = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.8) & ~near_bound(logp, old_logp)
    return logp, old_logp, adv, mask


def run_loss(logp, old_logp, adv, mask, **kw):
    lp = logp.clone().float().requires_grad_(True)
    out = policy_loss(lp, old_logp.float(), adv.float(), mask, **kw)
    (out.loss_sum / out.normalizer.clamp(min=1)).backward()
    out.loss_sum = out.loss_sum.detach()
    return out, lp.grad


# ------------------------------------------------------------------ advantages


def test_group_advantages_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(7, 16, generator=g, dtype=torch.float64).round()
    rewards += torch.rand(7, 16, generator=g, dtype=torch.float64) * 0.3
    got = group_advantages(rewards)
    assert got.dtype == torch.float32
    for i in range(7):
        assert got[i].tolist() == pytest.approx(ref_advantages(rewards[i].tolist()), rel=1e-5, abs=1e-5)


def test_group_advantages_edge_cases():
    same = torch.full((3, 4), 0.7)
    assert torch.equal(group_advantages(same), torch.zeros(3, 4))  # no signal, no NaN
    two = group_advantages(torch.tensor([[1.0, -1.0]]))
    assert two.tolist()[0] == pytest.approx(ref_advantages([1.0, -1.0]), rel=1e-6)
    assert group_advantages(torch.zeros(0, 16)).shape == (0, 16)
    bf16 = group_advantages(torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.bfloat16))
    assert bf16.dtype == torch.float32
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.ones(8))


@pytest.mark.parametrize("group_size", [2, 5, 7, 16])
def test_group_advantages_are_zero_for_equal_rewards_that_float32_cannot_hold(group_size):
    """Equal shaped rewards (a score plus an overlong penalty like -1/3) give exactly 0, never rounding / eps."""
    g = torch.Generator().manual_seed(group_size)
    values = torch.rand(64, 1, generator=g, dtype=torch.float64) * 2 - 1 - torch.tensor(1 / 3, dtype=torch.float64)
    rewards = values.expand(64, group_size).clone()
    got = group_advantages(rewards)
    assert got.dtype == torch.float32 and torch.equal(got, torch.zeros(64, group_size))
    # One response apart by 1e-9 is a real (tiny) signal: advantages match the float64 formula.
    rewards[:, 0] += 1e-9
    got = group_advantages(rewards)
    for i in range(0, 64, 9):
        assert got[i].tolist() == pytest.approx(ref_advantages(rewards[i].tolist()), rel=1e-5, abs=1e-6)


def test_dr_grpo_advantages_are_the_centred_rewards(seed):
    """adv_norm none (Dr. GRPO): A = R - mean, no division, against float64 written out; equal rewards exactly 0."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(6, 8, generator=g, dtype=torch.float64) * 3
    rewards[2] = 0.4  # equal rewards
    rewards[3, :4], rewards[3, 4:] = 1.0, -1.0  # the std of this group is not 1: a kept division would show
    got = group_advantages(rewards, norm="none")
    assert got.dtype == torch.float32
    for i in range(6):
        row = rewards[i].tolist()
        assert got[i].tolist() == pytest.approx([x - sum(row) / 8 for x in row], rel=1e-6, abs=1e-7)
    assert torch.equal(got[2], torch.zeros(8))
    assert got[3].tolist() == [1.0] * 4 + [-1.0] * 4  # std-normalised: +-0.935
    with pytest.raises(ValueError, match="norm='mean', expected one of"):
        group_advantages(rewards, norm="mean")


# ------------------------------------------------------------------ overlong


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_soft_overlong_punishment_paper_formula(factor, seed):
    l_max, l_cache = 20480, 4096
    lengths = [0, 1, 16383, 16384, 16385, 18432, 20479, 20480, 20481, 30000]
    lengths += torch.randint(0, 25000, (50,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = soft_overlong_punishment(torch.tensor(lengths), l_max, l_cache, factor)
    assert got.dtype == torch.float32
    for n, v in zip(lengths, got.tolist()):
        assert v == pytest.approx(ref_overlong(n, l_max, l_cache, factor), abs=1e-6), n
    # the paper's landmarks: free up to 16384, -0.5 half way into the buffer, -1 at and past L_max
    assert soft_overlong_punishment(torch.tensor([16384, 18432, 20480, 25000]), l_max, l_cache).tolist() == [
        0.0,
        -0.5,
        -1.0,
        -1.0,
    ]


def test_soft_overlong_punishment_bad_input():
    with pytest.raises(ValueError, match="overlong_buffer_len=5000"):
        soft_overlong_punishment(torch.tensor([1]), 4096, 5000)
    with pytest.raises(ValueError, match=">= 0"):
        soft_overlong_punishment(torch.tensor([-1]), 4096, 1024)
    assert soft_overlong_punishment(torch.tensor([], dtype=torch.long), 10, 5).shape == (0,)


def test_excess_overlong_penalty_is_the_seed_notes_formula(seed):
    """The seed notes: reward - penalty_weight x (len - max_len) / max_len past max_len (0.1 there), 0 before."""
    soft_max = 1000
    lengths = [0, 1, 999, 1000, 1001, 1500, 2000, 4096]
    lengths += torch.randint(0, 4096, (50,), generator=torch.Generator().manual_seed(seed)).tolist()
    for factor in (0.1, 1.0):
        got = excess_overlong_penalty(torch.tensor(lengths), soft_max, factor)
        assert got.dtype == torch.float32
        want = [-factor * (n - soft_max) / soft_max if n > soft_max else 0.0 for n in lengths]
        assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)  # float32 of the float64 value
    # landmarks: nothing at the soft maximum, -0.05 at 1.5x, -0.1 at twice it, and no floor
    assert excess_overlong_penalty(torch.tensor([1000, 1500, 2000, 4000]), 1000).tolist() == pytest.approx(
        [0.0, -0.05, -0.1, -0.3]
    )
    assert excess_overlong_penalty(torch.tensor([], dtype=torch.long), 10).shape == (0,)
    with pytest.raises(ValueError, match="soft_max=0 must be >= 1"):
        excess_overlong_penalty(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match=">= 0"):
        excess_overlong_penalty(torch.tensor([-1]), 10)


def test_overlong_filter_mask():
    assert overlong_filter_mask(torch.tensor([True, False, True])).tolist() == [False, True, False]


# ------------------------------------------------------------------ informative groups


def test_informative_groups_on_raw_correctness(seed):
    g = torch.Generator().manual_seed(seed)
    correct = torch.rand(50, 8, generator=g) < torch.rand(50, 1, generator=g)  # per-group success rates, many all/none
    correct[0] = True
    correct[1] = False
    got = informative_groups(correct).tolist()
    want = [0 < sum(row) < 8 for row in correct.tolist()]
    assert got == want
    assert got[0] is False and got[1] is False
    with pytest.raises(ValueError):
        informative_groups(torch.ones(4, dtype=torch.bool))


# ------------------------------------------------------------------ policy loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_policy_loss_matches_reference(mode, dual_clip_c, seed):
    logp, old_logp, adv, mask = random_batch(seed, spread=1.0)
    mask[2] = False  # an overlong-filtered response: no token, no share of the seq modes' count, still Dr. GRPO's
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=dual_clip_c, loss_agg_mode=mode, max_response_length=50)
    out, grad = run_loss(logp, old_logp, adv, mask, **kw)
    total, n, ref_grad, tol = ref_policy_loss(
        logp.tolist(), old_logp.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual_clip_c, mode=mode, max_len=50
    )
    assert float(out.normalizer) == n
    assert float(out.loss_sum) == pytest.approx(total, rel=0, abs=tol)
    torch.testing.assert_close(grad.double(), torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def kl_reference_logp(logp: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, T] float64 reference logprobs near logp, some far: d = ref - logp past k3's clamp (> ~2.53) and past
    the +-20 clamp of d, both ways."""
    g = torch.Generator().manual_seed(seed + 1)
    ref = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.7
    ref[0, :3] = logp[0, :3] + torch.tensor([3.0, 25.0, -25.0], dtype=torch.float64)
    return ref


@pytest.mark.parametrize("est", KL_ESTIMATORS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_the_kl_loss_term_matches_float64_written_out(est, mode, seed):
    """policy_loss with a reference: loss, divisor, gradient and the two KL statistics against ref_policy_loss with
    the KL term written out per token, in every aggregation; the truncated-IS weight leaves the KL term alone."""
    logp, old_logp, adv, mask = random_batch(seed, spread=1.0)
    mask[2] = False
    mask[0, :3] = True  # the clamped tokens count
    ref = kl_reference_logp(logp, seed)
    g = torch.Generator().manual_seed(seed + 2)
    w = torch.rand(logp.shape, generator=g, dtype=torch.float64) * 2
    beta = 0.3
    kw = dict(eps_low=0.2, eps_high=0.28, loss_agg_mode=mode, max_response_length=50, kl_coef=beta, kl_estimator=est)
    out, grad = run_loss(logp, old_logp, adv, mask, is_weight=w.float(), ref_logp=ref.float(), **kw)
    lists = [x.tolist() for x in (logp, old_logp, adv, mask)]
    total, n, ref_grad, tol = ref_policy_loss(
        *lists, 0.2, 0.28, w=w.tolist(), mode=mode, max_len=50, rlp=ref.tolist(), beta=beta, est=est
    )
    assert float(out.normalizer) == n
    assert float(out.loss_sum) == pytest.approx(total, rel=0, abs=tol + 1e-5)
    torch.testing.assert_close(grad.double(), torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    ks = [[ref_kl(a, r, est)[0] for a, r in zip(*rows)] for rows in zip(logp.tolist(), ref.tolist())]
    kl_sum = sum(k for row, m in zip(ks, mask.tolist()) for k, v in zip(row, m) if v)
    assert float(out.stats["kl_sum"]) == pytest.approx(kl_sum, rel=1e-5, abs=1e-5)
    no_pg, _ = run_loss(logp, logp, torch.zeros_like(adv), mask, ref_logp=ref.float(), **kw)  # the KL term alone
    zero = torch.zeros_like(adv).tolist()
    kl_total, _, _, kl_tol = ref_policy_loss(
        lists[0], lists[0], zero, lists[3], 0.2, 0.28, mode=mode, max_len=50, rlp=ref.tolist(), beta=beta, est=est
    )  # float32 sums of terms up to 20: a fixed 1e-6 failed 0.3% of seeds
    assert float(out.stats["kl_loss_sum"]) == pytest.approx(kl_total, rel=0, abs=kl_tol)
    assert float(no_pg.loss_sum) == pytest.approx(kl_total, rel=0, abs=kl_tol)


@pytest.mark.parametrize("est", KL_ESTIMATORS)
def test_kl_term_edge_cases(est, seed):
    """The policy as its own reference: KL exactly 0, and for k2 and k3 exactly no gradient from it (k1's per-token
    gradient is kl_coef, zero only in expectation: test_each_kl_estimator_s_expected_gradient_...). All masked: 0
    and no NaN. One token: its written-out value. kl_coef 0 with a reference: the plain loss, bit for bit."""
    logp, old_logp, adv, mask = random_batch(seed)
    kw = dict(kl_coef=0.5, kl_estimator=est)
    same, grad = run_loss(logp, old_logp, torch.zeros_like(adv), mask, ref_logp=logp.float(), **kw)
    assert float(same.stats["kl_sum"]) == 0.0 and float(same.loss_sum) == 0.0
    want = 0.5 / float(mask.sum()) if est == "k1" else 0.0
    assert torch.where(mask, grad, 0.0).unique().tolist() == pytest.approx(sorted({0.0, want}), rel=1e-6)
    none, grad = run_loss(logp, old_logp, adv, torch.zeros_like(mask), ref_logp=logp.float() - 3, **kw)
    assert float(none.loss_sum) == 0.0 and (grad == 0).all() and float(none.stats["kl_sum"]) == 0.0
    one = torch.zeros_like(mask)
    one[1, 4] = True
    single, grad = run_loss(logp, logp, torch.zeros_like(adv), one, ref_logp=logp.float() + 0.5, **kw)
    k, dk = ref_kl(float(logp[1, 4].float()), float(logp[1, 4].float()) + 0.5, est)
    assert float(single.loss_sum) == pytest.approx(0.5 * k, rel=1e-6) and float(grad[1, 4]) == pytest.approx(0.5 * dk)
    plain, g0 = run_loss(logp, old_logp, adv, mask)
    off, g1 = run_loss(logp, old_logp, adv, mask, ref_logp=logp.float() - 1, kl_coef=0.0, kl_estimator=est)
    assert torch.equal(plain.loss_sum, off.loss_sum) and torch.equal(g0, g1)


def test_policy_loss_stats_match_reference(seed):
    logp, old_logp, adv, mask = random_batch(seed, b=8, t=40, spread=1.5)
    out = policy_loss(logp.float(), old_logp.float(), adv.float(), mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    low = high = dual = 0
    ratios, kls = [], []
    for i in range(8):
        for j in range(40):
            if not mask[i, j]:
                continue
            r = math.exp(float(logp[i, j] - old_logp[i, j]))
            a = float(adv[i])
            low += a < 0 and r < 0.8
            high += a > 0 and r > 1.28
            dual += a < 0 and r > 3.0
            ratios.append(r)
            kls.append(r - 1 - math.log(r))
    s = out.stats
    assert (float(s["clip_low"]), float(s["clip_high"]), float(s["clip_dual"])) == (low, high, dual)
    assert float(s["tokens"]) == len(ratios)
    assert float(s["ratio_sum"]) == pytest.approx(sum(ratios), rel=1e-5)
    assert float(s["ratio_max"]) == pytest.approx(max(ratios), rel=1e-5)
    assert float(s["approx_kl_sum"]) == pytest.approx(sum(kls), rel=1e-4)
    m = loss_metrics(s)
    assert m["actor/clip_frac_low"] == pytest.approx(low / len(ratios))
    assert m["actor/ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)


def test_decoupled_clip_is_asymmetric():
    # ratio 0.75 < 1 - 0.2 is clipped low; ratio 1.25 < 1 + 0.28 is not clipped high.
    logp = torch.log(torch.tensor([[0.75, 1.25]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    neg, grad_neg = run_loss(logp, old, torch.tensor([-1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert float(neg.stats["clip_low"]) == 1.0
    assert grad_neg[0, 0] == 0.0 and grad_neg[0, 1] != 0.0  # the clipped token carries no gradient
    pos, grad_pos = run_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert float(pos.stats["clip_high"]) == 0.0 and (grad_pos != 0).all()
    sym, grad_sym = run_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert float(sym.stats["clip_high"]) == 1.0 and grad_sym[0, 1] == 0.0


def test_policy_loss_edge_cases(seed):
    logp, old_logp, adv, _ = random_batch(seed, b=3, t=5)
    # all masked, with garbage in the padding: zero loss, zero gradient, no NaN
    logp[0, 0] = float("nan")
    old_logp[1, 1] = float("-inf")
    none = torch.zeros(3, 5, dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean"):
        out, grad = run_loss(logp, old_logp, adv, none, loss_agg_mode=mode)
        assert float(out.loss_sum) == 0.0 and float(out.normalizer) == 0.0
        assert torch.equal(grad, torch.zeros_like(grad))
    assert loss_metrics(out.stats)["actor/ratio_mean"] == 0.0
    # padding garbage next to valid tokens stays out of the gradient
    some = torch.zeros(3, 5, dtype=torch.bool)
    some[2, :3] = True
    out, grad = run_loss(logp, old_logp, adv, some)
    assert torch.isfinite(grad).all() and float(out.normalizer) == 3.0
    # one token
    one = torch.zeros(3, 5, dtype=torch.bool)
    one[1, 4] = True
    out, grad = run_loss(logp, old_logp, adv, one)
    want_loss, want_grad = ref_token(float(logp[1, 4]), float(old_logp[1, 4]), float(adv[1]), 0.2, 0.28)
    assert float(out.loss_sum) == pytest.approx(want_loss, rel=1e-5)
    assert float(grad[1, 4]) == pytest.approx(want_grad, rel=1e-5)
    assert int((grad != 0).sum()) <= 1
    # all advantages zero
    logp[0, 0], old_logp[1, 1] = -1.0, -1.0
    out, grad = run_loss(logp, old_logp, torch.zeros(3, dtype=torch.float64), torch.ones(3, 5, dtype=torch.bool))
    assert float(out.loss_sum) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("delta", [50.0, -50.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_log_ratios_stay_finite(delta, sign):
    old = torch.full((2, 3), -60.0)
    logp = old + delta
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([sign, sign])
    for c in (None, 10.0):
        out, grad = run_loss(logp, old, adv, mask, dual_clip_c=c)
        assert torch.isfinite(out.loss_sum) and torch.isfinite(grad).all()
        assert torch.isfinite(out.stats["ratio_max"]) and torch.isfinite(out.stats["approx_kl_sum"])
        want, _ = ref_token(delta, 0.0, sign, 0.2, 0.28, c)
        assert float(out.loss_sum) / 6 == pytest.approx(want, rel=1e-4)


def test_bf16_inputs_computed_in_float32(seed):
    logp, old_logp, adv, mask = random_batch(seed)
    lp16 = logp.bfloat16().requires_grad_(True)
    mask &= ~near_bound(lp16.detach(), old_logp.bfloat16())  # rounding moved the ratios: away from the bounds again
    out = policy_loss(lp16, old_logp.bfloat16(), adv.bfloat16(), mask)
    assert out.loss_sum.dtype == torch.float32
    (out.loss_sum / out.normalizer).backward()
    assert lp16.grad.dtype == torch.bfloat16
    # the reference on the bf16-rounded inputs: only input rounding differs
    total, n, ref_grad, tol = ref_policy_loss(
        lp16.detach().double().tolist(),
        old_logp.bfloat16().double().tolist(),
        adv.bfloat16().double().tolist(),
        mask.tolist(),
        0.2,
        0.28,
    )
    assert float(out.loss_sum.detach()) == pytest.approx(total, rel=0, abs=tol)
    # the float32 gradient rounded once to bf16 (8 significant bits): within half a bf16 ulp, 2^-9, of the reference
    torch.testing.assert_close(lp16.grad.double(), torch.tensor(ref_grad, dtype=torch.float64), rtol=2**-8, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_aggregation_is_global_over_micro_batches(mode, seed):
    """Summing loss_sum and normalizer over micro-batches (or data-parallel ranks: the same sums) equals the
    one-batch loss, gradients too; the divisor is loss_normalizer's rule on the whole mini-batch, as the trainer
    computes it from its samples. With a KL term to a reference, whose share splits the same way."""
    logp, old_logp, adv, mask = random_batch(seed, b=8, t=30)
    mask[3] = False  # a fully masked response changes the per-micro-batch counts
    ref = kl_reference_logp(logp, seed).float()
    kw = dict(dual_clip_c=3.0, loss_agg_mode=mode, max_response_length=40, kl_coef=0.2, kl_estimator="k3")
    whole, whole_grad = run_loss(logp, old_logp, adv, mask, ref_logp=ref, **kw)
    assert whole.normalizer == loss_normalizer(mask.sum(1), mode, 40)
    lp = logp.clone().float().requires_grad_(True)
    parts = [
        policy_loss(lp[s], old_logp[s].float(), adv[s].float(), mask[s], ref_logp=ref[s], **kw)
        for s in (slice(0, 1), slice(1, 5), slice(5, 8))
    ]
    global_count = sum(p.normalizer for p in parts)
    assert global_count == whole.normalizer
    sum(p.loss_sum / global_count for p in parts).backward()
    torch.testing.assert_close(lp.grad, whole_grad, rtol=1e-6, atol=1e-8)
    merged = reduce_stats([p.stats for p in parts])
    assert float(whole.stats["kl_loss_sum"]) > 0
    for k, v in whole.stats.items():
        assert float(merged[k]) == pytest.approx(float(v), rel=1e-6), k


def test_token_mean_weighs_long_responses_more_than_seq_mean():
    """The paper's point: per-sample averaging gives a short response's tokens more weight."""
    logp = torch.full((2, 9), -1.0)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, :1] = True  # short: 1 token
    mask[1, :9] = True  # long: 9 tokens
    adv = torch.tensor([1.0, 1.0])
    _, g_tok = run_loss(logp, logp, adv, mask, loss_agg_mode="token-mean")
    _, g_seq = run_loss(logp, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    # ratio 1, A = 1: d(-r)/dlogp = -1 per token, then the aggregation's weights
    assert float(g_tok[0, 0]) == pytest.approx(-1 / 10) and float(g_tok[1, 0]) == pytest.approx(-1 / 10)
    assert float(g_seq[0, 0]) == pytest.approx(-1 / 2) and float(g_seq[1, 0]) == pytest.approx(-1 / 18)
    long_share_tok = float(g_tok[1].sum() / g_tok.sum())
    long_share_seq = float(g_seq[1].sum() / g_seq.sum())
    assert long_share_tok == pytest.approx(0.9) and long_share_seq == pytest.approx(0.5)


def test_policy_loss_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(x, x, torch.zeros(2), x.bool(), loss_agg_mode="sum")
    with pytest.raises(ValueError, match=r"must all be the same \[B, T\]"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), x.bool())


# ------------------------------------------------------------------ KL to a reference policy


def test_kl_estimators_match_their_float64_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    logp[0, 0], ref[0, 0] = -50.0, -1.0  # d = 49: clamped to 20, and k3 to 10
    logp[0, 1], ref[0, 1] = -1.0, -60.0  # d = -59: clamped to -20
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(logp.float(), ref.float(), est)
        assert got.dtype == torch.float32 and got.shape == (6, 9)
        for i in range(6):
            for j in range(9):
                d = max(-20.0, min(20.0, float(ref[i, j]) - float(logp[i, j])))
                want = {"k1": -d, "k2": d * d / 2, "k3": max(-10.0, min(10.0, math.exp(d) - 1 - d))}[est]
                assert float(got[i, j]) == pytest.approx(want, rel=1e-5, abs=1e-6), (est, i, j)
    assert float(kl_estimate(logp, ref, "k3")[0, 0]) == 10.0  # the clamp, not exp(20)
    assert kl_estimate(logp, ref, "k2").dtype == torch.float64


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_of_a_policy_to_itself_is_zero(est, seed):
    logp = (-torch.rand(4, 7, generator=torch.Generator().manual_seed(seed)) * 3).requires_grad_(True)
    k = kl_estimate(logp, logp.detach().clone(), est)
    assert torch.equal(k, torch.zeros_like(k))
    k.sum().backward()
    # k2 and k3 are flat at d = 0; k1 = logp - ref_logp has slope 1 per token (zero only in expectation: below)
    assert torch.equal(logp.grad, torch.full_like(logp, 1.0 if est == "k1" else 0.0))
    empty = kl_estimate(torch.zeros(0, 3), torch.zeros(0, 3), est)
    assert empty.shape == (0, 3)


def test_kl_in_the_reward_lowers_each_response_s_reward_by_its_kl_then_the_group_normalises(seed):
    """R - kl_coef x sum of k per response, then the group's advantages, against float64 written out: of two equally
    rewarded responses the one further from the reference gets the lower advantage, and a group whose rewards are
    equal gets advantages from its KL alone (the sampler still decides informative groups on correctness)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (5, 4), generator=g).double()
    rewards[0] = 1.0  # all correct: zero advantages without KL
    kl_sums = torch.rand(5, 4, generator=g, dtype=torch.float64) * 3
    got = group_advantages(kl_penalized_rewards(rewards, kl_sums, 0.1))
    for i in range(5):
        shaped = [r - 0.1 * k for r, k in zip(rewards[i].tolist(), kl_sums[i].tolist())]
        assert got[i].tolist() == pytest.approx(ref_advantages(shaped), rel=1e-5, abs=1e-6)
    assert got[0].argmin() == kl_sums[0].argmax() and got[0].abs().sum() > 0
    with pytest.raises(ValueError, match="kl_sums"):
        kl_penalized_rewards(rewards, kl_sums[:, :3], 0.1)


def test_kl_estimate_bad_input():
    with pytest.raises(ValueError, match="estimator='k4', expected one of"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"logp \(2,\) and ref_logp \(3,\) must match"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")


def test_each_kl_estimator_s_expected_gradient_on_a_categorical_enumerated_in_full(seed):
    """pi = softmax(theta) over 6 outcomes, every outcome weighted by its probability (the exact expectation of a
    sampled estimate). As a loss term (gradient through logp, samples fixed): k1 -> 0, k2 -> grad KL(pi || ref),
    k3 -> grad KL(ref || pi). As a reward penalty (score function: k x grad logp): k1 -> grad KL(pi || ref), k3
    biased. A value-only test would pass a k1 loss term that does nothing."""
    g = torch.Generator().manual_seed(seed)
    # logits within +-0.5: |d| <= 2, so k3 <= e^2 - 3 stays below its clamp (10), where its gradient would be cut
    theta0 = torch.rand(6, generator=g, dtype=torch.float64) - 0.5
    ref_logp = torch.log_softmax(torch.rand(6, generator=g, dtype=torch.float64) - 0.5, 0)

    def grad(f):
        theta = theta0.clone().requires_grad_(True)
        f(theta).backward()
        return theta.grad

    def exact_reverse(theta):  # KL(pi || ref)
        logp = torch.log_softmax(theta, 0)
        return (logp.exp() * (logp - ref_logp)).sum()

    def exact_forward(theta):  # KL(ref || pi)
        return (ref_logp.exp() * (ref_logp - torch.log_softmax(theta, 0))).sum()

    def as_loss(est):
        def f(theta):
            logp = torch.log_softmax(theta, 0)
            return (logp.exp().detach() * kl_estimate(logp, ref_logp, est)).sum()

        return f

    def as_reward(est):
        def f(theta):
            logp = torch.log_softmax(theta, 0)
            return (logp.exp().detach() * kl_estimate(logp, ref_logp, est).detach() * logp).sum()

        return f

    zero, reverse, forward = torch.zeros(6, dtype=torch.float64), grad(exact_reverse), grad(exact_forward)
    assert reverse.abs().max() > 1e-3 and (reverse - forward).abs().max() > 1e-6  # distinguishable at 1e-12
    torch.testing.assert_close(grad(as_loss("k1")), zero, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad(as_loss("k2")), reverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad(as_loss("k3")), forward, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad(as_reward("k1")), reverse, rtol=1e-10, atol=1e-12)
    assert (grad(as_reward("k3")) - reverse).abs().max() > 1e-3  # k3 in the reward is biased
