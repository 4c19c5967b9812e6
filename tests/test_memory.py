"""The memory model (megatron_dapo/model/memory.py) against the GPU peaks it was built from, the token-budget defaults
it sets, and the shipped examples it must fit.

Measured: benchmarks/RESULTS.md, "GPU preflight on an H200, fifth run" (train_0.5b and train_1.5b rows): torch's
max_memory_allocated over building the policy, a warm-up and three steps of (old-logprob forward, train step), one
4096-token sequence per micro-batch, 8 micro-batches, tp = pp = cp = dp = 1, distributed optimizer, bf16,
Megatron-Core's local layers with the unfused attention, the old (two-pass) vocabulary code, SwiGLU unfused, random
weights of model/perf.py's SHAPES as perf.shape_arch builds them (untied embeddings). No constant was fitted: the
model's terms land within 1% of all six, and TOLERANCE is what the test allows.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from test_examples import ARCHS

from megatron_dapo.config import TrainConfig, field_docs, load_config
from megatron_dapo.model import memory
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.memory import GIB, peak_bytes

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.03
"""Relative error allowed against a measured peak: the model is within 1%; a dropped tensor of one fp32 [T, V] or
of one layer's scores is 4% or more of every point it touches."""

RECORDED = dict(seq=4096, attention="unfused", vocab_path="twopass", fused_swiglu=False, dtype="bf16")
MEASURED = [  # (shape, recompute, peak GiB)
    ("qwen2.5-0.5b", None, 54.59),
    ("qwen2.5-0.5b", "selective", 22.61),
    ("qwen2.5-0.5b", "full", 17.06),
    ("qwen2.5-1.5b", None, 80.32),
    ("qwen2.5-1.5b", "selective", 48.22),
    ("qwen2.5-1.5b", "full", 36.92),
]


def predicted_gib(shape: str, recompute, **kw) -> float:
    return peak_bytes(shape, 4096, recompute=recompute, **{**RECORDED, **kw}) / GIB


@pytest.mark.parametrize("shape,recompute,measured", MEASURED, ids=lambda x: str(x))
def test_model_matches_the_measured_gpu_peaks(shape, recompute, measured):
    predicted = predicted_gib(shape, recompute)
    assert abs(predicted - measured) / measured < TOLERANCE, (predicted, measured)


def test_negative_controls_miss_the_measured_peaks_by_far_more_than_the_tolerance():
    # without the unfused attention's [heads, s, s] probabilities (fp32 and bf16, every layer)
    s = memory.shape_of("qwen2.5-0.5b")
    scores = s.layers * memory.attention_scores_bytes(s, 4096, 4096, attention="unfused") / GIB
    assert scores > 30 and abs(predicted_gib("qwen2.5-0.5b", None) - scores - 54.59) / 54.59 > 10 * TOLERANCE
    # with the embeddings tied, as the Hugging Face models are but the preflight's SHAPES are not
    for shape, recompute, measured in MEASURED:
        if shape == "qwen2.5-1.5b":
            assert abs(predicted_gib(shape, recompute, tied=True) - measured) / measured > TOLERANCE


def test_sdpa_is_below_unfused_by_a_gap_that_grows_as_the_square_of_the_tokens():
    def gap(tokens: int) -> float:
        kw = dict(vocab_path="onepass", recompute=None)
        return peak_bytes("qwen2.5-1.5b", tokens, attention="unfused", **kw) - peak_bytes(
            "qwen2.5-1.5b", tokens, attention="sdpa", **kw
        )

    for tokens in (4096, 8192, 16384, 32768):  # (below 4096 tokens the optimizer step's peak hides both)
        assert gap(tokens) > 0
        assert 3.9 < gap(2 * tokens) / gap(tokens) < 4.1


@pytest.mark.parametrize("attention", memory.ATTENTIONS)
@pytest.mark.parametrize("recompute", memory.RECOMPUTES)
@pytest.mark.parametrize("vocab_path", memory.VOCAB_PATHS)
def test_a_forward_only_pass_is_below_training(attention, recompute, vocab_path):
    kw = dict(attention=attention, recompute=recompute, vocab_path=vocab_path)
    for tokens in (2048, 16384):
        assert peak_bytes("qwen2.5-1.5b", tokens, forward_only=True, **kw) < peak_bytes("qwen2.5-1.5b", tokens, **kw)


