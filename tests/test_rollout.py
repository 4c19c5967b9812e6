"""The vLLM rollout engine on CPU against independent references: Hugging Face transformers on the same weights.

One engine serves the whole module (vLLM start-up is the slow part); a test that changes its weights puts the
original ones back before it ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re

import pytest
import torch

pytest.importorskip("vllm")

from rollout_helpers import (  # noqa: E402
    FakeLLM,
    full_collections,
    hf_greedy,
    hf_logprobs,
    load_hf_model,
    perturbed_state_dict,
)

from megatron_dapo.rollout import RolloutEngine, VLLMEngine  # noqa: E402
from megatron_dapo.rollout.engine import new_stats  # noqa: E402
from megatron_dapo.rollout.weight_transport import bucket_digest, corrupted  # noqa: E402
from megatron_dapo.types import Response  # noqa: E402

ATOL = 1e-4  # float32 engine vs float32 transformers: measured <= 1e-5 on this model


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["What is 12 + 30?", "Compute 7 * 6.", "The sum of the first ten positive integers"]
    chat = tok.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True, tokenize=False)
    return [tok(chat)["input_ids"]] + [tok(t)["input_ids"] for t in texts[1:]]


def greedy(engine, prompts, max_tokens=12, **kw):
    return engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens, **kw)


def assert_logprobs_match(model, prompt, resp: Response, temperature: float) -> None:
    ref = hf_logprobs(model, prompt, resp.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(resp.logprobs), ref, atol=ATOL, rtol=0)


def test_engine_satisfies_the_interface(engine):
    """What the trainer may call, the way RolloutEngine documents it: every method with the protocol's parameters
    (names, order, kinds, defaults: a caller passing stop_token_ids= or seed= by name works), and the counters."""
    assert isinstance(engine, RolloutEngine)  # only checks that the names exist
    for name in ("generate", "sleep", "wake", "update_weights", "finish_weight_update"):
        want = list(inspect.signature(getattr(RolloutEngine, name)).parameters.values())
        got = list(inspect.signature(getattr(VLLMEngine, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want], name
    assert set(new_stats()) <= set(engine.stats)
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in engine.stats.values()), engine.stats


def test_the_cpu_kv_cache_holds_a_full_batch_of_full_length_sequences_and_no_more(engine, model_dir, tmp_path):
    """Sized to the model, read back from the running engine: 256 sequences x 256 tokens x K and V x the layers x
    the KV heads x head_dim x 4 bytes (fp32), 32 MiB here where it was a fixed 1 GiB. At most 1 GiB for a big model,
    and 1 GiB where config.json does not give the attention's shape; half as much in bf16; lengths round up to 128."""
    import json

    from megatron_dapo.rollout.vllm_env import cpu_kv_cache_bytes

    c = json.loads((model_dir / "config.json").read_text())
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    assert engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 256 * 256 * per_token * 4
    assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 256
    assert cpu_kv_cache_bytes(str(model_dir), "bf16", 200) == 256 * 256 * per_token * 2
    big = {"num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192, "num_hidden_layers": 80}
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(big))
    assert cpu_kv_cache_bytes(str(tmp_path / "big"), "bfloat16", 4096) == 1 << 30
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"n_layer": 2}))
    for where in ("Qwen/Qwen2.5-0.5B", str(tmp_path / "odd")):
        assert cpu_kv_cache_bytes(where, "fp32", 256) == 1 << 30


def test_greedy_matches_transformers_generate(engine, hf_model, tok, prompts):
    """Greedy tokens, text and logprobs are transformers'; and nothing is compiled on CPU: vLLM torch.compiles a
    helper of its sampler on a process's first sampled step (seconds of Inductor at every engine start)."""
    from torch._dynamo.utils import counters

    compiled = counters["frames"]["total"]
    out = greedy(engine, prompts)
    assert counters["frames"]["total"] == compiled
    assert [len(rs) for rs in out] == [1, 1, 1]
    for prompt, (resp,) in zip(prompts, out):
        assert resp.token_ids == hf_greedy(hf_model, prompt, 12, tok.eos_token_id)
        assert resp.text == tok.decode(resp.token_ids, skip_special_tokens=True)
        assert_logprobs_match(hf_model, prompt, resp, temperature=1.0)  # greedy: log_softmax of the raw logits


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_are_the_temperature_scaled_distribution(engine, hf_model, prompts, temperature):
    out = engine.generate(prompts, n=2, temperature=temperature, top_p=1.0, max_tokens=16, seed=7)
    for prompt, rs in zip(prompts, out):
        for resp in rs:
            assert len(resp.logprobs) == len(resp.token_ids)
            assert_logprobs_match(hf_model, prompt, resp, temperature)
    if temperature != 1.0:  # processed (post-temperature) logprobs, not vLLM's default raw ones
        resp = out[0][0]
        raw = hf_logprobs(hf_model, prompts[0], resp.token_ids, 1.0)
        assert (torch.tensor(resp.logprobs) - raw).abs().max() > 1e-2


