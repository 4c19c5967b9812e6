"""The Megatron policy against Hugging Face transformers, the train step's sign, and layout checks.

Megatron runs in torchrun subprocesses (its global state and the CPU patches stay out of
the test process), every check of the file a job of the test run's two launches (1 and 2 processes,
tests/conftest.py megatron_runs); the reference is transformers' own model with the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron_helpers import (
    Job,
    hf_response_logprobs,
    random_batch,
    result,
    save_case,
    tiny_hf_model,
)

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.convert.layouts import hf_to_megatron, megatron_to_hf
from megatron_dapo.model.arch import ArchError, ModelArch
from megatron_dapo.model.microbatch import TrainSample, collate, cp_slice, cp_unslice, pack_microbatches
from megatron_dapo.model.parallel import LayoutError, check_layout
from megatron_dapo.model.sharding import tp_shard, tp_unshard

VOCAB = 250  # not a multiple of 128: the padded vocabulary columns must not count


def hf_reference(model, batch: list[dict], temperature: float) -> list[dict[str, torch.Tensor]]:
    with torch.no_grad():
        return [dict(zip(("logp", "entropy"), hf_response_logprobs(model, b, temperature))) for b in batch]


LOGPROB_RUNS = {  # name: (family, tied, nproc, overrides, slow); the default attention is SDPA with packed rows
    "qwen2": ("qwen2", False, 1, [], False),
    "qwen2-padded": ("qwen2", False, 1, ["train.packed_sequences=false"], False),
    "qwen2-unfused": ("qwen2", False, 1, ["model.attention=unfused"], False),
    "llama-tied": ("llama", True, 1, [], True),
    "qwen2-tp2": ("qwen2", False, 2, ["parallel.tp=2"], True),
    "llama-tied-pp2": ("llama", True, 2, ["parallel.pp=2"], True),
    # Qwen3: per-head q/k RMSNorm, no QKV bias, head_dim 32 where hidden/heads is 16; Qwen2's four layouts
    "qwen3": ("qwen3", False, 1, [], False),
    "qwen3-padded": ("qwen3", False, 1, ["train.packed_sequences=false"], True),
    "qwen3-unfused": ("qwen3", False, 1, ["model.attention=unfused"], True),
    "qwen3-tp2": ("qwen3", False, 2, ["parallel.tp=2"], True),
}


def logprob_model(family: str, tied: bool):
    return tiny_hf_model(family, seed=3, vocab_size=VOCAB, tied=tied)


def advantage_batch(sign: float) -> list[dict]:
    batch = random_batch(4, 12, VOCAB, seed=6)
    for b in batch:
        b["advantage"], b["in_loss"] = sign, True
    return batch


def megatron_jobs(root: Path) -> dict[str, Job]:
    """Every worker run of this file (tests/conftest.py megatron_runs runs them)."""
    jobs = {}
    # entropy in chunks of 5 (tp2: 10) positions of the 256 padded columns: uneven chunk boundaries in every row set
    chunk = ("--entropy-chunk-elements", "1280")
    for name, (family, tied, nproc, overrides, slow) in LOGPROB_RUNS.items():
        case = save_case(logprob_model(family, tied), random_batch(6, 14, VOCAB, seed=5), root / f"case-{name}")
        jobs[name] = Job(nproc, case, ("--mode", "logprobs", "--temperature", "0.7", *chunk, *overrides), slow)
    for nproc in (1, 2):  # the attention modules alone, on the policy's config: all heads, then half of them (TP 2)
        overrides = ("parallel.tp=2",) if nproc == 2 else ()
        jobs[f"attention{nproc}"] = Job(nproc, jobs["qwen2"].case, ("--mode", "attention", *overrides))
    case = save_case(logprob_model("qwen2", False), random_batch(4, 14, VOCAB, seed=5), root / "case-bf16")
    jobs["bf16"] = Job(1, case, ("--mode", "logprobs", "--temperature", "1.0", "model.dtype=bf16"))
    for sign in (1.0, -1.0):
        case = save_case(tiny_hf_model("qwen2", seed=4, vocab_size=VOCAB), advantage_batch(sign), root / f"c{sign}")
        # 4 sequences of 12 tokens: the train step's budget holds one (4 micro-batches), the forward passes' all four
        budgets = ("train.max_tokens_per_microbatch=14", "train.max_tokens_per_forward=56")
        jobs[f"steps{sign}"] = Job(1, case, ("--mode", "steps", "--steps", "3", "--temperature", "1.0", *budgets))
    return jobs


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if run[-1] else []) for n, run in LOGPROB_RUNS.items()],
)
def test_logprobs_and_entropy_match_transformers(ran, name):
    family, tied = LOGPROB_RUNS[name][:2]
    got = result(ran, name)
    want = hf_reference(logprob_model(family, tied), random_batch(6, 14, VOCAB, seed=5), 0.7)
    for g, w in zip(got["logprobs"], want):
        torch.testing.assert_close(g["logp"].double(), w["logp"], rtol=0, atol=1e-5)
        torch.testing.assert_close(g["entropy"].double(), w["entropy"], rtol=0, atol=1e-5)


def test_packed_rows_take_sdpa_and_padded_rows_too(ran):
    """The runs above compare with transformers; here the layouts they ran: packed rows by default, since SDPA
    takes them (one call per sequence on CPU), padded when asked or with Megatron's unfused attention."""
    assert [result(ran, n)["packed"] for n in ("qwen2", "qwen2-padded", "qwen2-unfused")] == [True, False, False]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sdpa_attention_matches_megatrons_unfused_attention(ran, nproc):
    """model/attention.py against the DotProductAttention it replaces, same inputs: output and q, k, v gradients
    for grouped heads (2 KV groups under 4 query heads; one each per rank at TP 2), one row, a one-token row, KV heads
    expanded instead of grouped, and packed rows (one SDPA call per sequence) against each sequence alone."""
    got = result(ran, f"attention{nproc}")
    cases = [k for k in got if k.startswith("attention_")]
    assert len(cases) == 7, cases
    for case in cases:
        diff, scale = got[case]
        assert scale > 0.1 and diff <= 2e-6 * scale, (case, diff, scale)


