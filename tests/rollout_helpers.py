"""Transformers references for the rollout tests (the tiny model itself: megatron_dapo.model.tiny), and the module
fixtures of the engine test files (tests/test_rollout.py, tests/test_rollout_stream.py; a plugin of tests/conftest.py):
the tiny Qwen2, its tokenizer, its transformers model and a float32 engine serving it, each built once per module."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2):
    return tiny_qwen2()


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf_model(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    """One engine for the module (vLLM's start-up is the slow part): a test that changes its weights puts them back."""
    from megatron_dapo.rollout import VLLMEngine

    rng, set_num_threads = torch.random.get_rng_state(), torch.set_num_threads
    eng = VLLMEngine(str(model_dir), dtype="float32", max_model_len=256, seed=0)
    # the in-process engine reseeds the global RNGs and stubs out torch.set_num_threads: undone by the engine
    assert torch.equal(torch.random.get_rng_state(), rng) and torch.set_num_threads is set_num_threads
    yield eng
    eng.close()


def load_hf_model(model_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None):
    """The float32 transformers reference model, optionally with state_dict (HF names) loaded over it."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None) -> list[int]:
    """transformers' generate(do_sample=False) continuation of prompt_ids (the prompt excluded)."""
    inp = torch.tensor([prompt_ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if isinstance(eos_token_id, int) else None,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at each response token: float32 [len(response_ids)]."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [R, V]: position t predicts token t+1
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def perturbed_state_dict(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """model's state dict (HF names) with every weight perturbed by scale * N(0, std(weight)): a new policy."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in model.state_dict().items():
        noise = torch.randn(w.shape, generator=g, dtype=w.dtype)
        out[name] = (w + scale * w.std().clamp_min(1e-3) * noise).contiguous()
    return out


class FakeLLM:
    """Stands in for vllm.LLM on the GPU code path (which cannot run here): records what the engine asks of it.

    A worker call sees a worker whose model records load_weights and whose reload_weights records the full reload
    (the GPU FP8 path); calls: ("sleep", level), ("wake_up", tags), ("load", n), ("reload", n), ("reset_prefix_cache",).
    """

    def __init__(self):
        self.calls, self.loaded = [], []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn, args=()):
        fake = self

        class Worker:
            class model_runner:
                @staticmethod
                def get_model():
                    return type("M", (), {"load_weights": lambda _, weights: fake._record("load", weights)})()

            @staticmethod
            def reload_weights(weights_iterator, is_checkpoint_format):
                assert is_checkpoint_format
                fake._record("reload", weights_iterator)

        fn(Worker(), *args)

    def _record(self, kind, weights):
        names = [n for n, _ in weights]
        self.loaded.extend(names)
        self.calls.append((kind, len(names)))


@contextlib.contextmanager
def full_collections() -> Iterator[list[str]]:
    """The collector's generation-2 collections inside the block, as it reports them ("start", "stop" for each),
    through its own callback list (setting gc.callbacks to another list would not reach it)."""
    seen: list[str] = []

    def record(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            seen.append(phase)

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
