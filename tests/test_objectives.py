"""The objectives (dapo, gspo, gspo_token, cispo) and the rollout-correction modes against their formulas written out
in float64 here, one response at a time, with fresh random inputs: responses of different lengths, an all-masked
one, ratios beyond every bound, packed rows, micro-batch splits and bad input. Then an objective registered here
alone (docs/training.md's example of adding one), trained through policy_loss, an optimizer step and the config."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megatron_dapo.algorithm import registry
from megatron_dapo.algorithm.losses import policy_loss_fn, resolve_loss_impl
from megatron_dapo.algorithm.mismatch import mismatch_metrics, rollout_mismatch_sums
from megatron_dapo.algorithm.policy_loss import policy_loss
from megatron_dapo.algorithm.registry import OBJECTIVES, Correction, Flags, TokenLossInput
from megatron_dapo.algorithm.rollout_correction import correction_weight
from megatron_dapo.choices import LOSS_AGG_MODES, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from megatron_dapo.config import ConfigError, load_config

BOUNDS = {"dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (None, 4.0)}
MAX_LEN = 12  # seq-mean-token-sum-norm's constant

# ------------------------------------------------------------------ the formulas, one response at a time


def ref_token_losses(objective: str, lp: torch.Tensor, olp: torch.Tensor, a: float, low, high) -> torch.Tensor:
    """One response's token losses, float64; lp: [n] differentiable, olp: [n]."""
    d = (lp - olp).clamp(-20.0, 20.0)
    if objective == "dapo":
        r = torch.exp(d)
        return torch.maximum(-a * r, -a * r.clamp(1 - low, 1 + high))
    if objective == "cispo":
        w = torch.exp(d).detach().clamp(min=0.0 if low is None else 1 - low, max=1 + high)
        return -w * a * lp
    s = torch.exp(d.mean())  # GSPO eq. 7: the length-normalised sequence ratio
    if objective == "gspo_token":  # eq. 13: sg(s) pi(y_t) / sg(pi(y_t)); no gradient beyond the clamp, as above
        s = s.detach() * torch.exp(d - d.detach())
    else:
        s = s.expand(len(lp))
    return torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high))


def ref_objective(objective, responses, mode, weights=None) -> tuple[float, list[torch.Tensor]]:
    """loss_sum / normalizer and its gradient in each response's logprobs. responses: [(lp [n], olp [n], A, in_loss)];
    weights: per response [n] rollout-correction weights."""
    low, high = BOUNDS[objective]
    lps = [lp.detach().double().requires_grad_(True) for lp, *_ in responses]
    total = torch.zeros((), dtype=torch.float64)
    kept = [i for i, (lp, _, _, in_loss) in enumerate(responses) if in_loss and len(lp)]
    tokens = sum(len(responses[i][0]) for i in kept)
    for i in kept:
        _, olp, a, _ = responses[i]
        ls = ref_token_losses(objective, lps[i], olp.double(), a, low, high)
        if weights is not None:
            ls = ls * weights[i].double()
        total = total + (ls.mean() if mode == "seq-mean-token-mean" else ls.sum())
    divisor = {
        "token-mean": tokens,
        "seq-mean-token-mean": len(kept),
        "seq-mean-token-sum": len(kept),
        "seq-mean-token-sum-norm": len(responses) * MAX_LEN,
    }[mode]
    loss = total / max(divisor, 1)
    grads = torch.autograd.grad(loss, lps, allow_unused=True) if loss.requires_grad else [None] * len(lps)
    return float(loss.detach()), [
        torch.zeros(len(lp), dtype=torch.float64) if g is None else g for g, lp in zip(grads, lps)
    ]


# ------------------------------------------------------------------ inputs and layouts