def test_megatron_is_imported_without_compiling_on_cpu(ran):
    """On CPU a process imports Megatron with its JIT fuser off (model/cpu_compat.py): nothing has imported dynamo
    by then (~3 s of every Megatron process otherwise) and torch.compile is torch's own again for what comes after;
    nor wandb, which Megatron's timers would import (~0.9 s; tests/test_trainer.py's W&B runs import it after)."""
    want = {"dynamo_imported": False, "torch_compile_restored": True, "wandb_imported": False}
    assert result(ran, "qwen2")["eager_megatron"] == want


def test_bf16_policy_tracks_fp32_transformers(ran):
    """bf16 (the default precision): same logprobs up to bf16 rounding of weights and activations."""
    got = result(ran, "bf16")
    want = hf_reference(logprob_model("qwen2", False), random_batch(4, 14, VOCAB, seed=5), 1.0)
    diff = max(float((g["logp"].double() - w["logp"]).abs().max()) for g, w in zip(got["logprobs"], want))
    # differs (it is bf16), but only by rounding: 0.0023 here (0.0014-0.0023 over model seeds 3, 4, 8), where a
    # log-softmax taken in bf16 rather than fp32 errs by 0.025
    assert 0 < diff < 0.006, diff


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_train_steps_move_logprobs_with_the_advantage(ran, sign):
    """Positive advantages raise the sampled tokens' logprobs, negative ones lower them: sign and scale end to end."""
    got = result(ran, f"steps{sign}")
    before = torch.cat([x["logp"] for x in got["before"]])
    after = torch.cat([x["logp"] for x in got["after"]])
    assert sign * float((after - before).mean()) > 0.05
    assert (sign * (after - before) > 0).float().mean() > 0.9  # nearly every token moves the right way
    first = got["metrics"][0]
    assert first["actor/loss"] == pytest.approx(-sign, abs=1e-6)  # on-policy: r = 1, loss = -A per token
    # the forward-only passes (old logprobs) ran under train.max_tokens_per_forward, the train steps under their own
    assert got["passes"] == [(True, 1)] + [(False, 4), (True, 1)] * 3
    assert first["actor/update_applied"] == 1.0 and first["actor/grad_norm"] > 0


