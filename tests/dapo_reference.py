"""The float64 reference of one DAPO train step on transformers' own model, and the comparisons the Megatron train
tests make with it (tests/test_model_parallel.py, tests/test_moe.py): the worker's (tests/megatron_worker.py) first
step, written out."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from megatron_helpers import hf_response_logprobs

from megatron_dapo.convert.layouts import hf_to_megatron, megatron_to_hf
from megatron_dapo.model.arch import ModelArch

SEQ = 16  # prompt + response tokens of every sample: equal, so micro-batch splits are exact
TEMPERATURE = 0.9  # the worker's default
EPS_LOW, EPS_HIGH = 0.15, 0.35  # unequal and neither the default (0.2, 0.28): a swapped or mis-wired bound fails
LOSS = [f"algorithm.eps_low={EPS_LOW}", f"algorithm.eps_high={EPS_HIGH}"]
LR, ADAM_EPS = 1e-3, 1e-4  # the worker's base config (no warm-up)
WEIGHT_DECAY, CLIP_GRAD = 0.1, 1.0  # the config's defaults
NEAR_BOUND = 1e-4  # |log r - log bound| under which fp32 rounding may put a token on either side of a clip bound


def budget(samples: int) -> str:
    return f"train.max_tokens_per_microbatch={samples * SEQ}"


class Float64Router:
    """Qwen3-MoE's router written out in float64, put in place of one layer's transformers router: logits = h W^T,
    p = softmax(logits) over every expert, the top k of p (or the given routes), their p renormalised to sum to 1
    when norm_topk_prob. It keeps the logits of every call (for the auxiliary losses)."""

    def __init__(self, gate, moe_index: int) -> None:
        self.gate, self.moe_index = gate, moe_index
        self.routes: torch.Tensor | None = None
        self.logits: list[torch.Tensor] = []
        gate.forward = self.forward

    @staticmethod
    def install(model) -> list[Float64Router]:
        """One per MoE layer of a transformers Qwen3-MoE model (none for a dense model), in layer order."""
        gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        return [Float64Router(g, i) for i, g in enumerate(gates)]

    @staticmethod
    def given(routers: list[Float64Router], routes: torch.Tensor | None) -> None:
        """The next sequence's routes [n - 1, moe layers, k] (its last token routes by itself), or None."""
        for r in routers:
            r.routes = None if routes is None else routes[:, r.moe_index].long()

    def forward(self, hidden_states: torch.Tensor):
        g = self.gate
        h = hidden_states.reshape(-1, g.hidden_dim).double()
        logits = h @ g.weight.double().t()
        self.logits.append(logits)
        p = torch.softmax(logits, dim=-1)
        top = torch.topk(p, g.top_k, dim=-1).indices
        if self.routes is not None:
            top = torch.cat([self.routes, top[len(self.routes) :]])
        weights = p.gather(-1, top)
        if g.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, top

    def aux_losses(self, lb: float, z: float) -> torch.Tensor:
        """Megatron's load-balancing loss (coefficient lb) and z-loss (z) over every token this router saw."""
        logits = torch.cat(self.logits)
        t, n, k = logits.shape[0], logits.shape[1], self.gate.top_k
        p = torch.softmax(logits, dim=-1)
        counts = torch.zeros(n, dtype=torch.float64).scatter_add_(
            0, torch.topk(p, k, dim=-1).indices.reshape(-1), torch.ones(t * k, dtype=torch.float64)
        )
        switch = (p.sum(0) * counts).sum() * n / (k * t * t)
        return lb * switch + z * (torch.logsumexp(logits, dim=-1) ** 2).mean()


