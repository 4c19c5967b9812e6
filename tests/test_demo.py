"""`make demo` end to end in miniature: warm start, DAPO steps, held-out evaluation, plot, logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end_and_writes_its_results(tmp_path):
    out = tmp_path / "demo"
    # a warm start of 60 supervised steps, then 2 DAPO steps with the GRPO-with-KL example's objective (a reference
    # policy, seq-mean-token-mean, symmetric clip, every group trained); the cap is off so a still-weak
    # policy cannot end the run early
    grpo = str(Path(__file__).resolve().parent.parent / "examples" / "grpo_kl_ablation.yaml")
    args = ["--out", str(out), "--steps", "2", "--eval-every", "2", "--warm-steps", "60", "--algorithm-from", grpo]
    args.append("sampler.max_gen_batches=0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.demo", *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and [s for s, _ in summary["evals"]] == [0, 2]
    assert summary["before"] == summary["evals"][0][1] and summary["after"] == summary["evals"][-1][1]
    assert all(0.0 <= acc <= 1.0 for _, acc in summary["evals"])
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0]
    # beta 0.001 x k, meant per response then over responses (the token mean's exact divisor: tests/test_algorithm.py)
    assert (
        lines[0]["actor/kl_loss"] == pytest.approx(0.001 * lines[0]["actor/kl"], rel=0.2) and lines[1]["actor/kl"] > 0
    )
    assert sum(m["sampler/all_wrong"] for m in lines) > 0  # uninformative groups are trained too (no dynamic sampling)
    assert "eval/held_out_greedy_acc" not in lines[0] and lines[1]["eval/held_out_greedy_acc"] == summary["after"]
    assert any((out / "run" / "tensorboard").iterdir())
    assert "held-out accuracy before DAPO" in proc.stdout and "-> after" in proc.stdout
    assert "step 2 |" in proc.stdout
