"""tools/estimate_step_time.py (megatron_dapo/sampling/sim/step_time.py) against its formulas worked by hand;
tools/bench_throughput.py end to end on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_dapo.sampling.sim import step_time as est

TOOLS = Path(__file__).resolve().parent.parent / "tools"

SMALL = est.StepInputs(
    flops_per_token=6e9,
    params=1e9,
    decode_tokens_per_gpu_s=1000,
    train_flops_per_gpu_s=4e14,
    logprob_flops_per_gpu_s=5e14,
    sync_gb_per_s=4,
    response_len=900,
    prompt_len=100,
    max_response_len=2000,
    prompts=64,
    group=8,
    gpus=16,
    tp=2,
    pp=2,
    vllm_tp=4,
    mini_batch=128,
    microbatch_tokens=8000,
    gen_batch=128,
    informative_frac=0.25,
    recompute_factor=4 / 3,
)


def test_estimate_equals_the_formulas_by_hand():
    got = est.estimate(SMALL)
    # dp = 16 / (2 x 2) = 4; sequence P + L = 100 + 900 = 1000 tokens
    # rounds = B / (f gen_batch) = 64 / (0.25 x 128) = 2
    # one round = gen_batch G L / (n r_gpu) = 128 x 8 x 900 / (16 x 1000) = 57.6 s; generate = 2 x 57.6 = 115.2 s
    assert got["rounds"] == 2 and got["generated_tokens"] == 2 * 128 * 8 * 900
    assert got["generate_s"] == pytest.approx(115.2)
    # T = B G (P + L) = 64 x 8 x 1000 = 512,000 tokens
    # m = ceil((128 / 4) x 1000 / 8000) = 4 micro-batches; bubble = (2 - 1) / (4 + 2 - 1) = 0.2
    # train = T F c / (n A_train) x (m + pp - 1) / m = 512e3 x 6e9 x 4/3 / (16 x 4e14) x 5/4 = 0.64 x 1.25 = 0.8 s
    assert got["train_tokens"] == 512_000 and got["micro_batches"] == 4 and got["bubble"] == pytest.approx(0.2)
    assert got["train_s"] == pytest.approx(0.8)
    # m_f = ceil((64 x 8 / 4) x 1000 / 8000) = 16
    # old_logp = T F / 3 / (n A_fwd) x (16 + 1) / 16 = 512e3 x 2e9 / (16 x 5e14) x 17/16 = 0.128 x 1.0625 = 0.136 s
    assert got["old_logp_s"] == pytest.approx(0.136)
    # sync = 2 N / bw = 2 x 1e9 B / 4e9 B/s = 0.5 s
    assert got["sync_s"] == pytest.approx(0.5)
    assert got["step_s"] == pytest.approx(115.2 + 0.136 + 0.8 + 0.5)
    assert got["long_tail_bound"] == 0.0


def test_long_tail_and_measured_rounds():
    # the longest response alone: L_max / r_seq = 2000 / 10 = 200 s > 57.6 s, so each of the 2 rounds takes 200 s
    tail = est.estimate(dataclasses.replace(SMALL, seq_decode_tokens_per_s=10))
    assert tail["generate_s"] == pytest.approx(400.0) and tail["long_tail_bound"] == 1.0
    # measured rounds replace B / (f gen_batch): 3 x 57.6 s
    assert est.estimate(dataclasses.replace(SMALL, gen_rounds=3))["generate_s"] == pytest.approx(172.8)


def test_cli_for_the_32b_layout_by_hand():
    results = est.main(
        ["--decode-tokens-per-gpu-s", "2000", "--mfu", "0.5", "--peak-tflops", "1000", "--sync-gb-per-s", "10"]
    )
    (r,) = results
    # Qwen2.5-32B: h 5120, ffn 27648, 64 layers, 40 heads and 8 KV heads of 128, vocab 152064
    per_layer_mm = 5120 * (5120 + 2 * 1024) + 5120 * 5120 + 3 * 5120 * 27648  # qkv, out proj, gate/up/down
    n_mm = 64 * per_layer_mm + 152064 * 5120  # + the output layer = 31,984,189,440
    f = 6 * n_mm + 6 * 64 * (200 + 3000) * 5120  # bench_train's FLOPs per token at P + L = 3200
    tokens = 512 * 16 * 3200
    m = math.ceil(512 / 8 * 3200 / 16384)  # 13 micro-batches per pipeline per optimizer step
    assert r["micro_batches"] == m == 13
    assert r["train_s"] == pytest.approx(tokens * f / (128 * 0.5 * 1000e12) * (m + 1) / m)
    m_f = math.ceil(512 * 16 / 8 * 3200 / 16384)  # 200: all responses in one forward pass
    assert r["old_logp_s"] == pytest.approx(tokens * f / 3 / (128 * 0.5 * 1000e12) * (m_f + 1) / m_f)
    params = 64 * (per_layer_mm + 7168 + 2 * 5120) + 2 * 152064 * 5120 + 5120  # + qkv bias, norms, embeddings
    assert r["sync_s"] == pytest.approx(2 * params / 10e9)
    # one round of 1536 prompts serves 3 steps: 1/3 x 1536 x 16 x 3000 / (128 x 2000)
    assert r["generate_s"] == pytest.approx(1536 * 16 * 3000 / (128 * 2000) / 3)


# Published on the models' Hugging Face cards (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, "Model Overview"):
# (total, activated, total without the embeddings) in billions, rounded there to the digits given.
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3, 29.9), "qwen3-235b-a22b": (235.0, 22.0, 234.0)}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_moe_parameter_counts_are_the_published_ones(shape):
    from megatron_dapo.model.perf import active_param_count, param_count, shape_arch

    arch = shape_arch(shape)
    total, active, body = PUBLISHED[shape]
    embeddings = 2 * arch.vocab_size * arch.hidden_size  # untied: the embedding and the output layer
    assert param_count(arch) / 1e9 == pytest.approx(total, rel=0.005)
    assert (param_count(arch) - embeddings) / 1e9 == pytest.approx(body, rel=0.005)
    assert active_param_count(arch) / 1e9 == pytest.approx(active, rel=0.02)  # "3.3B": 3.35 counted
    # every expert counted as active would be the total: the FLOPs per token must not see them
    assert active_param_count(arch) < 0.15 * param_count(arch)


def test_cli_for_a_mixture_of_experts_counts_active_flops_and_syncs_every_weight():
    """Qwen3-30B-A3B on the MoE example's 4 nodes (tp 2, pp 2, vLLM tp 4): the train phases' FLOPs are those of
    the 8 experts a token goes to and the router; the weight sync moves all 128 experts."""
    (r,) = est.main(
        [
            *("--shape", "qwen3-30b-a3b", "--decode-tokens-per-gpu-s", "2000", "--mfu", "0.5"),
            *("--peak-tflops", "1000", "--sync-gb-per-s", "10", "--nodes", "4", "--tp", "2", "--pp", "2"),
            *("--vllm-tp", "4"),
        ]
    )
    h, q, kv, layers, vocab = 2048, 32 * 128, 4 * 128, 48, 151936
    attention = h * (q + 2 * kv) + q * h  # qkv and the output projection
    expert = 3 * h * 768  # gate, up, down of one expert
    n_mm = layers * (attention + 128 * h + 8 * expert) + vocab * h  # + the router + 8 experts; + the output layer
    f = 6 * n_mm + 6 * layers * (200 + 3000) * q
    tokens = 512 * 16 * 3200
    m = math.ceil(512 / 8 * 3200 / 16384)  # dp = 32 / (2 x 2) = 8
    assert r["train_s"] == pytest.approx(tokens * f / (32 * 0.5 * 1000e12) * (m + 1) / m)
    norms = 2 * h + 2 * 128  # the layer norms and Qwen3's q/k norms
    params = layers * (attention + norms + 128 * h + 128 * expert) + 2 * vocab * h + h
    assert r["sync_s"] == pytest.approx(2 * params / 10e9)


def test_from_json_equals_the_same_rates_given_as_flags(tmp_path):
    bench = {
        "rollout_tokens_per_s_per_device": 1500.0,
        "mfu": 0.35,
        "logprob_mfu": 0.5,
        "peak_tflops_per_device": 800.0,
        "sync_gb_per_s": 12.0,
        "skipped": {},
    }
    (tmp_path / "b.json").write_text(json.dumps(bench))
    lengths = ["--response-len", "1000", "5000"]
    from_json = est.main(["--from-json", str(tmp_path / "b.json"), *lengths])
    flags = est.main(
        [
            *("--decode-tokens-per-gpu-s", "1500", "--mfu", "0.35", "--logprob-mfu", "0.5"),
            *("--peak-tflops", "800", "--sync-gb-per-s", "12", *lengths),
        ]
    )
    assert from_json == flags and len(flags) == 2


@pytest.mark.parametrize(
    "argv, bench, message",
    [
        (["--mfu", "-0.4"], None, "argument --mfu: '-0.4': expected a finite number > 0"),
        (["--decode-tokens-per-gpu-s", "nan"], None, "expected a finite number > 0"),
        (["--mfu", "1.5"], None, "--mfu = 1.5: expected a fraction in (0, 1]"),
        (
            ["--mfu", "0.4", "--peak-tflops", "989"],
            None,
            "2 rate(s) missing: decode (--decode-tokens-per-gpu-s or --decode-tokens-per-engine-s); "
            "sync (--sync-gb-per-s), or --from-json",
        ),
        (  # every missing rate named in one error, not one run at a time
            [],
            None,
            "4 rate(s) missing: decode (--decode-tokens-per-gpu-s or --decode-tokens-per-engine-s); "
            "sync (--sync-gb-per-s); peak (--peak-tflops); mfu (--mfu or --train-tokens-per-gpu-s)",
        ),
        (
            [],
            {
                "mfu": 0.3,
                "peak_tflops_per_device": 1.0,
                "sync_gb_per_s": 1.0,
                "skipped": {"rollout": "vLLM is missing"},
            },
            "has no field 'rollout_tokens_per_s_per_device', its rollout part was skipped: vLLM is missing",
        ),
        (
            [],
            {"rollout_tokens_per_s_per_device": 9.0, "mfu": 0.3, "peak_tflops_per_device": 1.0, "sync_gb_per_s": -2},
            "field 'sync_gb_per_s' = -2: expected a finite number > 0",
        ),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, bench, message):
    if bench is not None:
        (tmp_path / "b.json").write_text(json.dumps(bench))
        argv = [*argv, "--from-json", str(tmp_path / "b.json")]
    with pytest.raises(SystemExit) as exit_:
        est.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------- bench_throughput

FIELDS = {
    "rollout": ["rollout_tokens", "rollout_s", "rollout_tokens_per_s", "rollout_tokens_per_s_per_device"],
    "train": [
        "train_tokens",
        "train_step_s",
        "train_tokens_per_s",
        "logprob_tokens_per_s",
        "tflops_per_device",
        "peak_tflops_per_device",
        "mfu",
        "logprob_mfu",
    ],
    "sync": ["sync_s", "sync_gb", "sync_gb_per_s", "sync_buckets", "sync_digest_s", "sync_no_digest_s"],
    "step": ["step_generate_s", "step_old_logp_s", "step_train_s", "step_sync_s", "step_total_s", "step_tokens_per_s"],
}
SMALL_RUN = ["--tiny", "--prompts", "8", "--n", "2", "--max-tokens", "32", "--train-steps", "1", "--syncs", "1"]


def _bench(tmp_path: Path, *args: str, prelude: str = "") -> dict:
    """Run bench_throughput (after `prelude`, in the same interpreter) and return its JSON."""
    out = tmp_path / "bench.json"
    argv = [str(TOOLS / "bench_throughput.py"), *args, "--json", str(out)]
    code = "\n".join(
        ["import runpy, sys", prelude, f"sys.argv = {argv!r}", "runpy.run_path(sys.argv[0], run_name='__main__')"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "part     metric" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_throughput_tiny_measures_every_part(tmp_path):
    got = _bench(tmp_path, *SMALL_RUN, "--steps", "1")
    assert got["parts"] == ["rollout", "train", "sync", "step"] and got["skipped"] == {}
    for part, keys in FIELDS.items():
        for key in keys:
            assert got[key] > 0, (part, key, got.get(key))
    assert got["sync_into"] == "vllm" and got["step_total_s"] >= got["step_generate_s"]
    assert got["rollout_engines"] == 1 and got["rollout_tokens_per_s"] == got["rollout_tokens_per_s_per_engine"]
    assert got["rollout_tokens"] <= 8 * 2 * 32 and got["train_tokens"] == 8 * 2 * (64 + 32)
    # fp32 engine and fp32 policy score the same tokens alike: the mismatch rows are near zero
    assert got["rollout_weights"] == "none" and got["rollout_logp_mismatch_mean"] < 1e-4 and got["rollout_kl"] < 1e-6


@pytest.mark.slow  # ~16 s: a Megatron train step and sync in a process of its own
def test_bench_throughput_without_vllm_skips_rollout_and_step_and_sizes_an_fp8_sync(tmp_path):
    """Without vLLM (`import vllm` fails, as on the GPU box before its wheels are in): rollout and step are skipped
    with the reason, train and sync measured into a counting sink. With rollout.quantization=fp8 (one launch for
    both) the sync sends what a GPU engine asks for, FP8 projections plus float32 scales, everything else in fp32.
    (A CPU engine's FP8-rounded weights and the mismatch they show are the same code under the preflight's
    bridge_fp8 row and the trainer's fp8 run: tests/test_preflight.py, tests/test_trainer.py.)"""
    from safetensors import safe_open

    from megatron_dapo.rollout.quantize import is_quantized, scale_shape

    got = _bench(tmp_path, *SMALL_RUN, "rollout.quantization=fp8", prelude="sys.modules['vllm'] = None")
    assert got["skipped"] == {"rollout": "vLLM is not installed here", "step": "vLLM is not installed here"}
    assert got["sync_into"] == "counting sink (no engine)"
    for key in FIELDS["train"] + FIELDS["sync"]:
        assert got[key] > 0, key
    assert not any(key in got for key in FIELDS["rollout"] + FIELDS["step"])
    assert got["rollout_weights"] == "fp8" and got["sync_quantize_s"] > 0
    with safe_open(str(Path(tempfile.gettempdir()) / "megatron_dapo_bench_tiny" / "model.safetensors"), "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    want = 0  # bytes: 1 per FP8 weight and 4 per scale, 4 per fp32 value elsewhere
    for name, shape in shapes.items():
        n = math.prod(shape)
        want += n + 4 * math.prod(scale_shape(shape)) if is_quantized(name) else 4 * n
    assert got["sync_gb"] == float(f"{want / 1e9:.4g}")  # bench_throughput keeps 4 significant figures


# ---------------------------------------------------------------- time_to_accuracy


def test_time_to_accuracy_reads_the_first_evaluation_at_the_target(tmp_path, capsys, seed):
    """Fresh random runs: the row's step, seconds, token ratio up to that step and staleness, by hand; a run that
    never reaches the target says so; a run without timing/elapsed, or no metrics file, is one clear error."""
    import random

    sys.path.insert(0, str(TOOLS))
    try:
        import time_to_accuracy as tta
    finally:
        sys.path.remove(str(TOOLS))
    rng = random.Random(seed)
    lines, elapsed = [], 0.0
    for step in range(1, 13):
        elapsed += rng.uniform(0.5, 2.0)
        m = {"step": float(step), "timing/elapsed": elapsed, "timing/step": rng.uniform(0.4, 0.6)}
        m.update({"tokens/generated": float(rng.randrange(100, 200)), "tokens/trained": float(rng.randrange(50, 100))})
        m.update({"staleness/max": float(rng.randrange(3)), "staleness/p99": 0.0})
        if step % 3 == 0:
            m["eval/avg_at_k"] = [0.3, 0.72, 0.69, 0.9][step // 3 - 1]  # first at >= 0.7: step 6
        lines.append(m)
    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (rows,) = tta.main([f"a={run}", "--target", "0.7"])
    assert (rows["hit_step"], rows["hit_seconds"]) == (6, lines[5]["timing/elapsed"])
    gen, trained = (sum(m[f"tokens/{k}"] for m in lines[:6]) for k in ("generated", "trained"))
    assert rows["generated_per_trained"] == pytest.approx(gen / trained, rel=1e-12)
    assert rows["staleness_max"] == max(m["staleness/max"] for m in lines)
    assert f"| a | 12 | 6 | {lines[5]['timing/elapsed']:.0f} |" in capsys.readouterr().out
    (rows,) = tta.main([f"a={run}", "--target", "0.95"])
    assert rows["hit_step"] is None
    assert "| not reached | - |" in capsys.readouterr().out

    del lines[4]["timing/elapsed"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    for argv, message in [([f"a={run}"], "steps [5] have no timing/elapsed"), ([str(run)], "expected LABEL=RUN_DIR")]:
        with pytest.raises(SystemExit) as exit_:
            tta.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