def test_a_forward_only_pass_keeps_no_activations():
    """Over the weights, a forward-only pass holds one layer and the logits: as much for 24 layers as for 96."""
    h, ffn, layers, heads, kv, vocab = (896, 4864, 24, 14, 2, 151936)
    for attention in memory.ATTENTIONS:
        over = []
        for n in (layers, 4 * layers):
            shape = (h, ffn, n, heads, kv, vocab)
            static = memory.static_bytes(memory.shape_of(shape))
            over.append(peak_bytes(shape, 8192, attention=attention, forward_only=True) - static)
        assert over[0] == over[1]


def test_the_one_pass_vocabulary_code_is_below_the_old_one():
    for forward_only in (False, True):
        for tokens in (4096, 16384):
            s = memory.shape_of("qwen2.5-1.5b")
            old = memory.vocab_bytes(s, tokens, vocab_path="twopass", forward_only=forward_only)
            new = memory.vocab_bytes(s, tokens, vocab_path="onepass", forward_only=forward_only)
            assert new < old


def test_the_default_budgets_are_the_models_for_the_reference_case():
    train, forward = memory.reference_budgets()
    assert TrainConfig().max_tokens_per_microbatch == train
    assert (
        TrainConfig().max_tokens_per_forward == 0
        and f"allows {forward} tokens" in field_docs(TrainConfig)["max_tokens_per_forward"]
    )
    case = dict(memory.REFERENCE_CASE)
    model, device, headroom = case.pop("model"), case.pop("device_gib"), case.pop("headroom")
    limit = device * (1 - headroom) * GIB
    for budget, forward_only in ((train, False), (forward, True)):
        assert budget % memory.BUDGET_STEP == 0
        assert peak_bytes(model, budget, forward_only=forward_only, **case) <= limit
        assert peak_bytes(model, budget + memory.BUDGET_STEP, forward_only=forward_only, **case) > limit


def test_max_tokens_is_zero_when_the_weights_alone_do_not_fit():
    assert memory.max_tokens("qwen2.5-32b", device_gib=80.0) == 0  # 32.8B parameters x 18 bytes on one GPU
    assert memory.max_tokens("qwen2.5-32b", device_gib=80.0, tp=8, pp=2) > 0


def test_the_first_pipeline_stage_holds_pp_micro_batches():
    assert [memory.in_flight(4, r) for r in range(4)] == [4, 3, 2, 1]
    assert memory.in_flight(4, 0, microbatches=2) == 2
    assert memory.in_flight(2, 0, vpp=2) == 2.5  # Megatron's interleaved warm-up: 2 (pp - 1) + (vpp - 1) pp + 1 chunks
    kw = dict(attention="sdpa", recompute=None, pp=4)
    first, last = (peak_bytes("qwen2.5-7b", 8192, stage=r, **kw) for r in (0, 3))
    assert first > last


def test_a_tied_embedding_split_over_stages_is_on_both():
    s = memory.shape_of("qwen2.5-1.5b", tied=True)
    table = memory.padded_vocab(s, 1) * s.hidden
    layer = memory.layer_params(s, 1)
    assert memory.stage_params(s, 1, 1, 0) == 28 * layer + table + s.hidden
    assert memory.stage_params(s, 1, 2, 0) == 14 * layer + table
    assert memory.stage_params(s, 1, 2, 1) == 14 * layer + table + s.hidden


# ----------------------------------------------------------------------------- the shipped examples

