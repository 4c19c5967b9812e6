"""TP=2, PP=2 and DP=2 (2 processes, gloo, torchrun) against the 1-process run, and global token-mean.

Each layout runs the same tiny model and the same mini-batch through one DAPO train step;
loss, gradients and the weights after the AdamW step must match the 1-process run at fp32
tolerances. The token-mean check: one mini-batch split into 1, 2 or 4 micro-batches, and
over 1 or 2 data-parallel ranks, gives the same gradients (the check other frameworks fail).
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import random_batch, run_worker, save_case, tiny_hf_model

SEQ = 16  # prompt + response tokens of every sample: equal, so micro-batch splits are exact


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return save_case(tiny_hf_model("qwen2"), random_batch(8, SEQ, 250), tmp_path_factory.mktemp("case"))


def run(case, tmp_path, name: str, nproc: int, *overrides: str) -> dict:
    return run_worker(case, tmp_path / name, nproc, "--mode", "train", *overrides)


def assert_same(ref: dict, got: dict, what: str) -> None:
    assert got["metrics"]["actor/loss"] == pytest.approx(ref["metrics"]["actor/loss"], rel=1e-5, abs=1e-7), what
    assert got["metrics"]["actor/normalizer"] == ref["metrics"]["actor/normalizer"], what
    for key in ("grads", "weights"):
        assert got[key].keys() == ref[key].keys(), what
        for name, t in ref[key].items():
            torch.testing.assert_close(got[key][name], t, rtol=1e-5, atol=1e-6, msg=f"{what} {key} {name}")


@pytest.fixture(scope="module")
def reference(case, tmp_path_factory):
    """The 1-process run, one micro-batch."""
    return run(case, tmp_path_factory.mktemp("ref"), "ref", 1, f"train.max_tokens_per_microbatch={8 * SEQ}")


def test_reference_run_is_a_real_update(reference):
    m = reference["metrics"]
    batch = random_batch(8, SEQ, 250)
    assert m["actor/normalizer"] == sum(len(b["response"]) for b in batch if b["in_loss"])
    assert m["actor/grad_norm"] > 0 and m["actor/update_applied"] == 1.0
    assert m["actor/clip_frac_low"] > 0 and m["actor/clip_frac_high"] > 0  # the noise exercises both clips
    assert any(g.abs().max() > 0 for g in reference["grads"].values())


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tp2", ["parallel.tp=2"]),
        ("pp2", ["parallel.pp=2"]),
        ("dp2", ["parallel.use_distributed_optimizer=false"]),
    ],
)
def test_two_process_layouts_match_one_process(case, reference, tmp_path, name, overrides):
    got = run(case, tmp_path, name, 2, f"train.max_tokens_per_microbatch={8 * SEQ}", *overrides)
    assert_same(reference, got, name)


def test_distributed_optimizer_over_dp2_gives_the_same_weights(case, reference, tmp_path):
    got = run(case, tmp_path, "dp2-distopt", 2, f"train.max_tokens_per_microbatch={8 * SEQ}")
    for name, t in reference["weights"].items():
        torch.testing.assert_close(got["weights"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert got["metrics"]["actor/loss"] == pytest.approx(reference["metrics"]["actor/loss"], rel=1e-5)
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(reference["metrics"]["actor/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_token_mean_is_global_across_micro_batches(case, reference, tmp_path, microbatches):
    budget = 8 // microbatches * SEQ
    got = run(case, tmp_path, f"mb{microbatches}", 1, f"train.max_tokens_per_microbatch={budget}")
    assert_same(reference, got, f"{microbatches} micro-batches")


def test_token_mean_is_global_across_micro_batches_and_dp(case, reference, tmp_path):
    # 2 DP ranks x 2 micro-batches each: the normaliser spans all four
    got = run(
        case,
        tmp_path,
        "dp2-mb2",
        2,
        f"train.max_tokens_per_microbatch={2 * SEQ}",
        "parallel.use_distributed_optimizer=false",
    )
    assert_same(reference, got, "dp2 x 2 micro-batches")


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, tied, layers, overrides",
    [
        ("llama", True, 2, ["parallel.pp=2"]),  # the tied embedding lives on both stages
        ("qwen2", False, 4, ["parallel.pp=2", "parallel.vpp=2"]),  # interleaved 1F1B over 2 chunks a stage
    ],
    ids=["pp2-tied-embeddings", "pp2-vpp2"],
)
def test_pipeline_variants_match_one_process(tmp_path, family, tied, layers, overrides):
    model = tiny_hf_model(family, seed=11, vocab_size=250, layers=layers, tied=tied)
    case = save_case(model, random_batch(8, SEQ, 250, seed=2), tmp_path / "case")
    budget = f"train.max_tokens_per_microbatch={2 * SEQ}"  # 4 micro-batches: the schedules interleave
    ref = run(case, tmp_path, "ref", 1, budget)
    got = run(case, tmp_path, "pp", 2, budget, *overrides)
    assert_same(ref, got, overrides[-1])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_recompute_changes_nothing(case, reference, tmp_path, mode):
    got = run(case, tmp_path, mode, 1, f"train.max_tokens_per_microbatch={8 * SEQ}", f"model.recompute={mode}")
    assert_same(reference, got, f"recompute={mode}")
