"""The weight bridge: Megatron shards at TP=2 / PP=2 -> the exact Hugging Face tensors, in bounded buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import Job, random_batch, result, run_worker, save_case, tiny_hf_model

from megatron_dapo.rollout.weight_transport import _CHUNK

BUCKET = 70_000  # bytes: just over the embedding, so many buckets of a few tensors each
LAYOUTS = {  # name: (family, tied, nproc, overrides)
    "tp1": ("qwen2", False, 1, []),
    "tp2": ("qwen2", False, 2, ["parallel.tp=2"]),
    "pp2-tied": ("llama", True, 2, ["parallel.pp=2"]),
    "pp2-bf16": ("qwen2", False, 2, ["parallel.pp=2", "model.dtype=bf16"]),  # bf16 tensors over the stages
    "qwen3-tp2": ("qwen3", False, 2, ["parallel.tp=2"]),  # q_norm / k_norm: replicated, each under its own name
    "moe": ("qwen3_moe", False, 1, []),  # the router and every expert under the checkpoint's per-expert names
    "moe-ep2": ("qwen3_moe", False, 2, ["parallel.ep=2"]),  # each rank holds 4 of a layer's 8 experts
    "moe-pp2": ("qwen3_moe", False, 2, ["parallel.pp=2"]),  # each stage's dense and MoE layers, numbered from its first
}
LAYERS = {"qwen3_moe": 4}  # a dense layer among the MoE ones, two per stage at PP 2


def bridge_model(family: str, tied: bool):
    return tiny_hf_model(family, seed=9, vocab_size=250, tied=tied, layers=LAYERS.get(family, 2))


def checkpoint_tensors(model, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What transformers saves (a MoE layer's experts one by one, as vLLM loads them)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def megatron_jobs(root: Path) -> dict[str, Job]:
    """Every sync of this file but the memory test's (tests/conftest.py megatron_runs runs them)."""
    jobs = {}
    for name, (family, tied, nproc, overrides) in LAYOUTS.items():
        case = save_case(bridge_model(family, tied), random_batch(2, 8, 250), root / name)
        jobs[name] = Job(nproc, case, ("--mode", "bridge", f"rollout.bucket_bytes={BUCKET}", *overrides), nproc > 1)
    small = save_case(tiny_hf_model("qwen2", vocab_size=250), random_batch(2, 8, 250), root / "small-bucket")
    jobs["small-bucket"] = Job(1, small, ("--mode", "bridge", "rollout.bucket_bytes=1000"))
    return jobs


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n not in ("tp1", "moe") else []) for n in LAYOUTS]
)
def test_bridge_streams_the_hf_state_dict(ran, name, tmp_path):
    family, tied = LAYOUTS[name][:2]
    model = bridge_model(family, tied)
    bucket = BUCKET
    got = result(ran, name)
    want = {k: v for k, v in checkpoint_tensors(model, tmp_path).items() if not (tied and k == "lm_head.weight")}
    assert got["hf"].keys() == want.keys()
    if family == "qwen3":  # unequal norms (a swap would show), sent as they are
        q, k = want["model.layers.1.self_attn.q_norm.weight"], want["model.layers.1.self_attn.k_norm.weight"]
        assert q.shape == k.shape == (32,) and not torch.equal(q, k)
    for name, t in want.items():
        g = got["hf"][name]
        assert torch.equal(g, t.to(g.dtype)), name  # bit-exact at the precision the model holds
    assert max(got["bucket_bytes"]) <= bucket and len(got["bucket_bytes"]) >= 3
    assert sum(got["bucket_bytes"]) == sum(got["hf"][n].numel() * got["hf"][n].element_size() for n in want)
    assert got["sync"]["weight_sync/buckets"] == len(got["bucket_bytes"]) and got["sync"]["weight_sync/gb_per_s"] > 0


def test_a_tensor_larger_than_a_bucket_is_a_clear_error(ran):
    with pytest.raises(AssertionError) as e:
        result(ran, "small-bucket")
    assert (
        "tensor 'model.embed_tokens.weight' (64000 bytes) is larger than one bucket (rollout.bucket_bytes=1000)"
        in str(e.value)
    )


@pytest.mark.slow
def test_sync_memory_stays_within_a_bucket_plus_the_largest_tensor(tmp_path, monkeypatch):
    """Measured from the peak resident set of TP rank 0: the sync must never materialise the model (what it may add:
    a bucket, the largest tensor, the bucket digest's pass buffers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.model.tiny import random_model

    cfg = Qwen2Config(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = random_model(Qwen2ForCausalLM, cfg, seed=0)
    case = save_case(model, random_batch(2, 8, 2048), tmp_path / "case")
    bucket = 8 << 20
    # glibc's adaptive mmap threshold lets freed tensors stay resident or not depending on what ran before,
    # so the baseline moved by ~90 MiB from run to run; a fixed threshold returns every freed tensor.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    args = ("--mode", "bridge", "--bridge-shapes-only", f"rollout.bucket_bytes={bucket}", "parallel.tp=2")
    got = run_worker(case, tmp_path / "out", 2, *args)
    largest = 2 * 1536 * 512 * 4  # fc1 (gate and up) in fp32
    slack = 16 << 20  # allocator and interpreter noise
    digest = 2 * 8 * _CHUNK["cpu"]  # the bucket digest's two float64 pass buffers, kept by the thread
    assert got["model_bytes"] > 50 << 20  # this rank's half of the model
    print(
        f"sync added {got['peak_extra_bytes'] / 2**20:.1f} MiB at peak for a {got['model_bytes'] / 2**20:.0f} MiB model"
    )
    assert got["peak_extra_bytes"] <= bucket + largest + digest + slack, got["peak_extra_bytes"]