MODELS = {  # an example's '# model:' line -> (model/perf.py SHAPES name or ModelArch, tied as on the Hugging Face Hub)
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2.5-1.5b", True),
    "Qwen/Qwen2.5-7B": ("qwen2.5-7b", False),
    "Qwen/Qwen2.5-32B": ("qwen2.5-32b", False),
    # SHAPES derive head_dim as hidden / heads: Qwen3's is its own (32B: 128, not 80), so the arch from config.json
    "Qwen/Qwen3-8B": (ModelArch.from_hf_config(ARCHS["Qwen/Qwen3-8B"]), False),
    "Qwen/Qwen3-32B": (ModelArch.from_hf_config(ARCHS["Qwen/Qwen3-32B"]), False),
    "Qwen/Qwen3-30B-A3B": (ModelArch.from_hf_config(ARCHS["Qwen/Qwen3-30B-A3B"]), False),
    "Qwen/Qwen3-235B-A22B": (ModelArch.from_hf_config(ARCHS["Qwen/Qwen3-235B-A22B"]), False),
}
NOT_ON_A_GPU = {"tiny-qwen2"}  # the CPU demo's model
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DEVICE_GIB = 80.0


def header(path: Path) -> dict[str, str]:
    """The '# model: NAME' and '# world_size: N' lines of an example's opening comment block."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(m.groups() for m in map(re.compile(r"# (model|world_size): (\S+)").fullmatch, lines) if m)


def example_layout(path: Path) -> tuple[str, dict, object]:
    """(the SHAPES name, peak_bytes's layout keywords, the config) of an example on Transformer Engine's layers,
    with its documented data-parallel size (world_size / (tp pp cp))."""
    cfg, h = load_config(path), header(path)
    shape, tied = MODELS[h["model"]]
    p = cfg.parallel
    kw = dict(
        tied=tied,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        dp=int(h["world_size"]) // (p.tp * p.pp * p.cp),
        vpp=p.vpp,
        sequence_parallel=p.sequence_parallel,
        distributed_optimizer=p.use_distributed_optimizer,
        dtype=cfg.model.dtype,
        recompute=cfg.model.recompute,
        recompute_num_layers=cfg.model.recompute_num_layers,
        attention="te",
        vocab_path="onepass",
        ep=p.ep,
        etp=p.etp,
        router_dtype=cfg.model.moe_router_dtype,
        replay=cfg.model.router_replay != "none",
    )
    return shape, kw, cfg


def test_every_example_names_a_known_model():
    assert {header(p)["model"] for p in EXAMPLES} <= set(MODELS) | NOT_ON_A_GPU


@pytest.mark.parametrize("path", [p for p in EXAMPLES if header(p)["model"] in MODELS], ids=lambda p: p.stem)
def test_example_fits_an_80_gib_gpu(path):
    shape, kw, cfg = example_layout(path)
    limit = DEVICE_GIB * (1 - memory.BUDGET_HEADROOM) * GIB
    a = cfg.algorithm
    reference = a.kl_coef > 0  # the frozen KL reference, on the GPU unless offloaded between its passes
    train = peak_bytes(
        shape, cfg.train.max_tokens_per_microbatch, reference_weights=reference and not a.ref_offload, **kw
    )
    forward = peak_bytes(shape, cfg.train.microbatch_tokens(True), forward_only=True, reference_weights=reference, **kw)
    assert train <= limit, f"{path.name}: train step {train / GIB:.1f} GiB > {limit / GIB:.1f}"
    assert forward <= limit, f"{path.name}: forward-only pass {forward / GIB:.1f} GiB > {limit / GIB:.1f}"


@pytest.mark.parametrize(
    "name,static_gb,layer_inputs_gb",
    [
        ("dapo_math_qwen2.5_32b.yaml", 15, 1.0),
        ("dapo_math_qwen2.5_7b.yaml", 34, 2.5),
        ("dapo_math_qwen3_32b.yaml", 15, 1.0),
        ("dapo_math_qwen3_8b.yaml", 37, 3.6),
    ],
)
def test_the_examples_own_memory_arithmetic(name, static_gb, layer_inputs_gb):
    """Their comments: '~15 GB (bf16 weights 4 GB + fp32 gradients 8 GB + 1/128 of the fp32 Adam state and master
    weights, 3 GB)' and '~34 GB per GPU' before activations; full recompute's layer inputs '~1 GB' and '2.5 GB with
    sequence parallel'."""
    shape, kw, cfg = example_layout(REPO / "examples" / name)
    s = memory.shape_of(shape, kw["tied"])
    static = memory.static_bytes(s, tp=kw["tp"], pp=kw["pp"], cp=kw["cp"], dp=kw["dp"], stage=0, dtype=kw["dtype"])
    assert static / 1e9 == pytest.approx(static_gb, rel=0.1)
    terms = memory.layer_terms(s, tp=kw["tp"], sequence_parallel=kw["sequence_parallel"], recompute="full")
    inputs = s.layers // kw["pp"] * terms["layer.input"] * cfg.train.max_tokens_per_microbatch
    assert inputs / 1e9 == pytest.approx(layer_inputs_gb, rel=0.1)