def random_responses(seed: int, objective: str, n: int = 7) -> list:
    """n responses of 1-9 tokens, one out of the loss, one empty, ratios beyond both bounds and one huge one. Each
    response's tokens share an offset so GSPO's sequence ratios spread past its bounds; none within rounding of a
    bound (float32 and float64 would take different branches there)."""
    g = torch.Generator().manual_seed(seed)
    low, high = BOUNDS[objective]
    bounds = [1 + high] + ([1 - low] if low is not None else [])
    out = []
    for i in range(n):
        size = 0 if i == 3 else int(torch.randint(1, 10, (), generator=g))
        lp = -torch.rand(size, generator=g, dtype=torch.float64) * 4
        shift = float(torch.randn((), generator=g)) * (0.4 if objective.startswith("gspo") else 0.0)
        olp = lp + shift + torch.randn(size, generator=g, dtype=torch.float64) * 0.5
        if i == 0 and size:
            olp[0] = lp[0] - 30.0  # a ratio of e^30: its log is clamped at 20
        out.append([lp, olp, float(torch.randn((), generator=g)), i != 5])
    for r in out:  # away from every bound by 1e-3 (relative), token ratios and sequence ratios alike
        for _ in range(100):
            d = (r[0] - r[1]).clamp(-20, 20)
            ratios = torch.cat([torch.exp(d), torch.exp(d.mean()).reshape(1)]) if len(d) else d
            if not any(bool(((ratios / b - 1).abs() < 1e-3).any()) for b in bounds):
                break
            r[1] = r[1] + 0.01
    return [tuple(r) for r in out]


def padded(responses, with_index: bool = False):
    """[S, T] float32 inputs, one response a row (T: the longest + 1, so every row has padding)."""
    t = max(len(lp) for lp, *_ in responses) + 1
    s = len(responses)
    logp, old, mask = torch.zeros(s, t), torch.zeros(s, t), torch.zeros(s, t, dtype=torch.bool)
    adv = torch.tensor([a for _, _, a, _ in responses], dtype=torch.float32)
    for i, (lp, olp, _, in_loss) in enumerate(responses):
        logp[i, : len(lp)], old[i, : len(lp)], mask[i, : len(lp)] = lp, olp, in_loss
    return logp, old, adv, mask


def packed(responses, rows: int = 2):
    """The same responses back to back in `rows` rows, with advantages per token and the sequence index."""
    per_row = [responses[k::rows] for k in range(rows)]
    width = max(sum(len(lp) + 2 for lp, *_ in part) for part in per_row)
    logp, old, adv = torch.zeros(rows, width), torch.zeros(rows, width), torch.zeros(rows, width)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    seq = torch.full((rows, width), -1, dtype=torch.long)
    where = {}
    for k, part in enumerate(per_row):
        at = 1  # a prompt token first, one between responses: positions that are no response's
        for j, (lp, olp, a, in_loss) in enumerate(part):
            i, span = k + rows * j, slice(at, at + len(lp))
            logp[k, span], old[k, span], adv[k, span], mask[k, span], seq[k, span] = lp, olp, a, in_loss, i
            seq[k, at - 1] = -1
            where[i] = (k, span)
            at += len(lp) + 2
    return logp, old, adv, mask, seq, where


def run(objective, logp, old, adv, mask, mode, **kw):
    low, high = BOUNDS[objective]
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(lp, old, adv, mask, objective=objective, eps_low=low, eps_high=high, loss_agg_mode=mode,
                      max_response_length=MAX_LEN, **kw)  # fmt: skip
    loss = out.loss_sum / out.normalizer.clamp(min=1)
    (grad,) = torch.autograd.grad(loss, lp) if loss.requires_grad else (torch.zeros_like(lp),)
    return out, float(loss.detach()), grad


def assert_matches(objective, responses, mode, got_loss, grad_of, weights=None):
    want, grads = ref_objective(objective, responses, mode, weights)
    scale = max(1.0, abs(want))
    assert got_loss == pytest.approx(want, rel=0, abs=2e-6 * scale), (objective, mode)
    for i, g in enumerate(grads):
        torch.testing.assert_close(grad_of(i).double(), g, rtol=2e-5, atol=1e-7, msg=f"{objective} {mode} row {i}")


