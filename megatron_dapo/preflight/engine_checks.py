"""The preflight's vLLM checks: Megatron -> vLLM weight sync and logprob parity (bridge, and bridge_fp8 with FP8
rollout weights), and sleep/wake.

Run like the others (megatron_dapo/preflight/run.py), each in its own process; vLLM is imported inside them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from megatron_dapo.preflight.checks import GIB, Result, copy_gbs, init_world, step_config


def _shape_model_dir(arch, out: Path) -> Path:
    """An HF model directory for vLLM's dummy weights: the shape's config.json and a small byte-level tokenizer.

    Prompts stay inside the tokenizer's ids; sampled ids beyond it decode to nothing, which is all a check needs.
    """
    from transformers import Qwen2Config

    from megatron_dapo.model.tiny import CORPUS
    from megatron_dapo.model.tokenizer import train_byte_bpe_tokenizer

    tok = train_byte_bpe_tokenizer(CORPUS, out, vocab_size=320)
    Qwen2Config(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    ).save_pretrained(out)
    return out


def check_bridge(ctx: dict) -> Result:
    """The bridge and parity check, its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_bridge_") as tmp:
        return _bridge(ctx, Path(tmp))


def check_bridge_fp8(ctx: dict) -> Result:
    """The same with rollout.quantization=fp8: the engine starts block-FP8, every sync quantizes; its tokens/s
    against the bridge check's (same shape, prompts and lengths) is what FP8 rollouts buy."""
    # vLLM warms 1482 DeepGEMM shapes at start by default: over 4 minutes on the H100 for the 1.5B shape
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    with tempfile.TemporaryDirectory(prefix="preflight_bridge_fp8_") as tmp:
        return _bridge(ctx, Path(tmp), quantization="fp8")