# ----------------------------------------------------------------------------- the budgets reach the policy


def test_train_config_budget_of_each_pass():
    train = TrainConfig(max_tokens_per_microbatch=4096, max_tokens_per_forward=32768)
    assert (train.microbatch_tokens(False), train.microbatch_tokens(True)) == (4096, 32768)
    same = TrainConfig(max_tokens_per_microbatch=4096, max_tokens_per_forward=0)
    assert same.microbatch_tokens(True) == 4096


def test_the_copied_constants_are_the_code_s():
    """memory.py copies two constants so that it imports no torch: they must stay those of the code it models."""
    from megatron_dapo.model import logprobs, provider

    assert memory.VOCAB_DIVISIBLE_BY == provider.VOCAB_DIVISIBLE_BY
    assert memory.CHUNK_ELEMENTS == logprobs.CHUNK_ELEMENTS


# ----------------------------------------------------------------------------- mixtures of experts

TINY_MOE = dict(
    vocab_size=1024,  # a multiple of 128 x tp up to tp 8: no vocabulary padding to count
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    mlp_only_layers=[1],  # MoE, dense, MoE, MoE
    tie_word_embeddings=False,
)


def hf_rank_params(fields: dict, tp: int, pp: int, ep: int, etp: int, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of pipeline stage `stage`, counted from transformers' own
    Qwen3MoeForCausalLM (meta tensors: shapes only) and split the way Megatron splits each tensor: the attention's
    projections, a dense layer's MLP, the embedding and the output layer over tp; the norms (q/k norms too) and the
    router (mlp.gate) whole on every rank; the experts (fused [E, ...] in memory) E / ep of them, each over etp.
    Layers go to stages in order, layers / pp each; the embedding to the first, the final norm and lm_head to the
    last, their rows padded as the provider pads the vocabulary (to a multiple of VOCAB_DIVISIBLE_BY x tp)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_dapo.model.provider import VOCAB_DIVISIBLE_BY

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in fields.items() if k != "architectures"}))
    per_stage = fields["num_hidden_layers"] // pp
    dense = experts = 0
    for name, t in model.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        where = int(layer[1]) // per_stage if layer else (0 if "embed_tokens" in name else pp - 1)
        if where != stage:
            continue
        if ".mlp.experts." in name:
            assert t.shape[0] % ep == 0 and t.numel() % (ep * etp) == 0
            experts += t.numel() // (ep * etp)
        elif "embed_tokens" in name or "lm_head" in name:
            rows = -(-t.shape[0] // (VOCAB_DIVISIBLE_BY * tp)) * VOCAB_DIVISIBLE_BY * tp
            dense += rows // tp * t.shape[1]
        elif re.search(r"self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj", name):
            dense += t.numel() // tp
        else:
            dense += t.numel()
    return dense, experts


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 4, 2), (1, 2, 8, 1), (4, 4, 2, 4)])
def test_moe_parameters_per_rank_are_the_transformers_models_split_as_megatron_splits_it(tp, pp, ep, etp):
    s = memory.shape_of(ModelArch.from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **TINY_MOE}))
    assert (s.experts, s.topk, s.moe_ffn, s.moe_layers, s.qk_norm) == (8, 2, 48, (0, 2, 3), True)
    for stage in range(pp):
        expected = hf_rank_params(TINY_MOE, tp, pp, ep, etp, stage)
        assert memory.stage_param_split(s, tp, pp, stage, ep=ep, etp=etp) == expected, stage
        assert memory.stage_params(s, tp, pp, stage, ep=ep, etp=etp) == sum(expected)


