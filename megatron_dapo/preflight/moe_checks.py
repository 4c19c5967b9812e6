"""The preflight's mixture-of-experts check, and the routing-replay measurement tools/bench_routing_replay.py shares.

`check_moe`: a Qwen3-MoE with random weights (model/tiny.py: near-tied router rows, so engine and trainer disagree
somewhere) trained with expert parallel 1 through MegatronPolicy (forward, backward, AdamW; Transformer Engine's
grouped GEMM for the experts where TE is present, SequentialMLP otherwise), its weights synced into a vLLM engine that
returns the experts it routed each token to (capture_routes, rollout/vllm_routes.py), samples streamed from it
(submit, step), then the trainer's logprobs of those samples routing by itself and replaying the engine's routes (R3):
the share of (position, MoE layer) routes where the two differ, the replayed pass's moe/router_agreement, rollout/kl
both ways, and one R3 train step on the samples.

Runs like the other checks, in its own process (megatron_dapo/preflight/run.py); vLLM and torch are imported inside.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_dapo.preflight.checks import Result, all_finite, init_world, step_config

MOE_SMALL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    mlp_only_layers=[],
    max_position_embeddings=4096,
)
"""The GPU run's model (not --fast): model/tiny.py's TINY_QWEN3_MOE with these fields, every layer MoE, 32 experts of
which each token takes 4 (about 45M parameters). --fast and CPU runs take TINY_QWEN3_MOE as it is."""

PROMPT_LEN = 8
"""Tokens of each random prompt."""


def stream_with_routes(engine, vocab: int, prompts: int, n: int, max_tokens: int, seed: int) -> list[tuple[list, Any]]:
    """`prompts` random prompts of PROMPT_LEN tokens (ids 3 .. vocab - 1, seeded), n samples each, streamed on an engine
    built with capture_routes (submit, then step until nothing is in flight) at temperature 1: [(prompt ids, Response
    with its routes)] in submission order."""
    import torch

    from megatron_dapo.rollout.engine import GroupRequest

    g = torch.Generator().manual_seed(seed)
    groups = [
        GroupRequest(
            key=i,
            prompt_ids=torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist(),
            n=n,
            seed=seed * 1000 + i,
            version=0,
        )
        for i in range(prompts)
    ]
    engine.submit(groups, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    done: dict = {}
    while engine.in_flight():
        done.update(engine.step())
    return [(group.prompt_ids, r) for group in groups for r in done[group.key]]


def replay_mismatch(policy, responses: list[tuple[list, Any]]) -> tuple[dict[str, float], list]:
    """The trainer's logprobs of the engine's samples, routing by itself (recording its routes) and replaying the
    engine's (R3). Returns ({routes: (position, MoE layer) pairs, flipped: the share of them whose top-k sets differ
    between the trainer's own routing and the engine's, router_agreement: moe/router_agreement of the replayed pass
    (inside it, the share the trainer's router would have picked as replayed), kl_own, kl_r3: rollout/kl, k3 per token,
    the trainer's metric, against the engine's sampling logprobs}, the samples carrying the engine's routes and the
    replayed logprobs as old_logp)."""
    import torch

    from megatron_dapo.algorithm.mismatch import mismatch_metrics, rollout_mismatch_sums
    from megatron_dapo.model.policy import TrainSample

    samples = [TrainSample(prompt_ids=p, response_ids=r.token_ids) for p, r in responses]
    own = policy.compute_logprobs(samples, 1.0, record_routes=True)
    replayed_samples = [replace(s, routes=r.routes, old_logp=None) for s, (_, r) in zip(samples, responses)]
    replayed = policy.compute_logprobs(replayed_samples, 1.0)
    agreement = policy.routing.metrics().get("moe/router_agreement", float("nan"))
    flipped = positions = 0
    for s, (_, r) in zip(samples, responses):
        same = (s.routes.long().sort(-1).values == r.routes.long().sort(-1).values).all(-1)
        flipped, positions = flipped + int((~same).sum()), positions + same.numel()
    kl = {}
    for name, lps in (("own", own), ("r3", replayed)):
        sums = sum(rollout_mismatch_sums(lp["logp"], torch.tensor(r.logprobs)) for lp, (_, r) in zip(lps, responses))
        kl[name] = mismatch_metrics(sums)["rollout/kl"]
    for s, lp in zip(replayed_samples, replayed):
        s.old_logp = lp["logp"]
    numbers = {
        "routes": positions,
        "flipped": flipped / max(positions, 1),
        "router_agreement": agreement,
        "kl_own": kl["own"],
        "kl_r3": kl["r3"],
    }
    return numbers, replayed_samples


def _missing_routes(responses: list[tuple[list, Any]]) -> str:
    """Why the engine's routes cannot be replayed ('' when every sample has one route per position but its last)."""
    bad = [
        (i, None if r.routes is None else len(r.routes), len(p) + len(r.token_ids) - 1)
        for i, (p, r) in enumerate(responses)
        if r.routes is None or len(r.routes) != len(p) + len(r.token_ids) - 1
    ]
    return "".join(f"sample {i}: routes for {got} positions, expected {want}; " for i, got, want in bad[:4])[:-2]