# ------------------------------------------------------------------ objectives


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("objective", POLICY_LOSSES)
def test_each_objective_matches_its_formula_padded_and_packed(objective, mode, seed):
    """Value and gradient of each objective under each aggregation, against the formula per response: one response
    a row, then the same responses packed two rows deep with a sequence index (GSPO's ratio and the per-response
    mean must stop at each response's end)."""
    responses = random_responses(seed, objective)
    out, loss, grad = run(objective, *padded(responses), mode)
    assert_matches(objective, responses, mode, loss, lambda i: grad[i, : len(responses[i][0])])
    # packed: a response of no tokens has no position to number (the trainer's divisor counts samples, not positions)
    some = [r for r in responses if len(r[0])]
    lp, old, adv, mask, seq, where = packed(some)
    _, loss2, grad2 = run(objective, lp, old, adv, mask, mode, seq_index=seq)
    assert_matches(objective, some, mode, loss2, lambda i: grad2[where[i]])


@pytest.mark.parametrize("objective", POLICY_LOSSES)
def test_the_objectives_clip_where_their_papers_do(objective, seed):
    """Beyond each bound: DAPO and GSPO give no gradient where the clip is the min's active branch, CISPO keeps every
    token's gradient with its weight capped; gspo clips whole responses, the others single tokens."""
    low, high = BOUNDS[objective]
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(2, 6, generator=g) - 0.5
    up = math.log(1 + high) + 0.5  # every token's ratio (and so each response's) above the upper bound
    old = lp - torch.tensor([[up], [-up]])  # row 0: r = e^up; row 1: r = e^-up, below 1 - low
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 6, dtype=torch.bool)
    out, _, grad = run(objective, lp, old, adv, mask, "token-mean")
    if objective == "cispo":  # capped at 1 + high, no lower bound: the weight is the ratio itself
        want = torch.stack([-torch.full((6,), 1 + high) / 12, torch.exp(torch.full((6,), -up)) / 12])
        torch.testing.assert_close(grad, want.float(), rtol=1e-5, atol=1e-8)
        assert float(out.stats["clip_high"]) == 6 and float(out.stats["clip_low"]) == 0
    else:
        assert float(grad.abs().max()) == 0.0
        assert float(out.stats["clip_high"]) == 6 and float(out.stats["clip_low"]) == 6
    inside = run(objective, lp, lp.clone(), adv, mask, "token-mean")[2]  # on-policy: r = 1, -A / tokens each
    torch.testing.assert_close(inside, -adv[:, None].expand(2, 6) / 12)


