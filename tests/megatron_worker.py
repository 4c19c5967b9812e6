"""One rank of a Megatron policy check, run under torchrun by the model tests.

Reads a tiny model (config.json + full Megatron weights.pt) and a fixed batch (batch.pt)
from --case and writes what it measured to --out/rank{RANK}.pt:

- logprobs: response logprobs and entropy at --temperature;
- train: old logprobs (offset by the batch's fixed noise, so clipping happens), one
  train step, then this stage's TP-gathered gradients and updated weights and the metrics, and which of its
  TP-replicated tensors (norms; Qwen3's q/k norms) differ between the TP ranks after the step;
  with a rollout correction on, rollout logprobs too: old logprobs + the batch's rollout_offset;
- steps: --steps on-policy train steps; response logprobs before and after.
- bridge: the weight bridge's Hugging Face tensors (their shapes alone with --bridge-shapes-only) and bucket sizes,
  and the peak resident memory the sync added (VmHWM reset before it, against VmRSS before it). --bridge-format
  names the weight format the receiving end asks for (rollout/quantize.py: none, fp8, fp8_rounded).
- serve: a vLLM engine started from random weights (load_format=dummy) gets the policy's weights
  through the bridge, then generates greedily (no training). Engines run in-process, one per rank.
- resume: checkpoint before any update, train, checkpoint, train on; a fresh policy resumed from the checkpoint
  trains the same step; the newest checkpoint is corrupted and a resume falls back to the previous one; a fresh
  policy resumed from the never-stepped checkpoint trains the first step again.
- nan: a mini-batch whose loss is NaN is skipped (weights, optimizer and LR schedule untouched);
  the next finite one trains.
- attention: model/attention.py's SDPAttention against Megatron's unfused DotProductAttention built from the policy's
  own TransformerConfig (this rank's heads under TP): outputs and input gradients of padded rows (GQA, one row,
  one token) and of packed rows (one SDPA call per sequence) against each sequence alone, in float64 comparisons.
- routes (a MoE case): engines started from random weights take the policy's weights through the bridge and stream
  samples with their routes captured (rollout/vllm_routes.py): an fp32 engine, whose routes the policy's own
  routers must pick (recorded), and whose logprobs the policy must give when it replays them; a bf16 engine, whose
  rollout KL against the fp32 policy is measured with the policy routing by itself and replaying the engine's routes.
- vllm: a vLLM engine (one per rank, in-process, serving --case's HF checkpoint) generates,
  the policy takes one train step, the bridge syncs the new weights into the engine, the
  engine generates again; the policy then scores the engine's responses.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_dapo.model.logprobs import CHUNK_ELEMENTS as DEFAULT_CHUNK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, help="directory with config.json, weights.pt, batch.pt")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--mode",
        choices=("logprobs", "train", "steps", "bridge", "vllm", "serve", "resume", "nan", "attention", "routes"),
        default="train",
    )
    ap.add_argument("--bridge-format", default="none", help="bridge: the weight format the engine asks for")
    ap.add_argument("--bridge-shapes-only", action="store_true", help="bridge: keep no tensor, only its shape")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--entropy-chunk-elements", type=int, default=None, help="logprobs.CHUNK_ELEMENTS (logits per chunk)"
    )
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.tp=2")
    return ap


def main() -> None:
    """One job (the arguments above), or `--jobs FILE`: a JSON list of jobs' argument lists, run one after another in
    this world (one launch, one import of torch and Megatron, for many checks). A failing job writes its traceback to
    its --out as error_rank{RANK}.txt; a lone process goes on with the next job, a world stops (its collectives
    could not)."""
    import json
    import traceback

    argv = sys.argv[1:]
    jobs = json.loads(open(argv[1]).read()) if argv[:1] == ["--jobs"] else [argv]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for i, job in enumerate(jobs):
        args = parser().parse_args(job)
        try:
            run_job(args, last=i == len(jobs) - 1)
        except Exception:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"error_rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
                f.write(traceback.format_exc())
            if world > 1 or i == len(jobs) - 1:
                raise
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


_TORCH_COMPILE = torch.compile
_EAGER: dict = {}  # right after the process's first init_parallel, which imports Megatron (model/cpu_compat.py)


def run_job(args: argparse.Namespace, last: bool) -> None:
    from megatron_dapo.config import load_config
    from megatron_dapo.model import logprobs
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import init_parallel
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.provider import tp_gathered_tensors
    from megatron_dapo.trainer import policy_options

    # adam_eps well above fp32 noise in the grads: a first Adam step is ~lr * sign(g), which
    # would turn 1e-9 differences in near-zero grads into lr-sized differences in the weights
    base = ["model.dtype=fp32", "optim.warmup_steps=0", "optim.lr=1e-3", "optim.adam_eps=1e-4"]
    cfg = load_config(overrides=[*base, *args.overrides])
    logprobs.CHUNK_ELEMENTS = args.entropy_chunk_elements or DEFAULT_CHUNK
    torch.manual_seed(0)  # what a job draws from the default generator does not depend on the jobs before it
    os.makedirs(args.out, exist_ok=True)
    arch = ModelArch.from_hf_dir(args.case)
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=1234)
    from megatron.core import parallel_state

    _EAGER.setdefault("dynamo_imported", "torch._dynamo" in sys.modules)
    _EAGER.setdefault("torch_compile_restored", torch.compile is _TORCH_COMPILE)
    timers = sys.modules.get("megatron.core.timers")  # holds wandb (or None) as Megatron's import found it
    _EAGER.setdefault("wandb_imported", "wandb" in sys.modules or getattr(timers, "wandb", None) is not None)
    policy = MegatronPolicy(arch, layout, torch.load(os.path.join(args.case, "weights.pt")), **policy_options(cfg))
    schedule, passes = policy._forward_backward, []  # each pass of Megatron's schedule: (forward_only, micro-batches)
    policy._forward_backward = lambda **kw: (
        passes.append((kw["forward_only"], kw["num_microbatches"])) or schedule(**kw)
    )

    batch = torch.load(os.path.join(args.case, "batch.pt"))
    dp_rank = parallel_state.get_data_parallel_rank()
    share = len(batch) // layout.dp
    mine = batch[dp_rank * share : (dp_rank + 1) * share]
    samples = [
        TrainSample(
            prompt_ids=b["prompt"],
            response_ids=b["response"],
            advantage=b["advantage"],
            in_loss=b["in_loss"],
            routes=b.get("routes") if cfg.model.router_replay == "r3" else None,  # a MoE batch's given routes
        )
        for b in mine
    ]
    result: dict = {}
    if args.mode == "attention":
        result.update(attention_check(policy.model[0].config))
        if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
            torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
        finish(policy, last)
        return
    if args.mode == "bridge":
        result.update(bridge(policy, cfg, arch, layout, args.bridge_format, not args.bridge_shapes_only))
        if layout.rank == 0:
            torch.save(result, os.path.join(args.out, "rank0.pt"))
        finish(policy, last)
        return
    if args.mode == "resume":
        result.update(resume(policy, samples, mine, cfg, arch, layout, args.out))
        if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
            torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
        finish(policy, last)
        return
    if args.mode in ("vllm", "serve", "routes"):
        run = {"vllm": vllm_sync, "serve": vllm_serve, "routes": routes_check}[args.mode]
        result.update(run(policy, samples, cfg, arch, layout, args.case))
        if parallel_state.get_tensor_model_parallel_rank() == 0 and result.get("megatron") is not None:
            torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
        finish(policy, last)
        return
    r2 = cfg.model.router_replay == "r2" and arch.is_moe
    first = policy.compute_logprobs(samples, args.temperature, with_entropy=args.mode == "logprobs", record_routes=r2)
    if r2:  # what the old-logprob pass's routers picked, for the train step to replay
        result["routes"] = [s.routes for s in samples]
    if args.mode == "nan":
        for i, s in enumerate(samples):
            s.old_logp = first[i]["logp"] + mine[i]["noise"]
        before = tp_gathered_tensors(policy.model, arch, layout)
        samples[0].advantage = float("nan")
        result["metrics_nan"] = policy.train_step(samples, args.temperature)
        result["unchanged"] = all(
            torch.equal(t, tp_gathered_tensors(policy.model, arch, layout)[n]) for n, t in before.items()
        )
        result["steps_after_nan"] = policy.optimizer_steps
        samples[0].advantage = 1.0
        result["metrics"] = policy.train_step(samples, args.temperature)
        result["steps_after_good"] = policy.optimizer_steps
        torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
        finish(policy, last)
        return
    if args.mode == "logprobs":
        result["logprobs"] = first
        result["eager_megatron"] = dict(_EAGER)
        result["packed"] = policy.packed
    elif args.mode == "train":
        if first is not None:  # the last pipeline stage computes the loss
            for i, s in enumerate(samples):
                s.old_logp = first[i]["logp"] + mine[i]["noise"]
                if cfg.rollout_correction().mode != "none":  # weights from w = exp(-rollout_offset)
                    s.rollout_logp = s.old_logp + mine[i]["rollout_offset"]
        result["metrics"] = policy.train_step(samples, args.temperature)
        result["packed"] = policy.packed
        result["grads"] = tp_gathered_tensors(policy.model, arch, layout, grads=True)
        result["weights"] = tp_gathered_tensors(policy.model, arch, layout)
        result["replicas"], result["replicas_differ"] = tp_replicas_differ(policy, arch)
        result["logprobs"] = first
        if arch.is_moe:  # the global indices of the first MoE layer's experts this rank holds
            from megatron_dapo.model.provider import local_slots
            from megatron_dapo.model.sharding import expert_of

            held = {expert_of(s.full_name) for s in local_slots(policy.model, arch, layout.ep_rank)} - {None}
            result["experts_held"] = sorted({e for layer, e, _ in held if layer == arch.moe_layers[0]})
        if r2:  # a second update replays the same recorded routes under the weights the first one moved
            result["metrics2"] = policy.train_step(samples, args.temperature)
    else:
        current = first
        for _ in range(args.steps):
            if current is not None:
                for i, s in enumerate(samples):
                    s.old_logp = current[i]["logp"]
            result.setdefault("metrics", []).append(policy.train_step(samples, args.temperature))
            current = policy.compute_logprobs(samples, args.temperature)
        result["before"], result["after"], result["passes"] = first, current, passes
    if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
        torch.save(result, os.path.join(args.out, f"rank{layout.rank}.pt"))
    elif layout.ep > 1 and layout.etp_rank == 0 and layout.edp_rank == 0 and "grads" in result:
        torch.save(expert_share(result), os.path.join(args.out, f"rank{layout.rank}.pt"))
    finish(policy, last)


def expert_share(result: dict) -> dict:
    """An expert-parallel rank's own experts (its grads and weights), the only part of its result no rank of data-
    parallel rank 0 holds."""
    from megatron_dapo.model.sharding import expert_of

    return {k: {n: t for n, t in result[k].items() if expert_of(n)} for k in ("grads", "weights")}


def tp_replicas_differ(policy, arch) -> tuple[list[str], list[str]]:
    """(this stage's TP-replicated tensors, those whose copies differ between the TP ranks): each rank's copy
    all-gathered over the TP group and compared bit for bit. A replicated weight whose gradient Megatron does not
    reduce over TP (Qwen3's q/k norms without TransformerConfig.qk_layernorm) steps apart on each rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dapo.model.provider import local_slots
    from megatron_dapo.model.sharding import tp_split_dim

    group = parallel_state.get_tensor_model_parallel_group()
    names, differ = [], []
    for slot in local_slots(policy.model, arch):
        if tp_split_dim(slot.full_name) is not None:
            continue
        mine = slot.param.detach().contiguous()
        copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, mine, group=group)
        names.append(slot.full_name)
        if not all(torch.equal(c, copies[0]) for c in copies):
            differ.append(slot.full_name)
    return names, differ


def attention_check(config) -> dict:
    """{case: (largest |SDPA - unfused| over the output and the q, k, v gradients, their largest magnitude)} for
    padded rows and packed rows; the packed reference is each sequence alone through the unfused module."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.model.attention import SDPAttention

    unfused = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self")
    expanded = SDPAttention(config, 1, AttnMaskType.causal, "self", expand_kv=True)
    heads, groups, d = sdpa.heads, sdpa.groups, config.kv_channels
    g = torch.Generator().manual_seed(11)

    def run(module, q, k, v, grad, **kw):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = module(q, k, v, None, **kw)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    def compare(got, want) -> tuple[float, float]:
        diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want))
        return diff, max(float(b.abs().max()) for b in want)

    result = {}
    for case, (s, b) in {"gqa": (9, 3), "one_row": (6, 1), "one_token": (1, 2)}.items():
        q = torch.randn(s, b, heads, d, generator=g)
        k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
        grad = torch.randn(s, b, heads * d, generator=g)
        want = run(unfused, q, k, v, grad)
        result[f"attention_{case}"] = compare(run(sdpa, q, k, v, grad), want)
        result[f"attention_{case}_expand_kv"] = compare(run(expanded, q, k, v, grad), want)
    lengths = [5, 1, 7, 2]  # the last is a row's padding: a segment of its own
    t = sum(lengths)
    q = torch.randn(t, heads, d, generator=g)
    k, v = (torch.randn(t, groups, d, generator=g) for _ in range(2))
    grad = torch.randn(t, heads * d, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    got = run(sdpa, q, k, v, grad, packed_seq_params=params)
    want = [torch.empty_like(x) for x in got]
    for start, end in zip(cu.tolist(), cu.tolist()[1:]):
        seq = [x[start:end].unsqueeze(1) for x in (q, k, v)]  # [n, 1, h, d]: one padded row
        for w, part in zip(want, run(unfused, *seq, grad[start:end].unsqueeze(1))):
            w[start:end] = part.reshape(w[start:end].shape)
    result["attention_packed"] = compare(got, want)
    return result


def finish(policy, last: bool) -> None:
    """The last job ends the world (closing the engines first); any other frees its policy and Megatron's groups,
    keeping torch.distributed and the engines for the next job."""
    from megatron.core import parallel_state

    from megatron_dapo.model.parallel import destroy_parallel

    if last:
        for engine in _ENGINES.values():
            engine.close(exiting=True)  # the worker ends next; the shutdown destroys the torch.distributed world
        _ENGINES.clear()
        destroy_parallel()
        return
    policy.close()
    parallel_state.destroy_model_parallel()


def _unsafe_and_full(policy, manager, layout, out: str) -> dict:
    """A state file that names code to run, put into the newest complete checkpoint: load refuses it without
    falling back to an older one, running nothing. Then (one process, as root) saves into a tmpfs with room for two
    checkpoints: the third fails with one line naming the path and the space needed, its step_N.tmp removed."""
    import subprocess
    import tempfile

    import torch.distributed as dist
    from run_helpers import RunsCode

    from megatron_dapo.checkpoint import CheckpointManager, CheckpointSpaceError
    from megatron_dapo.convert.resolve import UnsafeCheckpoint, rank_state_file

    mark = os.path.join(out, "ran")
    crafted = CheckpointManager(os.path.join(out, "crafted"), keep_last=3)
    crafted.save(policy, 1, {})
    crafted.save(policy, 2, {})
    dist.barrier()  # every rank's own file (each reads its own before anything collective)
    torch.save({"step": 2, "trainer": RunsCode(mark)}, rank_state_file(crafted.root / "step_00000002", layout.rank))
    dist.barrier()
    try:
        crafted.load(policy)
        unsafe = None
    except UnsafeCheckpoint as e:
        unsafe = str(e)
    got = {"unsafe": unsafe, "ran": os.path.exists(mark)}
    if layout.world_size > 1 or os.geteuid() != 0:
        return got
    size = sum(f.stat().st_size for f in (crafted.root / "step_00000001").rglob("*") if f.is_file())
    mount = tempfile.mkdtemp(dir=out)
    room = -(-int(size * 2.5) // 4096) * 4096  # two checkpoints, not three
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", mount]).returncode != 0:
        return got  # no mount here (a container without the right): the test says so
    try:
        full = CheckpointManager(os.path.join(mount, "run", "checkpoints"), keep_last=3)
        error = None
        for step in (1, 2, 3):
            try:
                full.save(policy, step, {})
            except CheckpointSpaceError as e:
                error = str(e)
                break
        got["full"] = {
            "error": error,
            "root": str(full.root),
            "left": sorted(p.name for p in full.root.iterdir()),
            "latest": (full.root / "latest").read_text().strip(),
        }
    finally:
        subprocess.run(["umount", mount])
    return got


def resume(policy, samples, mine, cfg, arch, layout, out: str) -> dict:
    import random

    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.model.policy import MegatronPolicy
    from megatron_dapo.model.provider import tp_gathered_tensors
    from megatron_dapo.trainer import policy_options

    def step(p):
        logps = p.compute_logprobs(samples, 0.9)
        if logps is not None:
            for i, s in enumerate(samples):
                s.old_logp = logps[i]["logp"] + mine[i]["noise"]
        return p.train_step(samples, 0.9)

    # saved before any update (as when every update so far was skipped): no Adam state yet, step 0
    never = CheckpointManager(os.path.join(out, "ckpt0"), keep_last=1)
    never.save(policy, 0, {})
    first = step(policy)
    after_first = tp_gathered_tensors(policy.model, arch, layout)
    manager = CheckpointManager(os.path.join(out, "ckpt"), keep_last=2)
    for _ in range(2):  # several optimizer steps: Adam's step count must come back right, not as 1
        step(policy)
    manager.save(policy, 1, {"loader": {"queue": [3, 1, 2]}, "python_random": random.random()})
    expected_random = random.random()  # the RNG stream right after the save
    second = step(policy)
    after_a = tp_gathered_tensors(policy.model, arch, layout)
    manager.save(policy, 2, {})

    # a fresh policy with random weights, resumed from step 1 (named explicitly), trains step 2 again
    fresh = MegatronPolicy(arch, layout, None, **policy_options(cfg))
    state = manager.load(fresh, manager.root / "step_00000001")
    resumed_random = random.random()
    second_b = step(fresh)
    after_b = tp_gathered_tensors(fresh.model, arch, layout)
    # closed and dropped, a policy's memory goes back (Megatron's config would otherwise keep it: OOM on a GPU)
    import gc
    import weakref

    fresh_param = weakref.ref(next(fresh.model[0].parameters()))
    fresh.close()
    del fresh
    gc.collect()

    # the newest checkpoint is damaged: `latest` points at it, load falls back to step 1
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for f in (manager.root / "step_00000002" / "dist").glob("*.distcp"):
            f.write_bytes(b"garbage")
    dist.barrier()
    fallback = manager.load(MegatronPolicy(arch, layout, None, **policy_options(cfg)))

    # the never-stepped checkpoint resumes into the first step the uninterrupted policy took
    restarted = MegatronPolicy(arch, layout, None, **policy_options(cfg))
    never.load(restarted)
    first_b = step(restarted)
    weights_first_b = tp_gathered_tensors(restarted.model, arch, layout)

    # saved under the other layer spec (Transformer Engine's): refused at once, without falling back past it to an
    # older checkpoint (they were all saved the same way); step 2 is the damaged one above, so load reaches step 1
    from megatron_dapo.checkpoint import CheckpointMismatch
    from megatron_dapo.convert.resolve import read_rank_state

    rank_file = manager.root / "step_00000001" / "state" / f"rank{layout.rank:05d}.pt"
    saved = read_rank_state(rank_file)
    layers_saved = dict(saved["layers"])
    saved["layers"]["transformer_impl"] = "transformer_engine"
    torch.save(saved, rank_file)
    dist.barrier()
    try:
        manager.load(restarted)  # (the damaged step 2 is tried first: restarted's weights are garbage after this)
        refusal = None
    except CheckpointMismatch as e:
        refusal = str(e)
    return {
        **_unsafe_and_full(policy, manager, layout, out),
        "layers_saved": layers_saved,
        "refusal": refusal,
        "first": first,
        "first_b": first_b,
        "weights_first": after_first,
        "weights_first_b": weights_first_b,
        "metrics_a": second,
        "metrics_b": second_b,
        "weights": after_a,
        "weights_b": after_b,
        "state": state,
        "rng_same": expected_random == resumed_random,
        "fallback_step": fallback["step"],
        "kept": sorted(p.name for p in manager.complete()),
        "megatron": "set",
        "closed_policy_freed": fresh_param() is None,
    }


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class _Collector:
    """A rollout engine stand-in that keeps names and sizes only, so the bridge's own memory is measured."""

    def __init__(self, keep: bool, weight_format: str = "none") -> None:
        self.keep, self.tensors, self.bucket_bytes = keep, {}, []
        self.weight_format = weight_format  # what an FP8 engine would ask the bridge for

    def update_weights(self, bucket, digest=None) -> None:
        self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, t in bucket:
            self.tensors[name] = t.clone() if self.keep else t.shape

    def finish_weight_update(self) -> None:
        pass


def bridge(policy, cfg, arch, layout, weight_format: str, keep: bool) -> dict:
    import gc

    from megatron_dapo.rollout.weight_bridge import WeightBridge

    wb = WeightBridge(policy.model, arch, layout, bucket_bytes=cfg.rollout.bucket_bytes)
    sink = _Collector(keep, weight_format)
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


_ENGINES: dict = {}
"""This rank's engines by (model directory, load format): built by the first job that asks, kept by the jobs of the
launch (one vLLM start-up for all), closed by the last one (finish)."""


def _engine(model_dir: str, load_format: str = "auto", dtype: str = "float32", capture_routes: bool = False):
    """This rank's in-process engine: every rank builds one (vLLM's set-up is collective over the world)."""
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    key = (model_dir, load_format, dtype, capture_routes)
    if key not in _ENGINES:
        _ENGINES[key] = VLLMEngine(
            model_dir, dtype=dtype, max_model_len=256, seed=0, load_format=load_format, capture_routes=capture_routes
        )
    return _ENGINES[key]


def vllm_serve(policy, samples, cfg, arch, layout, model_dir: str) -> dict:
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    engine = _engine(model_dir, load_format="dummy")
    sync = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes).sync(engine)
    greedy = engine.generate([s.prompt_ids for s in samples], n=1, temperature=0.0, top_p=1.0, max_tokens=16)
    return {"greedy": [g[0].token_ids for g in greedy], "sync": sync, "megatron": "last stage"}


