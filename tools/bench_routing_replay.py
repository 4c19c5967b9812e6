"""Routing replay against a real train/rollout mismatch: a tiny Qwen3-MoE whose vLLM engine runs in bf16 while the
Megatron trainer runs in fp32 (the engine flips routes between near-tied experts that the trainer picks the other
way). Per seed: a new tiny MoE (model/tiny.py, that seed), its weights synced from the trainer into a bf16 engine
that starts from random weights, --prompts random prompts x --n samples streamed with their routes captured; then
the trainer's logprobs of the same tokens routing by itself and replaying the engine's routes (R3). Prints, per
seed, the share of (position, layer) routes where engine and trainer differ and rollout/kl (k3 per token, the
trainer's metric) both ways: megatron_dapo/preflight/moe_checks.py's measurement, which the GPU preflight's moe
check runs too.

    python tools/bench_routing_replay.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def measure(seed: int, prompts: int, n: int, max_tokens: int, work: str) -> dict:
    from megatron_dapo.config import load_config
    from megatron_dapo.convert.layouts import hf_to_megatron
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.tiny import build_tiny_qwen3_moe
    from megatron_dapo.preflight.moe_checks import replay_mismatch, stream_with_routes
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_bridge import WeightBridge
    from megatron_dapo.trainer import policy_options

    path = build_tiny_qwen3_moe(f"{work}/moe-{seed}", seed=seed)
    arch = ModelArch.from_hf_dir(path)
    cfg = load_config(overrides=[f"model.hf_path={path}", "model.dtype=fp32"])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    policy = MegatronPolicy(
        arch, layout, hf_to_megatron(dict(SafetensorsReader(path).items()), arch), **policy_options(cfg)
    )
    engine = VLLMEngine(str(path), dtype="bfloat16", max_model_len=256, seed=seed, load_format="dummy",
                        capture_routes=True)  # fmt: skip
    try:  # the engine's shutdown ends the process group: everything distributed happens before it
        WeightBridge(policy.model, arch, layout).sync(engine)
        responses = stream_with_routes(engine, arch.vocab_size, prompts, n, max_tokens, seed)
        numbers, _ = replay_mismatch(policy, responses)
    finally:
        policy.close()
        engine.close()
        destroy_parallel()
    return {"seed": seed, **{k: numbers[k] for k in ("routes", "flipped", "kl_own", "kl_r3")}}


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
