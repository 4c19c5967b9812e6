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