def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine, hf_model, prompts):
    top_p, temperature = 0.5, 0.8
    (resp,) = engine.generate(prompts[:1], n=1, temperature=temperature, top_p=top_p, max_tokens=8, seed=3)[0]
    ids = torch.tensor([prompts[0] + resp.token_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompts[0]) - 1 : -1] / temperature
    for k, tok_id in enumerate(resp.token_ids):
        probs = logits[k].softmax(-1)
        sorted_p, order = probs.sort(descending=True)
        keep = order[(sorted_p.cumsum(0) - sorted_p) < top_p]  # the smallest prefix with mass >= top_p
        assert tok_id in keep.tolist()
        ref = (probs[tok_id] / probs[keep].sum()).log()
        assert abs(resp.logprobs[k] - ref.item()) < ATOL


def test_n_samples_per_prompt_in_prompt_order(engine, prompts):
    n = 4
    out = engine.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=10, seed=11)
    assert [len(rs) for rs in out] == [n] * len(prompts)
    assert all(len({tuple(r.token_ids) for r in rs}) > 1 for rs in out)  # distinct samples, not copies
    again = engine.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=10, seed=11)
    assert [[r.token_ids for r in rs] for rs in again] == [[r.token_ids for r in rs] for rs in out]
    other = engine.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=10, seed=12)
    assert [[r.token_ids for r in rs] for rs in other] != [[r.token_ids for r in rs] for rs in out]
    # unseeded calls continue the engine's own random stream and leave the trainer's global RNG alone
    trainer_rng = torch.random.get_rng_state()
    a, b = (engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=10) for _ in range(2))
    assert torch.equal(torch.random.get_rng_state(), trainer_rng)
    # b repeats a only if each of its 6 samples repeats; no sample has an outcome of p > 0.09 (this model's tokens have
    # p <= 0.3, EOS p <= 0.08, measured): probability < 0.09^6 < 1e-6
    assert [[r.token_ids for r in rs] for rs in a] != [[r.token_ids for r in rs] for rs in b]
    # output i belongs to prompt i: each prompt alone gives the same greedy continuation as in the batch
    batch = greedy(engine, prompts[::-1])
    for i, prompt in enumerate(prompts[::-1]):
        assert greedy(engine, [prompt])[0][0].token_ids == batch[i][0].token_ids


def test_truncated_exactly_when_the_length_limit_ends_a_response(engine, tok, prompts):
    (cut,) = greedy(engine, prompts[:1], max_tokens=6)[0]
    assert cut.truncated and len(cut.token_ids) == 6
    stop = cut.token_ids[2]  # the greedy path emits it at step 3: stopping on it ends the response early
    (stopped,) = greedy(engine, prompts[:1], max_tokens=6, stop_token_ids=[stop])[0]
    first = cut.token_ids.index(stop)
    assert not stopped.truncated
    assert stopped.token_ids == cut.token_ids[: first + 1]  # the stop token is kept (the policy learns to emit it)
    assert len(stopped.logprobs) == len(stopped.token_ids)
    # sampled: truncated <=> at the limit without having emitted EOS or a stop token
    stops = {tok.eos_token_id, *cut.token_ids[:3]}
    out = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=8, stop_token_ids=sorted(stops), seed=2)
    flags = []
    for resp in (r for rs in out for r in rs):
        ended_by_stop = resp.token_ids[-1] in stops
        assert not any(t in stops for t in resp.token_ids[:-1])
        assert resp.truncated == (len(resp.token_ids) == 8 and not ended_by_stop)
        flags.append(resp.truncated)
    assert not all(flags)  # at this fixed seed some sample met a stop token


def test_update_weights_changes_generation_to_the_new_policy(engine, hf_model, model_dir, tok, prompts):
    before = greedy(engine, prompts)
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed_state_dict(hf_model)
    new_model = load_hf_model(model_dir, new)
    items = list(new.items())
    try:
        for start in range(0, len(items), 10):  # bucket by bucket with its digest, as the weight bridge streams them
            bucket = items[start : start + 10]
            engine.update_weights(bucket, bucket_digest(bucket))
        engine.finish_weight_update()  # already applied when the last tensor arrived: a no-op
        after = greedy(engine, prompts)
        assert [r[0].token_ids for r in after] != [r[0].token_ids for r in before]
        for prompt, (resp,) in zip(prompts, after):
            assert resp.token_ids == hf_greedy(new_model, prompt, 12, tok.eos_token_id)
        sampled = engine.generate(prompts, n=2, temperature=0.7, top_p=1.0, max_tokens=12, seed=5)
        for prompt, rs in zip(prompts, sampled):
            for resp in rs:
                assert_logprobs_match(new_model, prompt, resp, 0.7)
    finally:
        engine.update_weights(original.items())
    restored = greedy(engine, prompts)
    assert [r[0].token_ids for r in restored] == [r[0].token_ids for r in before]
    assert engine.stats["weight_updates"] >= 2