def _bridge(ctx: dict, tmp: Path, quantization: str = "none") -> Result:
    import torch

    from megatron_dapo.convert.safetensors_io import LazyMegatronWeights, SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.perf import shape_arch
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_bridge import WeightBridge
    from megatron_dapo.trainer import policy_options

    cuda = torch.cuda.is_available()
    count, plen, new = (8, 16, 8) if ctx["fast"] else (32, 16, 16)
    if cuda:  # a real shape with random weights: the sync's bandwidth matters, the weights' values do not
        shape = "qwen2.5-0.5b" if ctx["fast"] else "qwen2.5-1.5b"
        arch = shape_arch(shape, 4096)
        model_dir, weights = _shape_model_dir(arch, tmp), None
        # bf16 in both, different attention kernels; measured on the H100 (random 1.5B weights): 0.021-0.030 mean,
        # 0.095-0.127 max against 1.07 mean with stale weights
        tol_mean, tol_max = 0.05, 0.5
        if quantization == "fp8":  # FP8 weights and activations against bf16. Measured on the H200: 0.22-0.33
            # mean, 0.86-1.14 max, ~10x bf16's, as E4M3's 3 mantissa bits against bf16's 7 predict (16x)
            tol_mean, tol_max = 0.5, 3.0
    else:
        shape, model_dir = "tiny qwen2", build_tiny_qwen2(tmp)
        arch = ModelArch.from_hf_dir(model_dir)
        weights = LazyMegatronWeights(SafetensorsReader(model_dir), arch)
        tol_mean, tol_max = 1e-4, 1e-3  # fp32 in both
        if quantization == "fp8":  # FP8-rounded weights in the engine (measured on the tiny model: ~1e-2 mean)
            tol_mean, tol_max = 0.1, 1.0
    cfg = step_config(plen + new, f"rollout.quantization={quantization}")
    layout = init_world(arch, cfg)
    policy = MegatronPolicy(arch, layout, weights, **policy_options(cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (plen,), generator=g).tolist() for _ in range(count)]
    engine = VLLMEngine(
        str(model_dir),
        dtype="bfloat16" if cuda else "float32",
        max_model_len=plen + new + 8,
        gpu_memory_utilization=0.3,  # next to the Megatron policy and its optimizer
        seed=0,
        load_format="dummy",
        quantization=quantization,
    )
    bridge = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes, cfg.rollout.weight_digest)

    def parity() -> tuple[float, float, int]:
        """|engine logprob - Megatron logprob| over every sampled token: mean, max, tokens."""
        groups = engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=new, seed=1)
        samples = [TrainSample(prompt_ids=p, response_ids=grp[0].token_ids) for p, grp in zip(prompts, groups)]
        ours = policy.compute_logprobs(samples, 1.0)
        theirs = torch.cat([torch.tensor(grp[0].logprobs) for grp in groups])
        diff = (theirs - torch.cat([o["logp"] for o in ours])).abs()
        return float(diff.mean()), float(diff.max()), int(diff.numel())

    try:
        bridge.sync(engine)
        before = parity()
        with torch.no_grad():  # a new policy: every weight moved by half its own spread
            gen = torch.Generator(device=layout.device).manual_seed(1)
            for chunk in policy.model:
                for p in chunk.parameters():
                    noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                    p.add_((noise * 0.5 * p.float().std().clamp_min(1e-3)).to(p.dtype))
        stale = parity()
        sync = bridge.sync(engine)
        after = parity()
        rate = _tokens_per_s(engine, prompts, 64 if cuda else 16)
    finally:
        engine.close()  # last: an in-process engine's shutdown takes torch.distributed's world with it
    n: dict[str, Any] = {"shape": shape, "weights": engine.weight_format, "prompts": count, "tokens": after[2]}
    n.update(gen_tokens_per_s=round(rate, 1), quantize_s=round(sync["weight_sync/quantize_seconds"], 4))
    n.update(before_mean=before[0], before_max=before[1], stale_mean=stale[0], after_mean=after[0], after_max=after[1])
    n.update(sync_s=round(sync["weight_sync/seconds"], 4), sync_gb=round(sync["weight_sync/gb"], 4))
    n.update(sync_gb_per_s=round(sync["weight_sync/gb_per_s"], 3), buckets=int(sync["weight_sync/buckets"]))
    if cuda:
        n["sync_frac_copy"] = round(sync["weight_sync/gb_per_s"] / copy_gbs(ctx), 4)
    problems = [
        f"{what} logprobs differ by {m:.3g} mean / {x:.3g} max (tolerance {tol_mean:g} / {tol_max:g})"
        for what, (m, x, _) in (("after the first sync", before), ("after the second sync", after))
        if m > tol_mean or x > tol_max
    ]
    # the stale engine must be far further off than a synced one (FP8's own mismatch is the floor there: on the
    # H200 a wrong policy sat at 1.06 mean, 3.2x the synced FP8 engine's 0.33)
    if stale[0] <= (10 * tol_mean if quantization == "none" else 2 * after[0]):
        problems.append(
            f"the perturbed policy differs from the stale engine by only {stale[0]:.3g}: check not sensitive"
        )
    return Result(not problems, n, "; ".join(problems))


def _tokens_per_s(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second for the prompts x 4 samples, after a warm-up call at the same batch."""
    import time

    engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=4, seed=2)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=3)
    return sum(len(r.token_ids) for g in groups for r in g) / (time.perf_counter() - t0)


def check_sleep_wake(ctx: dict) -> Result:
    """The sleep/wake check, its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_sleep_") as tmp:
        return _sleep_wake(Path(tmp))


def _sleep_wake(tmp: Path) -> Result:
    import torch
    from safetensors.torch import load_file

    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    # head_dim 64: FlashAttention's smallest common size (the default tiny model's 32 is a CPU-attention size)
    model_dir = build_tiny_qwen2(tmp, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    engine = VLLMEngine(str(model_dir), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.5, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (16,), generator=g).tolist() for _ in range(16)]

    def greedy() -> list[list[int]]:
        return [grp[0].token_ids for grp in engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=24)]

    def free_gib() -> float:
        return torch.cuda.mem_get_info()[0] / GIB

    try:
        first = greedy()
        awake = free_gib()
        engine.sleep()
        asleep = free_gib()
        engine.wake()
        woken = free_gib()
        after_wake = greedy()
        engine.sleep()  # the trainer's cycle: asleep while Megatron trains, weights updated, then woken
        engine.update_weights(load_file(str(model_dir / "model.safetensors")).items())
        engine.wake()
        after_update = greedy()
    finally:
        engine.close()
    n = {"freed_gib": round(asleep - awake, 2), "restored_gib": round(asleep - woken, 2)}
    n.update(same_after_wake=after_wake == first, same_after_update=after_update == first)
    problems = []
    if n["freed_gib"] < 1.0:
        problems.append(f"sleep() freed only {n['freed_gib']} GiB")
    if abs(woken - awake) > 1.0:
        problems.append(f"wake() left free memory at {woken:.1f} GiB, {awake:.1f} before sleep")
    if after_wake != first or after_update != first:
        problems.append("greedy generation changed across sleep/wake or the update")
    return Result(not problems, n, "; ".join(problems))