def vllm_sync(policy, samples, cfg, arch, layout, model_dir: str) -> dict:
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    engine = _engine(model_dir)
    bridge = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes)
    bridge.sync(engine)  # this job's starting weights (an engine kept from an earlier job holds that job's)
    prompts = [s.prompt_ids for s in samples]
    greedy = dict(prompts=prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=12)
    sampled = dict(prompts=prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=12, seed=7)
    before = engine.generate(**greedy)
    for s in samples:  # a big on-policy step: positive advantages on the batch's own responses
        s.advantage, s.in_loss = 1.0, True
    first = policy.compute_logprobs(samples, 1.0)
    if first is not None:
        for s, lp in zip(samples, first):
            s.old_logp = lp["logp"]
    metrics = policy.train_step(samples, 1.0)
    sync = bridge.sync(engine)
    after = engine.generate(**greedy)
    drawn = engine.generate(**sampled)
    # the policy (new weights) scores what the engine generated after the sync (the same on every rank: same
    # weights, same seeds, so the tensor-parallel ranks score the same samples)
    from megatron_dapo.model.policy import TrainSample

    scored = [
        TrainSample(prompt_ids=p, response_ids=r.token_ids)
        for group, p in zip(after + drawn, prompts + prompts)
        for r in group
    ]
    megatron = policy.compute_logprobs(scored, 1.0)
    # a sync whose second bucket is damaged after its digest was taken (DAPO_FAULT's corrupt, on every rank): the
    # engine refuses it before loading anything and generates as before
    from megatron_dapo.progress import FAULT_ENV

    os.environ[FAULT_ENV] = "corrupt:sync:9:1"
    try:
        bridge.sync(engine, 9)
        damaged = None
    except RuntimeError as e:
        damaged = str(e)
    finally:
        del os.environ[FAULT_ENV]
    kept = engine.generate(**greedy)
    return {
        "damaged": damaged,
        "kept": [[r.token_ids for r in g] for g in kept],
        "before": [[r.token_ids for r in g] for g in before],
        "after": [[r.token_ids for r in g] for g in after],
        "vllm_logp": [torch.tensor(r.logprobs) for g in after + drawn for r in g],
        "megatron": None if megatron is None else [x["logp"] for x in megatron],
        "metrics": metrics,
        "sync": sync,
    }