def test_pack_microbatches_respects_the_token_budget(seed):
    lengths = [int(x) for x in torch.randint(1, 40, (50,), generator=torch.Generator().manual_seed(seed))]
    groups = pack_microbatches(lengths, 100)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 100
    assert pack_microbatches([150, 3], 100) == [[0], [1]]  # an over-long sequence gets its own
    assert pack_microbatches([10] * 8, 80) == [list(range(8))]
    assert [len(g) for g in pack_microbatches([10] * 8, 40)] == [4, 4]
    assert pack_microbatches([], 10) == []
    # packed rows count real tokens: first-fit decreasing
    assert pack_microbatches([5, 3, 3, 2], 8, packed=True) == [[0, 1], [2, 3]]
    for g in pack_microbatches(lengths, 100, packed=True):
        assert sum(lengths[i] for i in g) <= 100 or len(g) == 1


def test_padded_and_packed_layouts_hold_the_same_tokens(seed):
    """The THD layout (Transformer Engine) against the padded one: same targets, advantages and masks per sample."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(5):
        p, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        samples.append(
            TrainSample(
                prompt_ids=torch.randint(1, 50, (p,), generator=g).tolist(),
                response_ids=torch.randint(1, 50, (r,), generator=g).tolist(),
                advantage=float(k) - 2,
                old_logp=torch.randn(r, generator=g),
                in_loss=k != 3,
            )
        )
    idx = [4, 0, 2, 3, 1]
    padded = collate(samples, idx, torch.device("cpu"), multiple=4)
    packed = collate(samples, idx, torch.device("cpu"), multiple=4, packed=True)
    assert packed.tokens.shape[0] == 1 and packed.tokens.shape[1] % 4 == 0 and padded.tokens.shape[1] % 4 == 0
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    cu = packed.packed_seq_params.cu_seqlens_q.tolist()
    assert cu[:6] == [0] + [
        sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx[:k]) for k in range(1, 6)
    ]
    assert cu[-1] == packed.tokens.shape[1] and (len(cu) == 6) == (total % 4 == 0)
    for layout in (padded, packed):
        assert [sp[0] for sp in layout.spans] == idx
        assert int(layout.response_mask.sum()) == sum(len(s.response_ids) for s in samples)
        for i, row, start, end in layout.spans:
            s = samples[i]
            assert layout.targets[row, start:end].tolist() == s.response_ids
            assert layout.tokens[row, start + 1 - len(s.prompt_ids) : start + 1].tolist() == s.prompt_ids
            assert torch.equal(layout.old_logp[row, start:end], s.old_logp)
            assert (layout.advantages[row, start:end] == s.advantage).all()
            assert bool(layout.loss_mask[row, start:end].all()) == s.in_loss
            assert layout.position_ids[row, start] == len(s.prompt_ids) - 1  # positions restart per sequence
        # no target crosses into the next sequence: outside the spans nothing is masked in
        assert not (layout.loss_mask & ~layout.response_mask).any()


@pytest.mark.parametrize(
    "tp, sp, cp, fp8, multiple",
    [
        (1, False, 1, False, 1),
        (1, False, 1, True, 16),
        (2, False, 1, True, 16),
        (2, True, 1, False, 2),
        (2, True, 1, True, 32),
        (4, True, 2, True, 256),
        (1, False, 2, True, 64),
        (2, False, 3, False, 6),
    ],
)
def test_fp8_micro_batches_are_padded_to_16_tokens_a_rank(seed, tp, sp, cp, fp8, multiple):
    """Under FP8 each rank's GEMM token count must divide by 16 after the sequence-parallel (tp) and context-parallel
    (2 cp chunks) splits: rows round up to the product 16 x tp x 2cp. The padding carries no loss and no gradient:
    it is out of the response and loss masks, which the token mean and its global count read."""
    from megatron_dapo.model.microbatch import row_multiple
    from megatron_dapo.model.parallel import Layout

    layout = Layout(tp * cp, 0, 0, tp, 1, None, cp, 1, use_te=True, sequence_parallel=sp, attention="te")
    assert row_multiple(layout, fp8) == multiple
    g = torch.Generator().manual_seed(seed)
    samples = [
        TrainSample(torch.randint(1, 50, (p,), generator=g).tolist(), torch.randint(1, 50, (r,), generator=g).tolist())
        for p, r in ((3, 5), (1, 1), (7, 2))
    ]
    for packed in (False, True):
        mb = collate(samples, [0, 1, 2], torch.device("cpu"), multiple, packed)
        width = 19 if packed else 9  # every sequence back to back, or the longest (7 + 2)
        assert mb.tokens.shape[1] == -(-width // multiple) * multiple
        per_rank = mb.tokens.numel() // (tp if sp else 1) // cp
        assert not fp8 or per_rank % 16 == 0
        assert int(mb.response_mask.sum()) == int(mb.loss_mask.sum()) == 8  # the responses' tokens, no padding


def arch_of(heads=4, kv=2, layers=2, **kw) -> ModelArch:
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        **kw,
    }
    return ModelArch.from_hf_config(cfg)


@pytest.mark.parametrize(
    "par, world, needle",
    [
        (ParallelConfig(tp=3), 3, "parallel.tp=3 must divide the model's 4 attention heads"),
        (ParallelConfig(tp=4), 4, "parallel.tp=4 must divide the model's 2 query groups"),
        (ParallelConfig(pp=4), 4, "the model's 2 layers do not split evenly over parallel.pp=4 stages"),
        (ParallelConfig(pp=2, vpp=2), 2, "do not split evenly over parallel.pp x parallel.vpp = 2 x 2"),
        (
            ParallelConfig(tp=2),
            3,
            "world size 3 is not a multiple of parallel.tp x parallel.pp x parallel.cp = 2 x 1 x 1",
        ),
        (ParallelConfig(cp=2), 2, "parallel.cp=2 needs Transformer Engine"),
    ],
)
def test_impossible_layouts_fail_fast(par, world, needle):
    with pytest.raises(LayoutError) as e:
        check_layout(arch_of(), par, ModelConfig(), world)
    assert needle in str(e.value)


def test_layout_checks_pass_and_count_dp():
    layout = check_layout(arch_of(layers=4), ParallelConfig(tp=2, pp=2), ModelConfig(), 8)
    assert (layout.dp, layout.use_te, layout.sequence_parallel) == (2, False, True)  # SP on the local spec too
    assert not check_layout(
        arch_of(), ParallelConfig(tp=2, sequence_parallel=False), ModelConfig(), 2
    ).sequence_parallel
    with pytest.raises(LayoutError, match="model.fp8='e4m3' needs Transformer Engine"):
        check_layout(arch_of(), ParallelConfig(), ModelConfig(fp8="e4m3"), 1)
    with pytest.raises(LayoutError, match="transformer_impl='transformer_engine'"):
        check_layout(arch_of(), ParallelConfig(), ModelConfig(transformer_impl="transformer_engine"), 1)


def test_bad_hf_configs(tmp_path):
    with pytest.raises(ArchError, match="not supported; expected one of"):
        ModelArch.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    qwen3 = json.loads(tiny_hf_model("qwen3").config.to_json_string())
    for other in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):  # model_type qwen3 does not make them Qwen3
        with pytest.raises(ArchError) as e:
            ModelArch.from_hf_config({**qwen3, "architectures": [other]})
        assert len(str(e.value).splitlines()) == 1 and f"field 'architectures'=['{other}']" in str(e.value)
    with pytest.raises(ArchError) as e:
        ModelArch.from_hf_config({**qwen3, "use_sliding_window": True, "sliding_window": 16}, "Qwen3/config.json")
    assert str(e.value) == (
        "Qwen3/config.json: field 'use_sliding_window'=true is not supported; expected false (full attention)"
    )
    with pytest.raises(ArchError, match="field 'head_dim' is missing; a qwen3 config needs it"):
        ModelArch.from_hf_config({k: v for k, v in qwen3.items() if k != "head_dim"})
    with pytest.raises(ArchError, match="field 'intermediate_size' is missing"):
        ModelArch.from_hf_config(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
            }
        )
    with pytest.raises(ArchError, match="'num_key_value_heads'=3 must divide num_attention_heads=4"):
        arch_of(kv=3)
    with pytest.raises(ArchError, match="no config.json"):
        ModelArch.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchError, match="not valid JSON"):
        ModelArch.from_hf_dir(tmp_path)


def test_qwen3_arch_reads_head_dim_norms_and_bias_from_the_config():
    """head_dim is the config's (32), not hidden/heads (16); the q/k norms are on; the QKV bias is attention_bias."""
    config = json.loads(tiny_hf_model("qwen3").config.to_json_string())
    arch = ModelArch.from_hf_config(config)
    assert (arch.family, arch.head_dim, arch.qk_layernorm, arch.qkv_bias) == ("qwen3", 32, True, False)
    assert ModelArch.from_hf_config({**config, "attention_bias": True}).qkv_bias
    assert not ModelArch.from_hf_config(json.loads(tiny_hf_model("qwen2").config.to_json_string())).qk_layernorm


