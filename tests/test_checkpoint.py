"""Training checkpoints: a resumed policy trains exactly as the uninterrupted one; damaged ones fall back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import Job, random_batch, result, save_case, tiny_hf_model

# dp2 in bf16, the GPU configs' precision: the distributed optimizer's checkpoint of a bf16 model (fp32 main
# params and Adam moments beside bf16 weights)
LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["parallel.tp=2"]),
    "dp2-distributed-optimizer-bf16": (2, ["model.dtype=bf16"]),
    # a MoE model's experts split over 2 expert-parallel ranks, their optimizer state over their own group of 1
    "moe-ep2": (2, ["parallel.ep=2"]),
}


def megatron_jobs(root: Path) -> dict[str, Job]:
    """The resume check of every layout (tests/conftest.py megatron_runs runs them)."""
    case = save_case(tiny_hf_model("qwen2", seed=5, vocab_size=250), random_batch(8, 16, 250, seed=4), root / "c")
    moe = tiny_hf_model("qwen3_moe", seed=5, vocab_size=250, layers=4)
    moe_case = save_case(moe, random_batch(8, 16, 250, seed=4), root / "moe")
    return {
        name: Job(
            nproc,
            moe_case if name.startswith("moe") else case,
            ("--mode", "resume", "optim.warmup_steps=5", *overrides),
            slow=True,
        )  # fmt: skip
        for name, (nproc, overrides) in LAYOUTS.items()
    }


@pytest.mark.slow  # ~20 s for the single process: several policies, checkpoints and a damaged one
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_reproduces_the_next_step_and_falls_back_from_a_damaged_checkpoint(ran, name):
    got = result(ran, name)
    ep = 2 if name == "moe-ep2" else 1
    a, b = got["metrics_a"], got["metrics_b"]
    for key in ("actor/loss", "actor/grad_norm", "actor/lr", "actor/clip_frac_low", "actor/clip_frac_high"):
        assert b[key] == a[key], key  # bit-identical: same weights, Adam moments, step counts and LR schedule
    assert a["actor/lr"] == pytest.approx(4 / 5 * 1e-3)  # fourth warm-up step: the scheduler was restored
    for name, t in got["weights"].items():
        assert torch.equal(got["weights_b"][name], t), name
    assert got["state"]["step"] == 1 and got["state"]["trainer"]["loader"] == {"queue": [3, 1, 2]}
    assert got["rng_same"]
    assert got["fallback_step"] == 1
    # saved before any update (Adam had no state): resumed, the first step is the first step again, bit for bit
    for key in ("actor/loss", "actor/grad_norm", "actor/lr"):
        assert got["first_b"][key] == got["first"][key], key
    for name, t in got["weights_first"].items():
        assert torch.equal(got["weights_first_b"][name], t), name
    assert got["kept"] == ["step_00000001", "step_00000002"]
    assert got["closed_policy_freed"]
    # the checkpoint records its layers; one saved under the other layer spec is refused, not fallen back past
    assert got["layers_saved"] == {"transformer_impl": "local", "attention": "sdpa", "ep": ep, "etp": 1}
    assert (
        "\n" not in got["refusal"]
        and "step_00000001 was saved with model.transformer_impl='transformer_engine'" in got["refusal"]
    )


def _layout(use_te: bool, attention: str):
    from megatron_dapo.model.parallel import Layout

    return Layout(1, 0, 0, 1, 1, None, 1, 1, use_te=use_te, sequence_parallel=False, attention=attention)


def test_a_checkpoint_of_the_other_layer_spec_is_refused_and_another_attention_warned(caplog, tmp_path):
    from megatron_dapo.checkpoint import CheckpointMismatch, check_layer_impl, layer_impl

    local = layer_impl(_layout(False, "sdpa"))
    assert local == {"transformer_impl": "local", "attention": "sdpa", "ep": 1, "etp": 1}
    check_layer_impl(local, _layout(False, "sdpa"), tmp_path)  # the same: silent
    check_layer_impl(None, _layout(True, "te"), tmp_path)  # saved before layers were recorded: accepted
    with pytest.raises(
        CheckpointMismatch, match=r"model\.transformer_impl='local' and this run builds 'transformer_engine'"
    ):
        check_layer_impl(local, _layout(True, "sdpa"), tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"'transformer_engine' and this run builds 'local'"):
        check_layer_impl(layer_impl(_layout(True, "te")), _layout(False, "sdpa"), tmp_path)
    check_layer_impl({"transformer_impl": "local", "attention": "sdpa"}, _layout(False, "sdpa"), tmp_path)  # dense
    with pytest.raises(CheckpointMismatch, match=r"saved with parallel\.ep=2 and this run has parallel\.ep=1"):
        check_layer_impl({**local, "ep": 2}, _layout(False, "sdpa"), tmp_path)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="megatron_dapo.checkpoint"):
        check_layer_impl(local, _layout(False, "unfused"), tmp_path)
    assert "trained with attention 'sdpa', this run uses 'unfused'" in caplog.text