def test_gspo_takes_the_mean_of_log_ratios_and_gspo_token_parts_with_per_token_advantages(seed):
    """A long response whose every token has ratio 1.0002 stays inside GSPO's 4e-4 (a product of token ratios, or a
    sum of logs, would leave it); with per-token advantages gspo_token weighs each token's own gradient by its own
    advantage while gspo spreads the sequence's."""
    n = 200
    lp = -torch.rand(1, n, generator=torch.Generator().manual_seed(seed))
    old = lp - math.log(1.0002)
    mask = torch.ones(1, n, dtype=torch.bool)
    out, _, grad = run("gspo", lp, old, torch.tensor([1.0]), mask, "seq-mean-token-mean")
    assert float(out.stats["clip_high"]) == 0 and float(grad.abs().min()) > 0
    torch.testing.assert_close(out.stats["ratio_max"], torch.tensor(1.0002), rtol=1e-6, atol=0)
    adv = torch.linspace(-0.5, 1, n)[None]  # not summing to 0: the sequence's share of each gradient shows
    g_seq = run("gspo", lp, lp.clone(), adv, mask, "seq-mean-token-mean")[2]
    g_tok = run("gspo_token", lp, lp.clone(), adv, mask, "seq-mean-token-mean")[2]
    torch.testing.assert_close(g_tok, -adv / n)  # each token its own advantage
    torch.testing.assert_close(g_seq, -adv.sum(dim=1, keepdim=True).expand(1, n) / n**2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("objective", POLICY_LOSSES)
def test_micro_batches_add_up_to_the_whole_batch(objective, mode, seed):
    """Sums and normalisers of two micro-batches (or two data-parallel ranks) give the whole batch's loss and
    gradient, the correction weights and a KL term included."""
    responses = random_responses(seed, objective)
    logp, old, adv, mask = padded(responses)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed)) * 2
    ref = logp - 0.1
    kw = {"is_weight": w, "ref_logp": ref, "kl_coef": 0.3}
    _, whole, g_whole = run(objective, logp, old, adv, mask, mode, **kw)
    lp = logp.clone().requires_grad_(True)
    low, high = BOUNDS[objective]
    parts = [slice(0, 3), slice(3, None)]
    outs = [
        policy_loss(lp[p], old[p], adv[p], mask[p], objective=objective, eps_low=low, eps_high=high,
                    loss_agg_mode=mode, max_response_length=MAX_LEN, is_weight=w[p], ref_logp=ref[p], kl_coef=0.3)
        for p in parts
    ]  # fmt: skip
    norm = sum(o.normalizer for o in outs).clamp(min=1)
    loss = sum(o.loss_sum for o in outs) / norm
    (g,) = torch.autograd.grad(loss, lp)
    # float32 sums: the parts may nearly cancel (one +6.5, the other -6.5), so the rounding scales with their size
    size = float(sum(o.loss_sum.abs() for o in outs) / norm)
    assert float(loss) == pytest.approx(whole, rel=1e-6, abs=1e-7 + 1e-6 * size)
    torch.testing.assert_close(g, g_whole, rtol=1e-5, atol=1e-8)


def test_correction_weights_reach_each_objective(seed):
    """Per-token weights multiply every objective's token losses (value and gradient), as in the formula."""
    for objective in POLICY_LOSSES:
        responses = random_responses(seed, objective)
        logp, old, adv, mask = padded(responses)
        g = torch.Generator().manual_seed(seed + 1)
        weights = [torch.rand(len(lp), generator=g) * 2 for lp, *_ in responses]
        w = torch.zeros(logp.shape)
        for i, wi in enumerate(weights):
            w[i, : len(wi)] = wi
        _, loss, grad = run(objective, logp, old, adv, mask, "token-mean", is_weight=w)
        rows = [grad[i, : len(lp)] for i, (lp, *_) in enumerate(responses)]
        assert_matches(objective, responses, "token-mean", loss, rows.__getitem__, weights)


def test_bad_objective_input_is_refused():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="objective='ppo', expected one of"):
        policy_loss(x, x, torch.zeros(2), mask, objective="ppo")
    with pytest.raises(ValueError, match="objective='gspo' needs eps_low"):
        policy_loss(x, x, torch.zeros(2), mask, objective="gspo", eps_low=None)
    with pytest.raises(ValueError, match="seq_index \\(2, 2\\) must match mask \\(2, 3\\)"):
        policy_loss(x, x, torch.zeros(2), mask, objective="gspo", seq_index=torch.zeros(2, 2, dtype=torch.long))


def test_the_registry_is_keyed_by_objective():
    """Only dapo has the fused kernel: 'auto' picks the reference for the others even where the kernel runs, and
    'fused' with them is refused naming the field."""
    assert resolve_loss_impl("auto", True, "dapo") == "fused"
    for objective in ("gspo", "gspo_token", "cispo"):
        assert resolve_loss_impl("auto", True, objective) == "reference"
        with pytest.raises(ValueError, match=f"algorithm.loss_impl='fused': .*policy_loss='{objective}'"):
            resolve_loss_impl("fused", True, objective)
        assert policy_loss_fn("reference", objective).keywords == {"objective": objective}
    with pytest.raises(ValueError, match="algorithm.policy_loss='ppo'"):
        resolve_loss_impl("auto", True, "ppo")


# ------------------------------------------------------------------ rollout correction