def dapo_float64(
    model,
    batch: list[dict],
    tis_cap: float | None = None,
    dr_grpo_max_response: int | None = None,
    objective: str = "dapo",
    bounds: tuple[float | None, float] = (EPS_LOW, EPS_HIGH),
    seq_mean: bool = False,
    weight=None,
    replay: bool = False,
    aux: tuple[float, float] = (0.0, 0.0),
) -> dict:
    """The worker's first train step, written out in float64 on transformers' model.

    The worker's old_logp is the policy's own logprobs + noise; here it is transformers' logprobs + noise, so the
    ratio is exp(-noise) in both up to fp32 rounding. Loss: token-mean of the clipped surrogate over the whole
    mini-batch (times min(exp(old_logp - rollout_logp), tis_cap) with truncated IS); the gradient clipped to
    CLIP_GRAD; AdamW's first step, where m_hat = g and v_hat = g^2 whatever the betas. Returns the loss and metrics,
    clip_low / clip_high as (tokens surely clipped, tokens within NEAR_BOUND of the bound), and grads / weights
    under Hugging Face names. dr_grpo_max_response: seq-mean-token-sum-norm (Dr. GRPO): the token losses' sum divided
    by every response of the mini-batch (in the loss or not) x this configured length limit, not by the tokens.
    objective 'gspo': the response's ratio exp(mean log r) clipped at bounds; 'cispo': -sg(min(r, 1 + bounds[1]))
    A logp per token (no lower bound). seq_mean: each response's token mean, then the mean over responses.
    weight(sample) -> [R]: rollout-correction weights per token (tis_cap: min(exp(-rollout_offset), tis_cap)).
    A Qwen3-MoE model routes through Float64Router (its own top k, or with replay each sample's "routes"), and
    aux = (load-balancing, z-loss coefficients) adds Megatron's two router losses over the batch's tokens (one
    micro-batch): per MoE layer c * E / (k T^2) * sum_i (sum over tokens of p_i) * (tokens routed to i by the router's
    own top k) and z * mean(logsumexp(logits)^2). Grads and weights of experts are under Megatron's names then
    (transformers fuses each layer's experts into one tensor).
    """
    low, high = bounds
    if tis_cap is not None:

        def weight(b):  # noqa: E306 (old_logp - rollout_logp = -rollout_offset)
            return torch.exp(-b["rollout_offset"].double()).clamp(max=tis_cap)

    hf = copy.deepcopy(model).double()
    routers = Float64Router.install(hf)
    kept = [b for b in batch if b["in_loss"]]  # an overlong-filtered response is out of the loss and of its count
    tokens = sum(len(b["response"]) for b in kept)
    divisor = tokens if dr_grpo_max_response is None else len(batch) * dr_grpo_max_response
    divisor = len(kept) if seq_mean else divisor
    loss = torch.zeros((), dtype=torch.float64)
    ratios, advantages, entropies = [], [], []
    for b in batch:  # every sequence goes through the routers: the auxiliary losses count all of them
        if b["in_loss"]:
            continue
        Float64Router.given(routers, b["routes"] if replay else None)
        hf_response_logprobs(hf, b, TEMPERATURE)
    for b in kept:
        Float64Router.given(routers, b["routes"] if replay else None)
        logp, entropy = hf_response_logprobs(hf, b, TEMPERATURE)
        log_ratio = logp - (logp.detach() + b["noise"].double())
        ratio = torch.exp(log_ratio.mean()).expand(len(logp)) if objective == "gspo" else torch.exp(log_ratio)
        adv = b["advantage"]
        if objective == "cispo":
            token_loss = -ratio.detach().clamp(max=1 + high) * adv * logp
        else:
            token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
        if weight is not None:
            token_loss = token_loss * weight(b)
        loss = loss + (token_loss.mean() if seq_mean else token_loss.sum()) / divisor
        ratios.append(ratio.detach())
        advantages.append(torch.full_like(logp, adv).detach())
        entropies.append(entropy)
    if any(aux):
        loss = loss + sum(router.aux_losses(*aux) for router in routers)
    loss.backward()
    r, adv = torch.cat(ratios), torch.cat(advantages)

    def clipped(sign: torch.Tensor, past: torch.Tensor, bound: float) -> tuple[int, int]:
        """(tokens of this advantage sign past the bound, those of them within fp32 rounding of it)."""
        near = (r.log() - math.log(bound)).abs() < NEAR_BOUND
        return int((sign & past & ~near).sum()), int((sign & near).sum())

    anyway = torch.ones_like(adv, dtype=torch.bool)  # CISPO caps the weight whatever the advantage's sign
    clip_low = (0, 0) if low is None else clipped(adv < 0, r < 1 - low, 1 - low)
    clip_high = clipped(anyway if objective == "cispo" else adv > 0, r > 1 + high, 1 + high)
    grads = {n: p.grad for n, p in hf.named_parameters()}
    if routers:  # experts fused per layer in transformers: compare under Megatron's names
        arch = ModelArch.from_hf_config(model.config.to_dict())
        grads = hf_to_megatron(grads, arch)
        params = hf_to_megatron(dict(hf.named_parameters()), arch)
    else:
        params = dict(hf.named_parameters())
    grad_norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    scale = min(1.0, CLIP_GRAD / (grad_norm + 1e-6))  # Megatron's clip_grad_norm
    grads = {n: g * scale for n, g in grads.items()}
    weights = {  # decoupled weight decay on matrices only (not on biases and norms)
        n: p.detach() * (1 - LR * WEIGHT_DECAY * (p.dim() > 1)) - LR * grads[n] / (grads[n].abs() + ADAM_EPS)
        for n, p in params.items()
    }
    return {
        "loss": float(loss.detach()),
        "tokens": tokens,
        "normalizer": float(divisor),
        "ratio_mean": float(r.mean()),
        "approx_kl": float((r - 1 - r.log()).mean()),
        "entropy": float(torch.cat(entropies).mean()),
        "clip_low": clip_low,
        "clip_high": clip_high,
        "grad_norm": grad_norm,
        "grads": grads,
        "weights": weights,
    }