def routes_check(policy, samples, cfg, arch, layout, model_dir: str) -> dict:
    """The 'routes' mode (module docstring): per engine dtype, the streamed samples, the engine's routes and logprobs,
    the policy's recorded routes and its logprobs routing by itself and replaying."""
    from dataclasses import replace

    from megatron_dapo.model.policy import TrainSample
    from megatron_dapo.rollout.engine import GroupRequest
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    bridge = WeightBridge(policy.model, arch, layout, cfg.rollout.bucket_bytes)
    out: dict = {"megatron": "set"}
    for dtype in ("float32", "bfloat16"):
        engine = _engine(model_dir, load_format="dummy", dtype=dtype, capture_routes=True)
        bridge.sync(engine)
        groups = [
            GroupRequest(key=i, prompt_ids=s.prompt_ids, n=4, seed=11 + i, version=0) for i, s in enumerate(samples)
        ]
        engine.submit(groups, temperature=1.0, top_p=1.0, max_tokens=16)
        done: dict = {}
        while engine.in_flight():
            done.update(engine.step())
        drawn = [TrainSample(prompt_ids=g.prompt_ids, response_ids=r.token_ids) for g in groups for r in done[g.key]]
        engine_routes = [r.routes for g in groups for r in done[g.key]]
        own = policy.compute_logprobs(drawn, 1.0, record_routes=True)
        replayed = policy.compute_logprobs([replace(s, routes=r) for s, r in zip(drawn, engine_routes)], 1.0)
        out[dtype] = {
            "prompts": [s.prompt_ids for s in drawn],
            "responses": [s.response_ids for s in drawn],
            "engine_routes": engine_routes,
            "recorded_routes": [s.routes for s in drawn],
            "engine_logp": [torch.tensor(r.logprobs) for g in groups for r in done[g.key]],
            "own_logp": [x["logp"] for x in own],
            "replayed_logp": [x["logp"] for x in replayed],
        }
        if dtype == "float32":
            out["continued"] = continued_routes(policy, bridge, engine, samples)
    return out