def ref_correction(mode: str, old: list[float], roll: list[float], low, high) -> tuple[list[float], list[bool]]:
    """The module docstring's table, float64, one response."""
    w = [math.exp(max(-20.0, min(20.0, a - b))) for a, b in zip(old, roll)]
    if mode in ("seq_tis", "seq_mask"):
        big = math.exp(sum(math.log(x) for x in w) / len(w)) if w else 1.0
        w = [big] * len(w)
    if mode == "none":
        return [1.0] * len(w), [False] * len(w)
    if mode in ("token_tis", "seq_tis"):
        return [min(x, high) for x in w], [x > high for x in w]
    kept = [low <= x <= high for x in w]
    return [(x if mode == "icepop" else 1.0) if k else 0.0 for x, k in zip(w, kept)], [not k for k in kept]


CORRECTIONS = {
    "token_tis": Correction("token_tis", None, 1.5),
    "seq_tis": Correction("seq_tis", None, 1.1),
    "token_mask": Correction("token_mask", 0.5, 2.0),
    "seq_mask": Correction("seq_mask", 0.8, 1.25),
    "icepop": Correction("icepop", 0.5, 5.0),
    "none": Correction(),
}


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_correction_weights_match_the_table(mode, seed):
    """Fresh responses: an empty one, one token beyond e^20, and long ones whose token ratios spread over both bounds
    while their geometric mean lies inside the sequence modes' bounds, or outside them."""
    g = torch.Generator().manual_seed(seed)
    correction = CORRECTIONS[mode]
    n = int(torch.randint(10, 40, (), generator=g))
    for size, spread, shift in ((0, 0, 0), (1, 0, 0), (n, 0.5, 0.0), (n, 0.5, 0.1), (n, 0.5, 0.4), (n, 0.5, -0.4)):
        old = -torch.rand(size, generator=g, dtype=torch.float64) * 3
        noise = torch.randn(size, generator=g, dtype=torch.float64) * spread
        roll = old - (noise - noise.mean() + shift if size > 1 else torch.full_like(old, 25.0))  # W = e^shift
        if size > 1:
            assert math.exp(float((old - roll).mean())) == pytest.approx(math.exp(shift))
        weight, corrected = correction_weight(old, roll, correction)
        want_w, want_c = ref_correction(mode, old.tolist(), roll.tolist(), correction.low, correction.high)
        assert weight.dtype == torch.float32 and weight.shape == (size,) and not weight.requires_grad
        assert weight.tolist() == pytest.approx(want_w, rel=1e-6)
        assert corrected.tolist() == want_c


def test_masking_bounds_are_inclusive_and_tis_is_one_sided():
    """A ratio exactly on a bound is kept (IcePop's and verl's [low, high]); truncated IS never raises a small
    weight."""
    old = torch.tensor([-1.0, -2.0, -3.0])
    same = old.clone()  # ratio exactly 1
    for mode in ("token_mask", "seq_mask", "icepop"):
        for low, high in ((1.0, 3.0), (0.5, 1.0)):
            weight, corrected = correction_weight(old, same, Correction(mode, low, high))
            assert weight.tolist() == [1.0, 1.0, 1.0] and not corrected.any(), (mode, low, high)
    small = correction_weight(old, old + 2.0, Correction("token_tis", None, 2.0))[0]
    assert small.tolist() == pytest.approx([math.exp(-2.0)] * 3)