@pytest.mark.parametrize(
    "example,tp,pp,ep",
    [("Qwen/Qwen3-30B-A3B", 2, 2, 8), ("Qwen/Qwen3-235B-A22B", 4, 2, 64)],
)
def test_the_moe_examples_ranks_hold_the_published_models_split(example, tp, pp, ep):
    """The split the examples' headers quote, against the full-size models built by transformers on the meta device."""
    s = memory.shape_of(MODELS[example][0])
    for stage in range(pp):
        assert memory.stage_param_split(s, tp, pp, stage, ep=ep) == hf_rank_params(ARCHS[example], tp, pp, ep, 1, stage)


@pytest.mark.parametrize("world,tp,pp,ep,etp", [(8, 1, 1, 8, 1), (16, 2, 2, 4, 1), (32, 2, 2, 8, 1), (16, 4, 1, 2, 2)])
def test_the_experts_data_parallel_is_the_layouts(world, tp, pp, ep, etp):
    """memory.expert_data_parallel against model/parallel.py's check_layout (Megatron's expert groups)."""
    from megatron_dapo.config import ModelConfig, ParallelConfig
    from megatron_dapo.model.parallel import check_layout

    arch = ModelArch.from_hf_config(ARCHS["Qwen/Qwen3-30B-A3B"])
    layout = check_layout(arch, ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp), ModelConfig(), world)
    assert memory.expert_data_parallel(tp, 1, layout.dp, ep, etp) == layout.edp
    # context parallel folds into the experts' data parallel: tp 2 x cp 2 x dp 2 = 8 ranks a stage, 4 per expert group
    assert memory.expert_data_parallel(2, 2, 2, 4, 1) == 2
    with pytest.raises(ValueError, match=r"ep x etp = 8 x 2 does not divide tp x cp x dp = 2 x 1 x 4"):
        memory.expert_data_parallel(2, 1, 4, 8, 2)


def test_moe_static_memory_shards_the_dense_state_over_dp_and_the_experts_over_their_own_group():
    """bf16 weights and fp32 gradients of everything on the rank; the fp32 main weights and Adam's two moments of the
    dense part over dp (x cp), of the experts over edp. Checked against the count written out for the 30B-A3B
    example's layout (tp 2, pp 2, ep 8 on 32 GPUs: dp 8, edp 2)."""
    s = memory.shape_of(MODELS["Qwen/Qwen3-30B-A3B"][0])
    dense, experts = hf_rank_params(ARCHS["Qwen/Qwen3-30B-A3B"], 2, 2, 8, 1, 0)
    expected = 2 * (dense + experts) + 4 * (dense + experts) + 12 * dense // 8 + 12 * experts // 2
    assert memory.static_bytes(s, tp=2, pp=2, dp=8, ep=8, stage=0) == expected
    # the experts' state over dp instead of edp would be 4x smaller: 8.2 GB less, a third of the rank's memory
    assert 12 * experts // 2 - 12 * experts // 8 > 0.3 * expected
    unsharded = memory.static_bytes(s, tp=2, pp=2, dp=8, ep=8, stage=0, distributed_optimizer=False)
    assert unsharded == 18 * (dense + experts)
    assert memory.static_bytes(s, tp=2, pp=2, dp=8, ep=8, stage=0, trainable=False) == 2 * (dense + experts)
    assert memory.optimizer_step_temp_bytes(s, tp=2, pp=2, dp=8, ep=8) == 4 * dense // 8 + 4 * experts // 2