def check_inflight_update(ctx: dict) -> Result:
    """Asynchronous DAPO's weight update under streamed groups (VLLMEngine.update_weights_in_flight), both KV
    choices, its model directory in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="preflight_inflight_") as tmp:
        return _inflight_update(Path(tmp))


def _mean(xs: list) -> float:
    return sum(xs) / max(1, len(xs))


def _inflight_update(tmp: Path) -> Result:
    """Groups stream, a new policy arrives after `k` engine steps, the groups finish under it. Each token is scored
    by both policies (transformers, float32 over the engine's bf16-rounded weights): a token tagged with a version
    must sit far closer to that policy's logprob than to the other's (the gap ratio is scale free, so bf16 noise on
    a random model's small logits cannot pass or fail it by itself). recompute_kv=True must pass for every tagged
    token; keep_kv's later tokens are a mixture by design, reported only."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.rollout import GroupRequest, VLLMEngine

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    # head_dim 64: FlashAttention's smallest common size (the default tiny model's 32 is a CPU-attention size)
    model_dir = build_tiny_qwen2(tmp, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    old = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {
        k: (w + 0.5 * w.std().clamp_min(1e-3) * torch.randn(w.shape, generator=g)).contiguous() for k, w in old.items()
    }

    def reference(weights: dict) -> Qwen2ForCausalLM:
        model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval().to(dev)
        model.load_state_dict({k: w.to(dtype).float() for k, w in weights.items()}, strict=False)
        return model

    refs = {0: reference(old), 1: reference(new)}
    engine = VLLMEngine(
        str(model_dir), dtype="bfloat16" if cuda else "float32", max_model_len=128, gpu_memory_utilization=0.4, seed=0
    )
    gp = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (int(torch.randint(8, 24, (1,), generator=gp)),), generator=gp).tolist() for _ in range(8)
    ]
    n, k, max_tokens = 4, 6, 48
    n_out: dict[str, Any] = {"groups": len(prompts), "samples_per_group": n, "update_after_steps": k}
    problems: list[str] = []
    try:
        for recompute_kv in (True, False):
            tag = "recompute" if recompute_kv else "keep_kv"
            groups = [GroupRequest(key=i, prompt_ids=p, n=n, seed=100 + i, version=0) for i, p in enumerate(prompts)]
            engine.submit(groups, 1.0, 1.0, max_tokens)
            final: dict = {}
            for _ in range(k):
                final.update(engine.step())
            left = engine.in_flight()
            pause = engine.update_weights_in_flight(new.items(), version=1, recompute_kv=recompute_kv)
            steps = 0
            while engine.in_flight() and steps < 10 * max_tokens:
                final.update(engine.step())
                steps += 1
            if engine.in_flight() or sorted(final) != list(range(len(prompts))):
                problems.append(f"{tag}: groups lost or stuck ({engine.in_flight()} in flight after {steps} steps)")
                break
            near, far, bad_tags = {0: [], 1: []}, {0: [], 1: []}, 0
            for key, rs in final.items():
                for r in rs:
                    vs = r.versions
                    m = vs.count(0)
                    bad_tags += vs != [0] * m + [1] * (len(vs) - m)
                    if not r.token_ids:
                        continue
                    ids = torch.tensor([prompts[key] + r.token_ids], device=dev)
                    got = torch.tensor(r.logprobs)
                    with torch.no_grad():
                        ref = {}
                        for v, model in refs.items():
                            lp = torch.log_softmax(model(ids).logits[0, len(prompts[key]) - 1 : -1].float(), -1)
                            ref[v] = lp.gather(-1, ids[0, len(prompts[key]) :, None])[:, 0].cpu()
                    for v in (0, 1):
                        sel = torch.tensor(vs) == v
                        near[v] += (got[sel] - ref[v][sel]).abs().tolist()
                        far[v] += (got[sel] - ref[1 - v][sel]).abs().tolist()

            n_out[f"{tag}_pause_s"] = round(pause["pause_s"], 4)
            n_out[f"{tag}_groups_in_flight"] = left
            n_out[f"{tag}_tokens_v0_v1"] = f"{len(near[0])}/{len(near[1])}"
            for v in (0, 1):
                n_out[f"{tag}_v{v}_own_mean"] = float(f"{_mean(near[v]):.3g}")
                n_out[f"{tag}_v{v}_other_mean"] = float(f"{_mean(far[v]):.3g}")
            if bad_tags:
                problems.append(f"{tag}: {bad_tags} samples whose versions are not 0s then 1s")
            if not near[1]:
                problems.append(f"{tag}: no token was sampled after the update (it did not land mid-generation)")
            checked = (0, 1) if recompute_kv else (0,)
            for v in checked:
                if _mean(near[v]) > 0.2 * _mean(far[v]):
                    problems.append(
                        f"{tag}: tokens tagged {v} are {_mean(near[v]):.3g} from their policy's logprob and "
                        f"{_mean(far[v]):.3g} from the other's: not the tagged policy's"
                    )
            engine.update_weights(old.items())  # back to the first policy for the next case
            engine.finish_weight_update()
    finally:
        engine.close()
    return Result(not problems, n_out, "; ".join(problems))


def check_train_e2e(ctx: dict) -> Result:
    """The trainer end to end, colocated (torchrun, the Megatron policy and a vLLM engine in one process), then
    split (pipeline.mode=async: a rollout process and a train process), two DAPO steps each."""
    with tempfile.TemporaryDirectory(prefix="preflight_e2e_") as tmp:
        return _train_e2e(Path(tmp))


def _train_e2e(tmp: Path) -> Result:
    """`torchrun --standalone --nproc-per-node 1 -m megatron_dapo.train` on a random tiny Qwen2 (head_dim 64) and 64
    addition problems: two steps of streamed rollouts, weight syncs, training and a checkpoint each. A random model
    is never right, so dynamic sampling is off (no group would be informative); the steps' numbers must be finite
    and the engine's logprobs near Megatron's (bf16 in both: the bridge check's 0.05 mean).

    Then the same run split at eta = 0, its two roles started as a Slurm step starts them (DAPO_ROLE), sharing the
    one GPU: the weights travel over gloo (NCCL refuses two ranks on one device). Held to the same rules; whether its
    metrics equal the colocated run's (as they do on CPU) is reported, not required."""
    import json
    import math
    import subprocess
    import sys
    import time

    from megatron_dapo.data.generator import generate_rows, write_jsonl
    from megatron_dapo.launch import torchrun
    from megatron_dapo.launch.procs import free_port_pair
    from megatron_dapo.model.tiny import build_tiny_qwen2
    from megatron_dapo.placement.transport import ROLE_ENV, TRAIN_PROCS_ENV, TRANSPORT_ENV

    model = build_tiny_qwen2(tmp / "model", hidden_size=256, intermediate_size=512, num_attention_heads=4)
    data = write_jsonl(tmp / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=64, seed=0))
    overrides = [
        f"model.hf_path={model}",
        f"data.train_files=[{data}]",
        "data.max_prompt_length=480",  # + 24 response tokens within the tiny model's 512 positions
        "rollout.max_response_length=24",
        "algorithm.overlong_buffer_len=8",
        "algorithm.group_size=4",
        "algorithm.dynamic_sampling=false",
        "sampler.train_batch_size=4",
        "sampler.gen_batch_size=4",
        "sampler.max_staleness=0",  # what the split runs so far; colocated, the same steps as without it
        "optim.mini_batch_size=8",
        "optim.warmup_steps=0",
        "reward.num_workers=1",
        "trainer.total_steps=2",
        "trainer.save_every=1",
    ]
    # this check's own world variables out: torchrun sets them, with a rendezvous of its own
    world = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in world}
    n: dict[str, Any] = {}
    problems: list[str] = []
    runs: dict[str, list[dict]] = {}
    for mode in ("colocated", "split"):
        run = tmp / mode
        args = [*overrides, f"trainer.run_dir={run}"]
        t0 = time.perf_counter()
        if mode == "colocated":
            cmd = [*torchrun.command(1), "-m", "megatron_dapo.train"]
            proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True)
            code, log = proc.returncode, proc.stdout[-4000:] + proc.stderr[-8000:]
        else:
            split = ["pipeline.mode=async", "pipeline.weights_backend=gloo"]
            where = {TRANSPORT_ENV: f"127.0.0.1:{free_port_pair()}", TRAIN_PROCS_ENV: "1"}
            cmd = [sys.executable, "-m", "megatron_dapo.train", *args, *split]
            logs = {role: open(tmp / f"{role}.log", "w+") for role in ("rollout", "train")}
            procs = {
                role: subprocess.Popen(cmd, env={**env, **where, ROLE_ENV: role}, stdout=f, stderr=subprocess.STDOUT)
                for role, f in logs.items()
            }
            try:
                code = procs["train"].wait(timeout=240)
                rollout_code = procs["rollout"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = rollout_code = "timed out"
            finally:
                for p in procs.values():
                    if p.poll() is None:
                        p.kill()
            n["split_rollout_exit"] = rollout_code
            log = ""
            for role, f in logs.items():
                f.seek(0)
                log += f"--- {role} ---\n{f.read()[-6000:]}\n"
                f.close()
            if rollout_code != 0:
                problems.append(f"split: the rollout process exited with {rollout_code}")
        seconds = time.perf_counter() - t0
        n[f"{mode}_seconds"] = round(seconds, 1)
        if code != 0:
            print(log)
            problems.append(f"{mode}: the trainer exited with {code} (log below)")
            continue
        path = run / "metrics.jsonl"
        lines = runs[mode] = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        if [m.get("step") for m in lines] != [1.0, 2.0]:
            problems.append(f"{mode}: metrics.jsonl has steps {[m.get('step') for m in lines]}, expected [1, 2]")
        for m in lines:
            tag = f"{mode}_step{int(m['step'])}"
            n[f"{tag}_logp_mismatch"] = round(m.get("rollout/logp_mismatch_mean", math.nan), 5)
            n[f"{tag}_s"] = round(m.get("timing/step", math.nan), 2)
            bad = [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]
            if bad:
                problems.append(f"{mode} step {m['step']}: not finite: {bad[:5]}")
            if m.get("rollout/logp_mismatch_mean", 1.0) > 0.05:
                problems.append(
                    f"{mode} step {m['step']}: engine vs Megatron logprob {m.get('rollout/logp_mismatch_mean')}"
                )
        if sorted(p.name for p in (run / "checkpoints").glob("step_*")) != ["step_00000001", "step_00000002"]:
            problems.append(f"{mode}: checkpoints step_00000001 and step_00000002 not both written")
    if len(runs) == 2:  # the data's metrics: on CPU the two modes agree exactly at eta = 0
        data_keys = ("reward/", "response/", "sampler/", "actor/")
        differ = sorted(
            {
                k
                for a, b in zip(runs["colocated"], runs["split"])
                for k, v in a.items()
                if k.startswith(data_keys) and isinstance(v, float) and b.get(k) != v
            }
        )
        n["split_metrics_differing"] = len(differ)
        n["split_differing_first"] = ",".join(differ[:6])
    return Result(not problems, n, "; ".join(problems))