def test_the_tiny_qwen3_holds_what_a_qwen3_port_gets_wrong(tiny_qwen3):
    """model/tiny.py's Qwen3: head_dim (64) is not hidden/heads (32), no QKV bias, and every layer's q_norm and k_norm
    are neither ones (transformers' init) nor equal, so a dropped, swapped or derived piece changes its outputs."""
    from safetensors.torch import load_file

    arch = ModelArch.from_hf_dir(tiny_qwen3())
    shape = (arch.family, arch.num_layers, arch.head_dim, arch.hidden_size // arch.num_attention_heads)
    assert shape == ("qwen3", 2, 64, 32)
    assert arch.qk_layernorm and not arch.qkv_bias
    weights = load_file(tiny_qwen3() / "model.safetensors")
    assert not any(name.endswith("_proj.bias") for name in weights)
    for i in range(arch.num_layers):
        q, k = (weights[f"model.layers.{i}.self_attn.{n}_norm.weight"] for n in "qk")
        assert q.shape == k.shape == (64,)
        assert not torch.equal(q, k) and not torch.equal(q, torch.ones(64)) and not torch.equal(k, torch.ones(64))


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_layout_maps_round_trip_exactly(family, tied):
    model = tiny_hf_model(family, seed=7, vocab_size=VOCAB, tied=tied)
    arch = ModelArch.from_hf_config(json.loads(model.config.to_json_string()))
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    full = hf_to_megatron(hf, arch)
    back = dict(kv for name, t in full.items() for kv in megatron_to_hf(name, t, arch))
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    for name, t in full.items():  # TP=2 slices reassemble to the same tensor, fc1's gate/up included
        assert torch.equal(tp_unshard(name, [tp_shard(name, t, r, 2) for r in range(2)]), t), name
    with pytest.raises(ValueError, match="expected .* from config.json"):
        hf_to_megatron({**hf, "model.norm.weight": torch.zeros(3)}, arch)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_split_is_load_balanced_and_invertible(cp):
    length = 2 * cp * 3
    t = torch.arange(2 * length).reshape(2, length)
    parts = [cp_slice(t, cp, r) for r in range(cp)]
    chunk = length // (2 * cp)
    for r, part in enumerate(parts):  # rank r holds chunk r and chunk 2cp-1-r: one early, one late
        assert part[0].tolist() == list(range(r * chunk, (r + 1) * chunk)) + list(
            range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
        )
    assert torch.equal(cp_unslice(parts), t)
    assert torch.equal(cp_unslice([cp_slice(t.float()[..., None], cp, r) for r in range(cp)])[..., 0], t.float())