def assert_matches_float64(want: dict, got: dict, arch: ModelArch, what: str) -> None:
    m = got["metrics"]
    assert m["actor/update_applied"] == 1.0 and m["actor/lr"] == LR, what
    assert m["actor/normalizer"] == want["normalizer"] and m["actor/tokens"] == want["tokens"], what
    for key in ("loss", "ratio_mean", "approx_kl", "entropy", "grad_norm"):
        assert m[f"actor/{key}"] == pytest.approx(want[key], rel=1e-5), f"{what} {key}"
    for side in ("low", "high"):
        sure, near = want[f"clip_{side}"]
        count = round(m[f"actor/clip_frac_{side}"] * want["tokens"])
        assert sure <= count <= sure + near, f"{what} clip_{side}: {count} tokens, expected {sure} (+ {near} near)"
    for key, rtol, atol in (("grads", 1e-5, 3e-7), ("weights", 0.0, 5e-7)):  # observed: 4e-8 and 8e-8 at most
        if arch.is_moe:  # the reference is under Megatron's names
            hf = {n: t.double() for n, t in got[key].items()}
        else:
            hf = {n: t.double() for name, full in got[key].items() for n, t in megatron_to_hf(name, full, arch)}
        assert hf.keys() == want[key].keys(), what
        for name, t in want[key].items():
            torch.testing.assert_close(hf[name], t, rtol=rtol, atol=atol, msg=f"{what} {key} {name}")


def assert_same(ref: dict, got: dict, what: str) -> None:
    assert got["metrics"]["actor/loss"] == pytest.approx(ref["metrics"]["actor/loss"], rel=1e-5, abs=1e-7), what
    assert got["metrics"]["actor/normalizer"] == ref["metrics"]["actor/normalizer"], what
    for key in ("grads", "weights"):
        assert got[key].keys() == ref[key].keys(), what
        for name, t in ref[key].items():
            torch.testing.assert_close(got[key][name], t, rtol=1e-5, atol=1e-6, msg=f"{what} {key} {name}")