def test_bad_correction_input_is_refused():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="rollout correction 'clip': expected one of"):
        correction_weight(x, x, Correction("clip", None, 2.0))
    with pytest.raises(ValueError, match="rollout correction 'icepop': bounds low=None"):
        correction_weight(x, x, Correction("icepop", None, 5.0))
    with pytest.raises(ValueError, match="rollout correction 'token_tis': bounds"):
        correction_weight(x, x, Correction("token_tis", None, 0.0))
    with pytest.raises(ValueError, match="must be the same \\[R\\]"):
        correction_weight(x, torch.zeros(4), Correction())
    with pytest.raises(ValueError, match="must be the same \\[R\\]"):
        correction_weight(torch.zeros(2, 3), torch.zeros(2, 3), Correction())


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_rollout_mismatch_against_float64_reference(mode, seed):
    """The logged mismatch: mean |logp difference| and k3 per token, the share of tokens (and, for the sequence
    modes, of responses) the correction capped or masked; sums over responses add up."""
    g = torch.Generator().manual_seed(seed)
    correction = CORRECTIONS[mode]
    pairs = []
    for i in range(5):
        n = 0 if i == 2 else int(torch.randint(1, 30, (), generator=g))
        old = -torch.rand(n, generator=g) * 5
        roll = old + torch.randn(n, generator=g) * 0.5
        if n:
            roll[0] = old[0] - 60.0  # a huge ratio: the log-ratio is clamped at 20 before exp()
        pairs.append((old, roll))
    sums = sum(rollout_mismatch_sums(o, r, correction) for o, r in pairs)
    abs_sum = kl = corrected = seqs_hit = tokens = 0.0
    for o, r in pairs:
        for a, b in zip(o.tolist(), r.tolist()):
            d = max(-20.0, min(20.0, a - b))
            abs_sum, kl, tokens = abs_sum + abs(d), kl + (math.exp(d) - 1.0) - d, tokens + 1
        hit = ref_correction(mode, o.tolist(), r.tolist(), correction.low, correction.high)[1]
        corrected, seqs_hit = corrected + sum(hit), seqs_hit + any(hit)
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([abs_sum, kl, corrected, tokens, seqs_hit, 5.0], rel=1e-9)
    m = mismatch_metrics(sums, correction)
    assert m["rollout/logp_mismatch_mean"] == pytest.approx(abs_sum / tokens)
    assert m["rollout/kl"] == pytest.approx(kl / tokens)
    assert m.get("rollout/corrected_frac") == (None if mode == "none" else pytest.approx(corrected / tokens))
    seq_mode = mode in ("seq_tis", "seq_mask")
    assert m.get("rollout/corrected_seq_frac") == (pytest.approx(seqs_hit / 5) if seq_mode else None)
    # k3 is >= 0 per token, and 0 exactly where the two policies agree
    old = pairs[0][0]
    assert rollout_mismatch_sums(old, old, correction).tolist()[:3] == [0.0, 0.0, 0.0]
    empty = rollout_mismatch_sums(torch.zeros(0), torch.zeros(0), correction)
    assert empty.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert mismatch_metrics(empty * 0, correction)["rollout/kl"] == 0.0


# ------------------------------------------------------------------ the registries and the docs' tables