def test_moe_layer_activations_against_a_count_written_out():
    """Qwen3-30B-A3B (hidden 2048, 128 experts, top 8, expert width 768), tp 2 with sequence parallel, bf16: per token
    of the micro-batch a rank routes 1/2 of it; each of its halves goes to 8 experts: 4 expert copies per token."""
    s = memory.shape_of(MODELS["Qwen/Qwen3-30B-A3B"][0])
    t = memory.moe_terms(s, tp=2, sequence_parallel=True)
    assert t == {
        "router.input": 2 * 2048 / 2,  # the norm's bf16 output, this rank's half
        "router.topk_indices": 8 * 8 / 2,  # int64 [T, 8]
        "router.softmax": 4 * 8 / 2,  # fp32 over the 8 chosen
        "router.routing_map": 128 / 2,  # bool [128, T]
        "dispatch.indices": 8 * 8 / 2,
        "experts.fc1.input": 2 * 2048 * 4,
        "experts.swiglu.input": 2 * 2 * 768 * 4,
        "experts.probs": 2 * 4,
        "experts.fc2.input": 2 * 768 * 4,
    }
    # the experts' share grows with the busiest rank's load; etp gathers etp x the tokens at 1/etp the width
    load = memory.moe_terms(s, tp=2, sequence_parallel=True, expert_load=2)
    assert all(load[k] == 2 * t[k] if k.startswith("experts.") else load[k] == t[k] for k in t)
    etp = memory.moe_terms(s, tp=2, sequence_parallel=True, etp=2)
    assert etp["experts.fc1.input"] == 2 * t["experts.fc1.input"] and etp["experts.fc2.input"] == t["experts.fc2.input"]
    # an fp32 router keeps fp32 weights; without the fused SwiGLU three more expert-width tensors
    assert memory.moe_terms(s, tp=2, sequence_parallel=True, router_dtype="fp32")["experts.probs"] == 4 * 4
    unfused = memory.moe_terms(s, tp=2, sequence_parallel=True, fused_swiglu=False)
    assert sum(unfused.values()) - sum(t.values()) == 3 * 2 * 768 * 4
    # norm_topk_prob=False: softmax over all 128 experts before the top 8
    pre = memory.moe_terms(dataclasses.replace(s, norm_topk=False), tp=2, sequence_parallel=True)
    assert pre["router.softmax"] == 4 * 128 / 2
    # a MoE layer's terms replace the dense MLP's, the attention's stay
    dense = memory.layer_terms(s, tp=2, sequence_parallel=True)
    moe = memory.layer_terms(s, tp=2, sequence_parallel=True, moe=True)
    assert {k: v for k, v in dense.items() if k in moe} == {k: v for k, v in moe.items() if k in dense}
    assert set(dense) - set(moe) == {"fc1.input", "swiglu.input", "fc2.input"} and set(moe) - set(dense) == set(t)


def test_stages_hold_their_dense_and_moe_layers_in_megatrons_order():
    s = memory.shape_of(ModelArch.from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **TINY_MOE}))
    assert [memory.stage_layers(s, 1, 0)] == [(1, 3)]
    assert [memory.stage_layers(s, 2, r) for r in range(2)] == [(1, 1), (0, 2)]  # layers 0-1, 2-3
    assert [memory.stage_layers(s, 2, r, vpp=2) for r in range(2)] == [(0, 2), (1, 1)]  # chunks 0, 2 and 1, 3
    assert [memory.stage_layers(s, 4, r) for r in range(4)] == [(0, 1), (1, 0), (0, 1), (0, 1)]


def test_moe_peaks_grow_with_the_experts_load_and_with_replayed_routes_under_full_recompute():
    model = MODELS["Qwen/Qwen3-30B-A3B"][0]
    kw = dict(tp=2, pp=2, dp=8, ep=8, sequence_parallel=True, attention="te", stage=0)
    # without recompute every MoE layer keeps its experts' tensors: a busier rank keeps more
    assert peak_bytes(model, 8192, expert_load=2, **kw) > peak_bytes(model, 8192, **kw) + GIB
    # full recompute: each of the stage's 24 MoE layers keeps its replayed int64 [T, 8] routes per micro-batch in
    # flight (2 on the first of 2 stages) for the recomputed forward; tokens / tp of them under sequence parallel
    # (65536 tokens: activations above the optimizer step's temporary, which no replay changes)
    full = dict(kw, recompute="full")
    gap = peak_bytes(model, 65536, replay=True, **full) - peak_bytes(model, 65536, **full)
    assert gap == 2 * 24 * 8 * 8 * 65536 // 2
    # a forward-only pass holds one layer, and the routes fed to all of its stage's MoE layers
    fwd = dict(kw, forward_only=True)
    assert peak_bytes(model, 65536, replay=True, **fwd) - peak_bytes(model, 65536, **fwd) == 24 * 8 * 8 * 65536 // 2
    assert peak_bytes(model, 65536, **fwd) < peak_bytes(model, 65536, **full)


