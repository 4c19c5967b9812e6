"""One DAPO train step against transformers in float64, TP=2, PP=2 and DP=2 (2 processes, gloo, torchrun) against
the 1-process run, global token-mean, and truncated IS reaching the loss.

Each layout runs the same tiny model and the same mini-batch through one DAPO train step. The reference is
transformers' own model in float64 with the DAPO loss written out here: the loss, its normaliser, the clip counts,
the ratio metrics, the clipped gradients and AdamW's first step must match it; the 2-process layouts must also
match the 1-process run at fp32 tolerances. The token-mean check: one mini-batch split into 1, 2 or 4 micro-batches,
and over 1 or 2 data-parallel ranks, gives the same gradients (the check other frameworks fail). Dr. GRPO's step divides
by the configured length limit, and a checkpoint's rms_norm_eps far from the default reaches Megatron's logprobs.

Every run of the file is a job of the test run's two torchrun launches (1 and 2 processes; tests/conftest.py
megatron_runs).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dapo_reference import LOSS, SEQ, TEMPERATURE, assert_matches_float64, assert_same, budget, dapo_float64
from megatron_helpers import (
    Job,
    hf_response_logprobs,
    random_batch,
    result,
    save_case,
    tiny_hf_model,
)

from megatron_dapo.convert.layouts import hf_to_megatron
from megatron_dapo.model.arch import ModelArch

TIS_CAP = 1.5  # about a fifth of the weights exp(-rollout_offset) lie above it
DR_GRPO_MAX_RESPONSE = 40  # rollout.max_response_length of the Dr. GRPO step: well above the batch's longest (14)
DR_GRPO = [
    "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
    f"rollout.max_response_length={DR_GRPO_MAX_RESPONSE}",
    "algorithm.overlong_buffer_len=8",  # within the limit (the default 4096 is the paper's, for 20480)
]
GSPO = [
    "algorithm.policy_loss=gspo",
    "algorithm.gspo_eps_low=0.0002",
    "algorithm.gspo_eps_high=0.05",
    "algorithm.loss_agg_mode=seq-mean-token-mean",
    "algorithm.rollout_correction=seq_tis",
    "algorithm.tis_cap=1.1",
]
CISPO = ["algorithm.policy_loss=cispo", "algorithm.eps_high_is=0.25", "algorithm.rollout_correction=icepop",
         "algorithm.icepop_low=0.6", "algorithm.icepop_high=1.6"]  # fmt: skip
FAR_EPS = 0.1  # a checkpoint's rms_norm_eps far from the tiny models' 1e-6 (and Megatron's default 1e-5)


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("qwen2")


@pytest.fixture(scope="module")
def batch():
    return random_batch(8, SEQ, 250)


@pytest.fixture(scope="module")
def arch(model) -> ModelArch:
    return ModelArch.from_hf_config(model.config.to_dict())


PIPELINES = {  # name: (family, tied, layers, overrides), each against its own 1-process run
    "pp2-tied-embeddings": ("llama", True, 2, ["parallel.pp=2"]),  # the tied embedding lives on both stages
    "pp2-vpp2": ("qwen2", False, 4, ["parallel.pp=2", "parallel.vpp=2"]),  # interleaved 1F1B over 2 chunks a stage
}


def megatron_jobs(root: Path) -> dict[str, Job]:
    """Every train step of this file (tests/conftest.py megatron_runs runs them): the module's model and batch."""
    batch = random_batch(8, SEQ, 250)
    case = save_case(tiny_hf_model("qwen2"), batch, root / "case")

    def train(nproc: int, *overrides: str, on=case, slow: bool = False) -> Job:
        # every 2-process launch is make test's only, as in the other Megatron files: ~12 s a launch
        return Job(nproc, on, ("--mode", "train", *LOSS, *overrides), slow or nproc > 1)

    no_distopt = "parallel.use_distributed_optimizer=false"
    jobs = {
        "ref": train(1, budget(8)),  # one micro-batch
        "mb2": train(1, budget(4)),
        "mb4": train(1, budget(2)),
        "tis": train(1, budget(4), f"algorithm.tis_cap={TIS_CAP}"),
        "selective": train(1, budget(8), "model.recompute=selective"),
        "full": train(1, budget(8), "model.recompute=full"),
        "tp2": train(2, budget(8), "parallel.tp=2"),
        "pp2": train(2, budget(8), "parallel.pp=2"),
        "dp2": train(2, budget(8), no_distopt),
        "dp2-distopt": train(2, budget(8)),
        "dp2-mb2": train(2, budget(2), no_distopt),  # 2 DP ranks x 2 micro-batches each
        "nan": Job(1, case, ("--mode", "nan")),
        "dr-grpo": train(1, budget(4), *DR_GRPO),  # 2 micro-batches, each divided by the mini-batch's constant
        "gspo": train(1, budget(4), *GSPO),  # 2 micro-batches, each a packed row of 4 responses
        "cispo": train(1, budget(4), *CISPO),
        "far-eps": Job(
            1, save_case(tiny_hf_model("qwen2", rms_norm_eps=FAR_EPS), batch, root / "far-eps"), ("--mode", "logprobs")
        ),
    }
    qwen3 = save_case(tiny_hf_model("qwen3"), batch, root / "case-qwen3")
    jobs["qwen3-ref"] = train(1, budget(8), on=qwen3)
    jobs["qwen3-tp2"] = train(2, budget(8), "parallel.tp=2", on=qwen3)
    for name, (family, tied, layers, overrides) in PIPELINES.items():
        model = tiny_hf_model(family, seed=11, vocab_size=250, layers=layers, tied=tied)
        own = save_case(model, random_batch(8, SEQ, 250, seed=2), root / f"case-{name}")
        jobs[f"{name}-ref"] = train(1, budget(2), on=own, slow=True)  # 4 micro-batches: the schedules interleave
        jobs[name] = train(2, budget(2), *overrides, on=own, slow=True)
    return jobs