def test_incomplete_or_bad_weight_updates_leave_the_engine_intact(engine, hf_model, prompts):
    before = [r[0].token_ids for r in greedy(engine, prompts)]
    new = perturbed_state_dict(hf_model)
    dropped = "model.layers.0.self_attn.k_proj.weight"
    engine.update_weights((k, v) for k, v in new.items() if k != dropped)
    with pytest.raises(RuntimeError, match=r"incomplete.*1 tensors missing.*k_proj.*keeps its previous weights"):
        engine.finish_weight_update()
    assert [r[0].token_ids for r in greedy(engine, prompts)] == before
    # an incomplete stream followed by generate(): the same error, and generation is still the old policy
    engine.update_weights(list(new.items())[:5])
    with pytest.raises(RuntimeError, match="incomplete when generate"):
        greedy(engine, prompts)
    assert [r[0].token_ids for r in greedy(engine, prompts)] == before
    # an unknown name or a wrong shape is rejected before anything is loaded
    with pytest.raises(ValueError, match="unknown tensors.*not_a_weight"):
        engine.update_weights([("model.not_a_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape mismatches.*embed_tokens"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(7, 128))])
    assert [r[0].token_ids for r in greedy(engine, prompts)] == before
    # a bucket whose bytes are not the ones its digest was taken of (one bit flipped on the way): the whole update
    # is dropped before anything of it is loaded, naming the bucket's first tensor
    items = list(new.items())
    engine.update_weights(items[:10], bucket_digest(items[:10]))
    with pytest.raises(RuntimeError, match=r"a bucket of 10 tensors arrived damaged: its first tensor 'model\.layers"):
        engine.update_weights(corrupted(items[10:20]), bucket_digest(items[10:20]))
    engine.update_weights(items[20:], bucket_digest(items[20:]))  # the rest: still not a complete update
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.finish_weight_update()
    assert [r[0].token_ids for r in greedy(engine, prompts)] == before


def test_a_failed_sample_is_retried_once_then_raises(engine, prompts, monkeypatch):
    real = engine.llm.generate
    calls = []

    def abort_first_sample(times):
        def fake(*args, **kwargs):
            outs = real(*args, **kwargs)
            calls.append(len(outs))
            if len(calls) <= times:
                outs[0].outputs[0] = dataclasses.replace(outs[0].outputs[0], finish_reason="abort")
            return outs

        return fake

    stats0 = dict(engine.stats)
    monkeypatch.setattr(engine.llm, "generate", abort_first_sample(1))
    out = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=5, seed=1)
    assert [len(rs) for rs in out] == [2, 2, 2] and calls == [3, 1]  # only the failed prompt went again
    assert engine.stats["retries"] == stats0["retries"] + 1
    calls.clear()
    monkeypatch.setattr(engine.llm, "generate", abort_first_sample(2))
    with pytest.raises(RuntimeError, match="1 of 1 retried samples failed again"):
        engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=5, seed=1)
    assert engine.stats["failures"] == stats0["failures"] + 1
    assert engine.stats["requests"] == stats0["requests"] + 12
    assert engine.stats["generated_tokens"] > stats0["generated_tokens"] and engine.stats["tokens_per_s"] > 0


def test_an_engine_that_dies_is_reported_with_its_model_path(engine, prompts, monkeypatch):
    def die(*args, **kwargs):
        raise RuntimeError("EngineCore died")

    monkeypatch.setattr(engine.llm, "generate", die)
    with pytest.raises(RuntimeError, match=f"{re.escape(engine.model_path)}.*failed during generate: EngineCore died"):
        greedy(engine, prompts)
    with pytest.raises(RuntimeError, match="unusable"):  # no later call pretends it still works
        greedy(engine, prompts)
    engine._broken = None  # the real engine is fine: give it back to the other tests


def test_sleep_and_wake_are_no_ops_on_cpu(engine, prompts):
    before = greedy(engine, prompts)
    engine.sleep()
    engine.wake()
    assert [r[0].token_ids for r in greedy(engine, prompts)] == [r[0].token_ids for r in before]
    with pytest.raises(ValueError, match="sleep mode"):
        VLLMEngine("unused", enable_sleep_mode=True)