def test_bad_moe_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"expert_load=0.5: expected >= 1"):
        peak_bytes("qwen3-30b-a3b", 4096, ep=8, dp=8, expert_load=0.5)
    with pytest.raises(ValueError, match=r"router_dtype='int8'"):
        peak_bytes("qwen3-30b-a3b", 4096, ep=8, dp=8, router_dtype="int8")
    with pytest.raises(ValueError, match=r"ep x etp = 16 x 1 does not divide tp x cp x dp = 1 x 1 x 8"):
        peak_bytes("qwen3-30b-a3b", 4096, ep=16, dp=8)


def test_route_bytes_are_the_trainers_route_dtype():
    """memory.py copies model/routing.py's rule (it imports no torch): one byte a route up to 256 experts."""
    from megatron_dapo.model.routing import route_dtype

    assert memory.route_bytes_per_token(memory.shape_of("qwen3-30b-a3b")) == 48 * 8  # 48 MoE layers x top 8
    assert memory.route_bytes_per_token(memory.shape_of("qwen3-235b-a22b")) == 94 * 8
    assert memory.route_bytes_per_token(memory.shape_of("qwen2.5-7b")) == 0
    s = memory.shape_of("qwen3-30b-a3b")
    for experts in (8, 256, 257, 512):
        wide = dataclasses.replace(s, experts=experts)
        assert memory.route_bytes_per_token(wide) == 48 * 8 * route_dtype(experts).itemsize


def test_the_engine_share_is_the_trainers_engine():
    """memory.ENGINE_MEMORY_SHARE is VLLMEngine's gpu_memory_utilization default, which VLLMEngine.from_config (the
    trainer's engine) does not override."""
    import inspect

    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    default = inspect.signature(VLLMEngine.__init__).parameters["gpu_memory_utilization"].default
    assert memory.ENGINE_MEMORY_SHARE == default
    assert "gpu_memory_utilization" not in inspect.getsource(VLLMEngine.from_config)


MOE_EXAMPLE_NUMBERS = {  # the headers' numbers: (static GB, its GiB, train GiB, forward GiB, load, its train GiB)
    "dapo_math_qwen3_30b_a3b.yaml": (24.7, 23.0, 30.8, 26.8, 4, 33.2),
    "dapo_math_qwen3_235b_a22b.yaml": (27.8, 25.9, 32.8, 28.3, 8, 45.4),
}


@pytest.mark.parametrize("name", sorted(MOE_EXAMPLE_NUMBERS))
def test_the_moe_examples_own_memory_arithmetic(name):
    """What each MoE example's header says its layout holds, from this model; and that the policy's static memory
    leaves the engine its share of the GPU while it generates (the policy stays resident then)."""
    static_gb, static_gib, train_gib, forward_gib, load, loaded_gib = MOE_EXAMPLE_NUMBERS[name]
    shape, kw, cfg = example_layout(REPO / "examples" / name)
    s = memory.shape_of(shape, kw["tied"])
    statics = [
        memory.static_bytes(s, tp=kw["tp"], pp=kw["pp"], dp=kw["dp"], stage=r, ep=kw["ep"], etp=kw["etp"])
        for r in range(kw["pp"])
    ]
    assert round(max(statics) / 1e9, 1) == static_gb and round(max(statics) / GIB, 1) == static_gib
    tokens = cfg.train.max_tokens_per_microbatch
    assert round(peak_bytes(shape, tokens, **kw) / GIB, 1) == train_gib
    assert round(peak_bytes(shape, tokens, forward_only=True, **kw) / GIB, 1) == forward_gib
    assert round(peak_bytes(shape, tokens, expert_load=load, **kw) / GIB, 1) == loaded_gib
    limit = DEVICE_GIB * (1 - memory.BUDGET_HEADROOM) * GIB
    assert max(statics) + memory.ENGINE_MEMORY_SHARE * DEVICE_GIB * GIB <= limit