@pytest.fixture(scope="module")
def expected(model, batch):
    return dapo_float64(model, batch)


@pytest.fixture(scope="module")
def reference(ran):
    """The 1-process run, one micro-batch."""
    return result(ran, "ref")


def test_one_process_step_matches_float64_transformers(reference, expected, arch):
    """Clip bounds wired to the wrong fields, the overlong mask lost, grads rescaled or AdamW misconfigured all fail."""
    assert expected["clip_low"][0] > 0 and expected["clip_high"][0] > 0  # the noise exercises both clips
    assert_matches_float64(expected, reference, arch, "1 process")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2"])
def test_two_process_layouts_match_one_process(arch, reference, expected, ran, name):
    got = result(ran, name)
    assert_same(reference, got, name)
    assert_matches_float64(expected, got, arch, name)


@pytest.mark.slow
def test_distributed_optimizer_over_dp2_gives_the_same_weights(reference, ran):
    got = result(ran, "dp2-distopt")
    for name, t in reference["weights"].items():
        torch.testing.assert_close(got["weights"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert got["metrics"]["actor/loss"] == pytest.approx(reference["metrics"]["actor/loss"], rel=1e-5)
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(reference["metrics"]["actor/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_token_mean_is_global_across_micro_batches(arch, reference, expected, ran, microbatches):
    got = result(ran, f"mb{microbatches}")
    assert_same(reference, got, f"{microbatches} micro-batches")
    assert_matches_float64(expected, got, arch, f"{microbatches} micro-batches")


@pytest.mark.slow
def test_token_mean_is_global_across_micro_batches_and_dp(arch, reference, expected, ran):
    # 2 DP ranks x 2 micro-batches each: the normaliser spans all four
    got = result(ran, "dp2-mb2")
    assert_same(reference, got, "dp2 x 2 micro-batches")
    assert_matches_float64(expected, got, arch, "dp2 x 2 micro-batches")


def test_truncated_is_weights_reach_the_loss(model, batch, arch, expected, ran):
    """Rollout logprobs and algorithm.tis_cap: the loss and gradients are those of the IS-weighted loss in float64.

    Two micro-batches, so each must carry its own samples' rollout logprobs; the cap changes the loss, so a loss
    without the weights, or with them uncapped, fails.
    """
    weights = torch.cat([torch.exp(-b["rollout_offset"]) for b in batch if b["in_loss"]])
    assert (weights > TIS_CAP).any() and (weights < 1).any()
    want = dapo_float64(model, batch, tis_cap=TIS_CAP)
    uncapped = dapo_float64(model, batch, tis_cap=math.inf)
    for other in (expected, uncapped):  # far beyond the rel=1e-5 the comparison allows
        assert abs(want["loss"] - other["loss"]) > 1e-2 * abs(want["loss"])
    got = result(ran, "tis")
    assert_matches_float64(want, got, arch, "truncated IS")


def test_dr_grpo_step_divides_by_the_configured_length_limit(model, batch, arch, ran):
    """algorithm.loss_agg_mode=seq-mean-token-sum-norm with rollout.max_response_length (40) well above the batch's
    longest response (14): the divisor is responses x the configured limit, as written out in float64; one taken from
    the batch's own lengths (where the two coincide no test would tell) fails the loss, normaliser and weights."""
    assert max(len(b["response"]) for b in batch) < DR_GRPO_MAX_RESPONSE / 2
    want = dapo_float64(model, batch, dr_grpo_max_response=DR_GRPO_MAX_RESPONSE)
    assert want["normalizer"] == len(batch) * DR_GRPO_MAX_RESPONSE != want["tokens"]
    assert_matches_float64(want, result(ran, "dr-grpo"), arch, "Dr. GRPO")


def test_gspo_and_cispo_steps_on_packed_rows_match_float64_transformers(model, batch, arch, ran):
    """The objectives and two rollout corrections end to end, two micro-batches of packed rows each: GSPO's ratio (the
    geometric mean of a response's token ratios) clipped at its own bounds, each response's mean then the mean over
    responses, the responses weighted by seq_tis (min(W, 1.1), W the geometric mean of exp(-rollout_offset)); CISPO's
    detached weight min(r, 1.25) on every token's logp, the tokens weighted by IcePop (w in [0.6, 1.6], else 0). A
    ratio summed over a packed row instead of one response, a weight taken per token, or the objective's bounds read
    from DAPO's keys all fail."""

    def seq_tis(b):
        return torch.exp(-b["rollout_offset"].double().mean()).clamp(max=1.1).expand(len(b["response"]))

    def icepop(b):
        w = torch.exp(-b["rollout_offset"].double())
        return torch.where((w >= 0.6) & (w <= 1.6), w, torch.zeros_like(w))

    runs = {
        "gspo": dapo_float64(model, batch, objective="gspo", bounds=(0.0002, 0.05), seq_mean=True, weight=seq_tis),
        "cispo": dapo_float64(model, batch, objective="cispo", bounds=(None, 0.25), weight=icepop),
    }
    weights = torch.cat([torch.exp(-b["rollout_offset"]) for b in batch if b["in_loss"]])
    assert ((weights < 0.6) | (weights > 1.6)).any()  # IcePop masks some tokens
    assert any(float(seq_tis(b)[0]) == 1.1 for b in batch if b["in_loss"])  # seq_tis caps some responses
    for name, want in runs.items():
        got = result(ran, name)
        assert got["packed"], name
        assert want["clip_high"][0] > 0 and (name == "cispo" or want["clip_low"][0] > 0), name
        assert_matches_float64(want, got, arch, name)


def test_a_checkpoints_rms_norm_eps_reaches_megatron(batch, ran):
    """A checkpoint whose rms_norm_eps (0.1) is far from the tiny models' 1e-6: Megatron's logprobs and entropies are
    transformers' own (float64) with that epsilon. The config read from another key, or Megatron's layernorm_epsilon
    left at a default, normalises with 1e-6 or 1e-5 instead and moves them far beyond the tolerance."""
    model = tiny_hf_model("qwen2", rms_norm_eps=FAR_EPS)
    assert ModelArch.from_hf_config(model.config.to_dict()).rms_norm_eps == FAR_EPS
    hf = model.double()
    got = result(ran, "far-eps")["logprobs"]
    assert len(got) == len(batch)
    with torch.no_grad():
        for g, b in zip(got, batch):
            logp, entropy = hf_response_logprobs(hf, b, TEMPERATURE)
            torch.testing.assert_close(g["logp"].double(), logp, rtol=0, atol=1e-5)
            torch.testing.assert_close(g["entropy"].double(), entropy, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_variants_match_one_process(ran, name):
    assert_same(result(ran, f"{name}-ref"), result(ran, name), name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_recompute_changes_nothing(reference, ran, mode):
    got = result(ran, mode)
    assert_same(reference, got, f"recompute={mode}")


def test_a_nan_loss_skips_the_update(ran):
    got = result(ran, "nan")
    bad, good = got["metrics_nan"], got["metrics"]
    assert math.isnan(bad["actor/loss"]) and bad["actor/update_applied"] == 0.0
    assert got["unchanged"] and got["steps_after_nan"] == 0
    assert good["actor/update_applied"] == 1.0 and got["steps_after_good"] == 1 and math.isfinite(good["actor/loss"])


def test_qwen3_step_matches_float64_transformers(batch, ran):
    """Qwen3 (per-head q/k RMSNorm, no QKV bias, head_dim twice hidden/heads): one step in one process against
    transformers' Qwen3ForCausalLM in float64, the q/k norms' gradients and updated weights included."""
    model = tiny_hf_model("qwen3")
    arch = ModelArch.from_hf_config(model.config.to_dict())
    assert_matches_float64(dapo_float64(model, batch), result(ran, "qwen3-ref"), arch, "qwen3")


@pytest.mark.slow
def test_qwen3_tp2_step_keeps_the_qk_norms_equal_on_both_ranks(batch, ran):
    """At TP 2 each rank holds half the heads but a whole copy of the [head_dim] q/k norm weights: their gradients
    must be summed over TP (Megatron does it only when TransformerConfig.qk_layernorm says so), or the two copies
    step apart. After the step every replicated tensor is bit-equal on both ranks, and the step is the float64
    one."""
    model = tiny_hf_model("qwen3")
    arch = ModelArch.from_hf_config(model.config.to_dict())
    got = result(ran, "qwen3-tp2")
    norms = [n for n in got["replicas"] if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    assert len(norms) == 2 * arch.num_layers, got["replicas"]
    assert got["replicas_differ"] == []
    before = hf_to_megatron(model.state_dict(), arch)
    for name in norms:  # the step moved them: equal because reduced, not because untouched
        assert not torch.equal(got["weights"][name], before[name]), name
    assert_same(result(ran, "qwen3-ref"), got, "qwen3 tp2")
    assert_matches_float64(dapo_float64(model, batch), got, arch, "qwen3 tp2")