def test_bad_model_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(RuntimeError, match=f"cannot start.*{re.escape(missing)}"):
        VLLMEngine(missing)
    with pytest.raises(RuntimeError, match=f"failed to start for model {re.escape(repr(str(tmp_path)))}"):
        VLLMEngine(str(tmp_path))  # a directory without a model


def test_bad_arguments_are_rejected(engine, prompts):
    with pytest.raises(ValueError, match="n=0"):
        engine.generate(prompts, n=0, temperature=1.0, top_p=1.0, max_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, n=1, temperature=1.0, top_p=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 300], n=1, temperature=1.0, top_p=1.0, max_tokens=4)


def test_from_config_maps_the_trainer_sections(monkeypatch):
    from megatron_dapo.config import load_config

    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, **kw: seen.update(kw))
    cfg = load_config(None, ["model.hf_path=/models/qwen", "model.dtype=bf16", "seed=3"])
    VLLMEngine.from_config(cfg.model, cfg.rollout, tp=2, max_prompt_length=100, seed=3, gpu_memory_utilization=0.4)
    assert seen["model_path"] == "/models/qwen" and seen["dtype"] == "bf16" and seen["seed"] == 3
    assert seen["max_model_len"] == 100 + cfg.rollout.max_response_length and seen["tensor_parallel_size"] == 2
    assert seen["gpu_memory_utilization"] == 0.4


def test_a_close_before_the_process_exits_skips_the_shutdown_s_heap_walks(model_dir, monkeypatch):
    """vLLM's shutdown unfreezes what start-up froze and collects the whole heap; close(exiting=True) runs it with
    gc.unfreeze() and gc.collect() doing nothing and puts both back after (tests/test_fp8.py checks it on a real
    engine); a plain close lets them run: a process that builds another engine gets the memory back."""
    import gc
    import types

    import megatron_dapo.rollout.vllm_engine as ve

    class Core:  # as vLLM's EngineCore.shutdown, through the gc module
        def shutdown(self):
            gc.unfreeze()
            gc.collect()

    monkeypatch.setattr(ve.VLLMEngine, "_start", lambda self, **kw: types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(engine_core=Core())))  # fmt: skip
    collect, unfreeze = gc.collect, gc.unfreeze
    try:
        with full_collections() as full:
            gc.freeze()
            frozen = gc.get_freeze_count()
            ve.VLLMEngine(str(model_dir)).close(exiting=True)
            assert not full and gc.get_freeze_count() > frozen // 2  # still frozen (less what refcounts freed)
            assert gc.collect is collect and gc.unfreeze is unfreeze  # put back
            ve.VLLMEngine(str(model_dir)).close()
            assert full == ["start", "stop"] and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_gpu_path_sleeps_streams_buckets_and_wakes_in_order(model_dir, hf_model, prompts, monkeypatch):
    import megatron_dapo.rollout.vllm_engine as ve

    monkeypatch.setattr(ve, "has_cuda", lambda: True)
    monkeypatch.setattr(ve.VLLMEngine, "_start", lambda self, **kw: FakeLLM())
    eng = ve.VLLMEngine(str(model_dir))
    assert eng.enable_sleep_mode and eng.on_gpu
    items = list(hf_model.state_dict().items())
    eng.sleep()
    eng.update_weights(items[:10])  # loaded at once (GPU): the weights wake first, the KV cache stays asleep
    eng.update_weights(items[10:])  # the last tensor arrived: the update completes by itself
    eng.wake()
    assert eng.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("load", 10),
        ("load", len(items) - 10),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    assert sorted(eng.llm.loaded) == sorted(n for n, _ in items)
    # an update that stops half-way leaves mixed weights on a GPU: generation is refused until a full one
    eng.update_weights(items[:5])
    with pytest.raises(RuntimeError, match="mixed weights"):
        eng.finish_weight_update()
    with pytest.raises(RuntimeError, match="half-way"):
        eng.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    eng.update_weights(items)
    eng._check_ready()  # a full update makes it usable again


def test_the_gpu_engine_samples_without_flashinfer_and_runs_in_process(monkeypatch):
    # vLLM 0.25's GPU sampler imports FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0: without it the engine
    # failed to start on the H100; a user's own setting stays.
    from megatron_dapo.rollout.vllm_env import gpu_env_defaults, set_engine_env

    assert gpu_env_defaults(lambda name: False) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert gpu_env_defaults(lambda name: name == "flashinfer") == {}
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    set_engine_env(on_gpu=True)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    set_engine_env(on_gpu=True)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    # the engine core stays in this process on a GPU too: the async rollout process's engine (no torchrun) ran its
    # core in a process of its own on the H200 and could not take a weight update (its function is not serializable)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    set_engine_env(on_gpu=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
