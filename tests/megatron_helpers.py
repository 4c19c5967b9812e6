"""Shared by the Megatron model tests: tiny HF models saved as cases, and torchrun launches of megatron_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_dapo.convert.layouts import hf_to_megatron
from megatron_dapo.launch import torchrun
from megatron_dapo.model.arch import ModelArch

WORKER = Path(__file__).with_name("megatron_worker.py")


def tiny_hf_model(
    family: str,
    seed: int = 0,
    vocab_size: int = 250,
    layers: int = 2,
    tied: bool = False,
    rms_norm_eps: float = 1e-6,
    norm_topk_prob: bool = True,
):
    """A randomly initialised tiny Qwen2, Qwen3, Qwen3-MoE or Llama (4 heads, 2 KV groups) from transformers. Qwen3's
    head_dim is 32, twice hidden/heads: a port that derives it gets every attention shape wrong. Qwen3-MoE
    ('qwen3_moe'): `layers` of which the second is dense, the others 8 experts of width 32, each token to its best 2
    (renormalised), and model/tiny.py's near-tie router and q/k norms."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from megatron_dapo.model.tiny import moe_init, random_model

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rms_norm_eps=rms_norm_eps,
    )
    if family == "qwen2":
        model_cls, config = Qwen2ForCausalLM, Qwen2Config(rope_theta=1e6, **common)
    elif family == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(rope_theta=1e6, head_dim=32, **common)
    elif family == "qwen3_moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk_prob)
        config = Qwen3MoeConfig(rope_theta=1e6, head_dim=32, mlp_only_layers=[1], **moe, **common)
        config._experts_implementation = "eager"  # a loop over experts: grouped_mm takes no float64
        model_cls = Qwen3MoeForCausalLM
    else:
        model_cls, config = LlamaForCausalLM, LlamaConfig(rope_theta=5e5, **common)

    def after_init(model) -> None:
        if family == "qwen3_moe":
            moe_init(model)
        # transformers initialises norms to 1 and biases to 0: perturb so both matter (and Qwen3's q_norm and k_norm
        # differ, so a swap of the two shows)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)

    return random_model(model_cls, config, seed, after_init)


def save_case(model, batch: list[dict], out: Path) -> Path:
    """config.json, full Megatron weights.pt and batch.pt for megatron_worker.py."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    arch = ModelArch.from_hf_dir(out)
    torch.save(hf_to_megatron(model.state_dict(), arch), out / "weights.pt")
    torch.save(batch, out / "batch.pt")
    return out


def random_batch(n: int, seq: int, vocab: int, seed: int = 1) -> list[dict]:
    """n samples of seq tokens each (prompt 2..11, the rest response), advantages, fixed old-logp noise.

    noise [R]: the worker's old_logp is the policy's logprobs + noise, so a first step's ratio is exp(-noise).
    rollout_offset [R]: with a rollout correction on, rollout_logp = old_logp + rollout_offset, so the truncated-IS
    weight is min(exp(-rollout_offset), cap).
    """
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(n):
        p = 2 + int(torch.randint(0, 10, (1,), generator=g))
        r = seq - p
        batch.append(
            {
                "prompt": torch.randint(0, vocab, (p,), generator=g).tolist(),
                "response": torch.randint(0, vocab, (r,), generator=g).tolist(),
                "advantage": float(torch.randn((), generator=g)),
                "in_loss": i != 5,  # one overlong-filtered response
                "noise": torch.randn(r, generator=g) * 0.3,  # old_logp offsets: ratios cross both clips
            }
        )
    for b in batch:  # drawn last, so every other field keeps the values it had before this one was added
        b["rollout_offset"] = torch.randn(len(b["response"]), generator=g) * 0.5  # weights exp(-offset) around 1
    return batch


def hf_response_logprobs(model, sample: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' model on prompt + response: (logp [R] float64, differentiable; entropy [R] float64) of the
    response tokens under softmax(logits / temperature)."""
    ids = torch.tensor([sample["prompt"] + sample["response"]])
    logp = torch.log_softmax(model(ids).logits[0].double() / temperature, dim=-1)
    p, r = len(sample["prompt"]), len(sample["response"])
    span = slice(p - 1, p + r - 1)  # position t predicts token t + 1
    token = logp[span].gather(-1, torch.tensor(sample["response"])[:, None])[:, 0]
    return token, -(logp.exp() * logp).sum(-1)[span].detach()


@dataclass(frozen=True)
class Job:
    """One check of megatron_worker.py: the world it needs, its case directory and the worker's other arguments.
    slow: left out unless a slow test of its file is collected (tests/conftest.py megatron_runs)."""

    nproc: int
    case: Path
    args: tuple[str, ...]
    slow: bool = False


def run_jobs(jobs: dict[str, Job], out: Path) -> dict[str, dict | str]:
    """Every job, one torchrun launch per world size, the jobs of a launch one after another in the same processes:
    {name: its rank files merged (see merge), or the text of its failure}."""
    results: dict[str, dict | str] = {}
    for nproc in sorted({j.nproc for j in jobs.values()}):
        batch = {n: j for n, j in jobs.items() if j.nproc == nproc}
        if not batch:
            continue
        argv = [["--case", str(j.case), "--out", str(out / name), *j.args] for name, j in batch.items()]
        listing = out / f"jobs_{nproc}.json"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text(json.dumps(argv))
        proc = _launch(nproc, ["--jobs", str(listing)])
        for name in batch:
            errors = sorted((out / name).glob("error_rank*.txt"))
            if errors:
                results[name] = errors[0].read_text()
            elif (out / name).is_dir() and any((out / name).glob("rank*.pt")):
                results[name] = merge(out / name)
            else:
                results[name] = f"not run: the launch ended first\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return results


def result(results: dict[str, dict | str], name: str) -> dict:
    """A job's merged rank files; its failure (the worker's traceback) fails the test that asks."""
    got = results[name]
    if isinstance(got, str):
        raise AssertionError(f"worker job {name} failed:\n{got}")
    return got


def run_worker(case: Path, out: Path, nproc: int, *args: str) -> dict:
    """torchrun megatron_worker.py, one job; returns the rank files merged (pipeline stages hold disjoint layers)."""
    out.mkdir(parents=True)
    proc = _launch(nproc, ["--case", str(case), "--out", str(out), *args])
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return merge(out)


def _launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [*torchrun.command(nproc), str(WORKER)]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)


def merge(out: Path) -> dict:
    """The rank files of one job merged: grads and weights by name, the rest from whichever rank holds it."""
    merged: dict = {"grads": {}, "weights": {}}
    for f in sorted(out.glob("rank*.pt")):
        part = torch.load(f)
        merged["grads"].update(part.pop("grads", {}))
        merged["weights"].update(part.pop("weights", {}))
        for k, v in part.items():
            if v is not None:  # logprobs and metrics live on the last stage
                merged[k] = v
    return merged