def continued_routes(policy, bridge, engine, samples) -> dict:
    """Partial rollout's routes: groups paused after a few engine steps, the policy's weights moved by a train step
    and synced, the groups continued. Returns each continued sample's routes before the pause and once finished,
    and the routes the policy's own routers pick for the finished sample under the new weights."""
    from megatron_dapo.model.policy import TrainSample
    from megatron_dapo.rollout.engine import GroupRequest

    groups = [
        GroupRequest(key=100 + i, prompt_ids=s.prompt_ids, n=2, seed=31 + i, version=0) for i, s in enumerate(samples)
    ]
    engine.submit(groups, temperature=1.0, top_p=1.0, max_tokens=16)
    for _ in range(4):
        engine.step()  # every sample has some tokens, none has finished (16 to go)
    paused = engine.abort([g.key for g in groups])
    moved = [TrainSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids or [1], advantage=1.0) for s in samples]
    old = policy.compute_logprobs(moved, 1.0)
    for s, lp in zip(moved, old):
        s.old_logp = lp["logp"]
    for _ in range(3):  # a large lr (the worker's 1e-3, fresh Adam): the routers move
        policy.train_step(moved, 1.0)
    bridge.sync(engine)
    engine.submit([GroupRequest(g.key, g.prompt_ids, g.n, g.seed, 1, prefixes=paused[g.key]) for g in groups], 1.0,
                  1.0, 16)  # fmt: skip
    done: dict = {}
    while engine.in_flight():
        done.update(engine.step())
    finished = [(g.prompt_ids, p, r) for g in groups for p, r in zip(paused[g.key], done[g.key])]
    scored = [TrainSample(prompt_ids=prompt, response_ids=r.token_ids) for prompt, _, r in finished]
    policy.compute_logprobs(scored, 1.0, record_routes=True)
    return {
        "prompt_tokens": [len(prompt) for prompt, _, _ in finished],
        "prefix_tokens": [len(p.token_ids) for _, p, _ in finished],
        "paused_routes": [p.routes for _, p, _ in finished],
        "finished_routes": [r.routes for _, _, r in finished],
        "policy_routes": [s.routes for s in scored],
    }


if __name__ == "__main__":
    main()