def check_moe(ctx: dict) -> Result:
    """The MoE check (module docstring), its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_moe_") as tmp:
        return _moe(ctx, Path(tmp))


def _moe(ctx: dict, tmp: Path) -> Result:
    import torch

    from megatron_dapo.convert.layouts import hf_to_megatron
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.perf import active_param_count, param_count
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.tiny import build_tiny_qwen3_moe
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_bridge import WeightBridge
    from megatron_dapo.trainer import policy_options

    cuda = torch.cuda.is_available()
    small = cuda and not ctx["fast"]
    prompts, n, new = (16, 4, 64) if small else (4, 4, 24)
    path = build_tiny_qwen3_moe(tmp / "moe", seed=0, **(MOE_SMALL if small else {}))
    arch = ModelArch.from_hf_dir(path)
    # the trainer in the machine's dtype (bf16 on a GPU, fp32 on CPU) against a bf16 engine: on CPU a real mismatch
    # between the two (bf16 flips near-tied routes); on a GPU the two bf16 kernels' own
    cfg = step_config(PROMPT_LEN + new, f"model.hf_path={path}", "model.router_replay=r3")
    layout = init_world(arch, cfg)
    policy = MegatronPolicy(
        arch, layout, hf_to_megatron(dict(SafetensorsReader(path).items()), arch), **policy_options(cfg)
    )
    engine = VLLMEngine(
        str(path),
        dtype="bfloat16",
        max_model_len=PROMPT_LEN + new + 8,
        gpu_memory_utilization=0.3,  # next to the Megatron policy and its optimizer
        seed=0,
        load_format="dummy",
        capture_routes=True,
    )
    try:  # the engine's shutdown ends the process group: everything distributed happens before it
        WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes).sync(engine)
        responses = stream_with_routes(engine, arch.vocab_size, prompts, n, new, seed=0)
        missing = _missing_routes(responses)
        if missing:
            return Result(False, {"samples": len(responses)}, missing)
        numbers, samples = replay_mismatch(policy, responses)
        g = torch.Generator().manual_seed(1)
        for s in samples:
            s.advantage = float(torch.randn((), generator=g))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = policy.train_step(samples, 1.0)  # R3: the samples carry the engine's routes
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
    finally:
        policy.close()
        engine.close()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n_out: dict[str, Any] = {
        "layers": arch.num_layers,
        "experts": f"{arch.num_experts} top {arch.num_experts_per_tok}",
        "params_m": round(param_count(arch) / 1e6, 1),
        "active_params_m": round(active_param_count(arch) / 1e6, 1),
        "grouped_gemm": layout.use_te,
        "trainer_dtype": cfg.model.dtype,
        "samples": len(samples),
        **numbers,
        "train_loss": metrics["actor/loss"],
        "grad_norm": metrics["actor/grad_norm"],
        "update_applied": metrics["actor/update_applied"],
        "train_router_agreement": metrics.get("moe/router_agreement", float("nan")),
        "load_imbalance": metrics["moe/load_imbalance"],
        "train_tokens_per_s": round(tokens / step_s, 1),
    }
    problems = []
    if not all_finite(n_out) or not 0 <= numbers["router_agreement"] <= 1:
        problems.append("a number is not finite (or the agreement is outside [0, 1])")
    if metrics["actor/update_applied"] != 1.0:
        problems.append("the R3 train step applied no update")
    # replaying the engine's routes must not move the trainer further from the engine; with nothing flipped the two
    # passes differ only in the order the experts' outputs are summed
    if numbers["kl_r3"] > numbers["kl_own"] * 1.01 + 1e-9:
        problems.append(f"rollout/kl with R3 {numbers['kl_r3']:.3g} above routing by itself {numbers['kl_own']:.3g}")
    return Result(not problems, n_out, "; ".join(problems))