def docs_rows(title: str) -> dict[str, str]:
    """docs/training.md's table under `### title`: first cell's name -> its Bounds cell (the third)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    section = text.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    table = section.split("\n\n|", 1)[1].split("\n\n", 1)[0].splitlines()  # the section's first table
    rows = [line.split("|")[1:-1] for line in table[2:]]  # below its header and separator
    return {re.match(r" `(\w+)`", cells[0]).group(1): cells[2] for cells in rows}


def test_the_docs_tables_list_every_registered_objective_and_correction_with_its_keys():
    for title, records in (("Objectives: DAPO, GSPO, CISPO", OBJECTIVES), ("Rollout correction", registry.CORRECTIONS)):
        rows = docs_rows(title)
        assert list(rows) == list(records), title
        for name, record in records.items():
            keys = {k for k in (record.low, record.high) if k is not None}
            assert set(re.findall(r"`(\w+)`", rows[name])) == keys, (title, name)


# ------------------------------------------------------------------ adding an objective (docs/training.md's example)


def clip_both_loss(x: TokenLossInput) -> tuple[torch.Tensor, Flags]:
    """-clip(r, 1 - eps_low, 1 + eps_high) A: no PPO min, so the clip zeroes the gradient beyond either bound."""
    ratio = torch.exp(x.log_ratio)
    r = ratio.detach()
    flags = {"ratio": r, "clip_low": r < 1.0 - x.eps_low, "clip_high": r > 1.0 + x.eps_high}
    return -x.adv * ratio.clamp(1.0 - x.eps_low, 1.0 + x.eps_high), flags


@pytest.fixture
def clip_both():
    """The objective registered for one test: the registry is a process-wide dict, so it goes again after."""
    registry.objective("clip_both", low="eps_low", high="eps_high")(clip_both_loss)
    try:
        yield "clip_both"
    finally:
        del OBJECTIVES["clip_both"]


def test_a_registered_objective_trains_through_policy_loss_and_an_optimizer_step(clip_both):
    """A tiny softmax policy, one SGD step on clip_both's seq-mean-token-mean loss with a token_tis weight: the
    updated weights match the same step in float64 with the formula written out."""
    g = torch.Generator().manual_seed(0)
    b, t, d, vocab, lr, low, high = 3, 6, 4, 5, 0.5, 0.2, 0.28
    feats, tokens = torch.randn(b, t, d, generator=g), torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    adv, is_weight = torch.tensor([1.0, -0.5, 2.0]), torch.rand(b, t, generator=g) + 0.5
    w0 = torch.randn(d, vocab, generator=g)

    def logp_of(w):  # [B, T]: log pi(y_t) of the sampled tokens
        return torch.log_softmax(feats.to(w.dtype) @ w, dim=-1).gather(-1, tokens[..., None])[..., 0]

    old = logp_of(w0 + 0.3 * torch.randn(d, vocab, generator=g)).detach()  # ratios on both sides of the clip
    resolved = resolve_loss_impl("auto", True, clip_both)
    assert resolved == "reference"  # no fused kernel for it
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=lr)
    out = policy_loss_fn(resolved, clip_both)(
        logp_of(w), old, adv, mask, eps_low=low, eps_high=high, is_weight=is_weight,
        loss_agg_mode="seq-mean-token-mean",
    )  # fmt: skip
    (out.loss_sum / out.normalizer).backward()
    opt.step()

    w64 = w0.double().requires_grad_(True)
    r = torch.exp(logp_of(w64) - old.double())
    clipped = r.clamp(1 - low, 1 + high)
    losses = [(-adv[i] * clipped[i] * is_weight[i].double())[mask[i]].mean() for i in range(b)]
    (grad,) = torch.autograd.grad(sum(losses) / b, w64)
    torch.testing.assert_close(w.detach().double(), w0.double() - lr * grad, rtol=1e-5, atol=1e-6)
    assert float(out.stats["clip_low"] + out.stats["clip_high"]) == float(((r < 1 - low) | (r > 1 + high))[mask].sum())
    assert 0 < float(out.stats["clip_low"] + out.stats["clip_high"]) < float(mask.sum())


def test_a_registered_objective_is_a_config_value_with_its_own_settings(clip_both):
    a = load_config(overrides=[f"algorithm.policy_loss={clip_both}", "algorithm.eps_low=0.1"]).algorithm
    assert a.clip_bounds() == (0.1, 0.28)
    with pytest.raises(ConfigError, match=f"algorithm.dual_clip_c=3.0: expected null with policy_loss='{clip_both}'"):
        load_config(overrides=[f"algorithm.policy_loss={clip_both}", "algorithm.dual_clip_c=3"])
    with pytest.raises(ConfigError, match="algorithm.loss_impl='fused': expected 'auto' or 'reference'"):
        load_config(overrides=[f"algorithm.policy_loss={clip_both}", "algorithm.loss_impl=fused"])


def test_a_registered_objective_leaves_no_trace():
    """The fixture's objective is gone once its tests end (this runs after them in file order)."""
    assert "clip_both" not in OBJECTIVES and list(OBJECTIVES) == list(POLICY_LOSSES)
    with pytest.raises(ValueError, match="is registered already"):
        registry.objective("dapo", low="eps_low", high="eps_high")(clip_both_loss)
