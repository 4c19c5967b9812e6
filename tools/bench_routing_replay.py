"""Routing replay against a real train/rollout mismatch: a tiny Qwen3-MoE whose vLLM engine runs in bf16 while the
Megatron trainer runs in fp32 (the engine flips routes between near-tied experts that the trainer picks the other
way). Per seed: a new tiny MoE (model/tiny.py, that seed), its weights synced from the trainer into a bf16 engine
that starts from random weights, --prompts random prompts x --n samples streamed with their routes captured; then
the trainer's logprobs of the same tokens routing by itself and replaying the engine's routes (R3). Prints, per
seed, the share of (position, layer) routes where engine and trainer differ and rollout/kl (k3 per token, the
trainer's metric) both ways.

    python tools/bench_routing_replay.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace


def measure(seed: int, prompts: int, n: int, max_tokens: int, work: str) -> dict:
    import torch

    from megatron_dapo.algorithm import mismatch_metrics, rollout_mismatch_sums
    from megatron_dapo.config import load_config
    from megatron_dapo.convert.layouts import hf_to_megatron
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.tiny import build_tiny_qwen3_moe
    from megatron_dapo.rollout.engine import GroupRequest
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    path = build_tiny_qwen3_moe(f"{work}/moe-{seed}", seed=seed)
    arch = ModelArch.from_hf_dir(path)
    cfg = load_config(overrides=[f"model.hf_path={path}", "model.dtype=fp32"])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    policy = MegatronPolicy(cfg, arch, layout, hf_to_megatron(dict(SafetensorsReader(path).items()), arch))
    engine = VLLMEngine(str(path), dtype="bfloat16", max_model_len=256, seed=seed, load_format="dummy",
                        capture_routes=True)  # fmt: skip
    try:  # the engine's shutdown ends the process group: everything distributed happens before it
        WeightBridge(policy.model, arch, layout).sync(engine)
        g = torch.Generator().manual_seed(seed)
        groups = [
            GroupRequest(
                key=i,
                prompt_ids=torch.randint(3, arch.vocab_size, (8,), generator=g).tolist(),
                n=n,
                seed=seed * 1000 + i,
                version=0,
            )  # fmt: skip
            for i in range(prompts)
        ]
        engine.submit(groups, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
        done: dict = {}
        while engine.in_flight():
            done.update(engine.step())
        responses = [(grp.prompt_ids, r) for grp in groups for r in done[grp.key]]
        samples = [TrainSample(prompt_ids=p, response_ids=r.token_ids) for p, r in responses]
        own = policy.compute_logprobs(samples, 1.0, record_routes=True)
        replayed = policy.compute_logprobs([replace(s, routes=r.routes) for s, (_, r) in zip(samples, responses)], 1.0)
    finally:
        policy.close()
        engine.close()
        destroy_parallel()
    flipped = positions = 0
    for s, (_, r) in zip(samples, responses):
        same = (s.routes.long().sort(-1).values == r.routes.long().sort(-1).values).all(-1)
        flipped, positions = flipped + int((~same).sum()), positions + same.numel()
    kl = {}
    for name, lps in (("own", own), ("r3", replayed)):
        sums = sum(rollout_mismatch_sums(lp["logp"], torch.tensor(r.logprobs)) for lp, (_, r) in zip(lps, responses))
        kl[name] = mismatch_metrics(sums)["rollout/kl"]
    return {"seed": seed, "routes": positions, "flipped": flipped / positions, "kl_own": kl["own"], "kl_r3": kl["r3"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            rows.append(measure(seed, args.prompts, args.n, args.max_tokens, work))
    print(f"{'seed':>4} {'routes':>7} {'flipped':>8} {'rollout/kl own':>15} {'rollout/kl R3':>14} {'R3/own':>7}")
    for r in rows:
        ratio = r["kl_r3"] / r["kl_own"] if r["kl_own"] else float("nan")
        print(
            f"{r['seed']:>4} {r['routes']:>7} {r['flipped']:>8.2%} {r['kl_own']:>15.3e} {r['kl_r3']:>14.3e} {ratio:>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
