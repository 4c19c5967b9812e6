"""One rank of a Megatron policy check, run under torchrun by the model tests.

Reads a tiny model (config.json + full Megatron weights.pt) and a fixed batch (batch.pt)
from --case and writes what it measured to --out/rank{RANK}.pt:

- logprobs: response logprobs and entropy at --temperature;
- train: old logprobs (offset by the batch's fixed noise, so clipping happens), one
  train step, then this stage's TP-gathered gradients and updated weights and the metrics;
- steps: --steps on-policy train steps; response logprobs before and after.
- bridge: the weight bridge's Hugging Face tensors and bucket sizes, and the peak resident
  memory the sync added (VmHWM reset before it, against VmRSS before it).
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, help="directory with config.json, weights.pt, batch.pt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("logprobs", "train", "steps", "bridge"), default="train")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.tp=2")
    args = ap.parse_args()

    from megatron.core import parallel_state

    from megatron_dapo.config import load_config
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.provider import tp_gathered_tensors

    # adam_eps well above fp32 noise in the grads: a first Adam step is ~lr * sign(g), which
    # would turn 1e-9 differences in near-zero grads into lr-sized differences in the weights
    base = ["model.dtype=fp32", "optim.warmup_steps=0", "optim.lr=1e-3", "optim.adam_eps=1e-4"]
    cfg = load_config(overrides=[*base, *args.overrides])
    arch = ModelArch.from_hf_dir(args.case)
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=1234)
    policy = MegatronPolicy(cfg, arch, layout, torch.load(os.path.join(args.case, "weights.pt")))

    batch = torch.load(os.path.join(args.case, "batch.pt"))
    dp_rank = parallel_state.get_data_parallel_rank()
    share = len(batch) // layout.dp
    mine = batch[dp_rank * share : (dp_rank + 1) * share]
    samples = [
        TrainSample(prompt_ids=b["prompt"], response_ids=b["response"], advantage=b["advantage"], in_loss=b["in_loss"])
        for b in mine
    ]
    result: dict = {}
    if args.mode == "bridge":
        result.update(bridge(policy, cfg, arch, layout))
        if layout.rank == 0:
            torch.save(result, os.path.join(args.out, "rank0.pt"))
        destroy_parallel()
        return
    first = policy.compute_logprobs(samples, args.temperature)
    if args.mode == "logprobs":
        result["logprobs"] = first
    elif args.mode == "train":
        if first is not None:  # the last pipeline stage computes the loss
            for i, s in enumerate(samples):
                s.old_logp = first[i]["logp"] + mine[i]["noise"]
        result["metrics"] = policy.train_step(samples, args.temperature)
        result["grads"] = tp_gathered_tensors(policy.model, arch, layout, grads=True)
        result["weights"] = tp_gathered_tensors(policy.model, arch, layout)
        result["logprobs"] = first
    else:
        current = first
        for _ in range(args.steps):
            if current is not None:
                for i, s in enumerate(samples):
                    s.old_logp = current[i]["logp"]
            result.setdefault("metrics", []).append(policy.train_step(samples, args.temperature))
            current = policy.compute_logprobs(samples, args.temperature)
        result["before"], result["after"] = first, current
    if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
        torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
    destroy_parallel()


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class _Collector:
    """A rollout engine stand-in that keeps names and sizes only, so the bridge's own memory is measured."""

    def __init__(self, keep: bool) -> None:
        self.keep, self.tensors, self.bucket_bytes = keep, {}, []

    def update_weights(self, bucket) -> None:
        self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, t in bucket:
            self.tensors[name] = t.clone() if self.keep else t.shape

    def finish_weight_update(self) -> None:
        pass


def bridge(policy, cfg, arch, layout) -> dict:
    import gc

    from megatron_dapo.rollout.weight_bridge import WeightBridge

    wb = WeightBridge(policy.model, arch, layout, bucket_bytes=cfg.rollout.bucket_bytes)
    keep = os.environ.get("BRIDGE_KEEP", "1") == "1"
    sink = _Collector(keep)
    gc.collect()
    rss_before = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak resident set, to the current one
    stats = wb.sync(sink)
    peak = _proc_status_kb("VmHWM")
    return {
        "hf": sink.tensors,
        "bucket_bytes": sink.bucket_bytes,
        "sync": stats,
        "peak_extra_bytes": (peak - rss_before) * 1024,
        "model_bytes": sum(p.numel() * p.element_size() for m in policy.model for p in m.parameters()),
    }


if __name__ == "__main__":
    main()
