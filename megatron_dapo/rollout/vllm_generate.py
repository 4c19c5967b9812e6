"""VLLMEngine's batch path: generate(), n samples per prompt in one llm.generate call, failed samples retried once.

Each returned logprob is the sampled token's logprob under the distribution it was drawn from (see LOGPROBS_MODE in
vllm_engine.py); text comes from one batched decode of every response's token ids.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any

from megatron_dapo.rollout.engine import validate_generate_args
from megatron_dapo.types import Response

logger = logging.getLogger("megatron_dapo.rollout.vllm_engine")  # one logger for every part of the engine

RETRY_SEED_OFFSET = 1_000_003
"""Seed shift for re-requested samples, so they do not repeat the seeds of the first attempt."""


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float] | None:
    """Per-token logprob of each sampled token from vLLM's per-position {token id: Logprob}; None if incomplete."""
    if logprobs is None or len(logprobs) != len(token_ids):
        return None
    out = []
    for position, tok in zip(logprobs, token_ids):
        if not position or tok not in position:
            return None
        out.append(float(position[tok].logprob))
    return out


def _to_response(completion: Any) -> Response | None:
    """A vLLM CompletionOutput as a Response; None when it failed (aborted, errored, logprobs missing)."""
    if completion.finish_reason not in ("stop", "length"):
        return None
    token_ids = list(completion.token_ids)
    logprobs = sampled_logprobs(completion.logprobs, token_ids)
    if logprobs is None:
        return None
    # "length": max_tokens (or max_model_len) was reached; "stop": EOS or a stop token, which token_ids keeps.
    # text is filled in later by one batched decode.
    return Response(token_ids=token_ids, text="", logprobs=logprobs, truncated=completion.finish_reason == "length")


class GenerateMixin:
    """generate(): the part of VLLMEngine (vllm_engine.py) that samples whole batches.

    VLLMEngine provides llm, model_path, max_model_len, stats, show_progress, _broken, _check_ready(),
    _sampling_params() and _engine_sampling(); streaming (vllm_stream.py) provides _refuse_while_streaming().
    """

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[list[Response]]:
        """n samples per prompt (see RolloutEngine.generate); P prompts -> P lists of n Responses, in order.

        With a seed, prompt i's samples use seeds seed + i*n + j (vLLM gives sample j of a request seed + j).
        Without one, they continue the engine's random stream (seeded by the engine seed). A sample whose output
        is missing or failed is requested once more; if it fails again this raises with the count (and
        stats["failures"]). Response.text is tokenizer.decode(token_ids, skip_special_tokens=True).
        """
        validate_generate_args(prompts, n, temperature, top_p, max_tokens)
        for i, p in enumerate(prompts):
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: max_model_len={self.max_model_len} leaves no room")
        self._refuse_while_streaming("generate()")  # llm.generate would run (and swallow) the streamed requests too
        self._check_ready()
        t0 = time.perf_counter()
        self.stats["requests"] += len(prompts) * n  # counted up front: a call that raises still asked for them

        def params(count: int, seed_i: int | None) -> Any:
            return self._sampling_params(count, temperature, top_p, max_tokens, stop_token_ids, seed_i)

        seeds = [None if seed is None else seed + i * n for i in range(len(prompts))]
        outputs = self._run(prompts, [params(n, s) for s in seeds])
        results = [self._collect(outputs, i) for i in range(len(prompts))]
        missing = {i: n - len(r) for i, r in enumerate(results) if len(r) < n}
        if missing:
            self._retry(prompts, results, missing, seeds, params, n)
        self._decode(results)
        self._count(results, time.perf_counter() - t0)
        return results

    def _decode(self, results: list[list[Response]]) -> None:
        """Fill each Response's text: tokenizer.decode(token_ids, skip_special_tokens=True), in one batch."""
        flat = [r for rs in results for r in rs]
        texts = self.llm.get_tokenizer().batch_decode([r.token_ids for r in flat], skip_special_tokens=True)
        for r, text in zip(flat, texts):
            r.text = text

    @staticmethod
    def _collect(outputs: list[Any], i: int) -> list[Response]:
        """The good Responses of request i, in sample order (possibly fewer than asked for)."""
        if i >= len(outputs) or outputs[i] is None:
            return []
        completions = sorted(outputs[i].outputs, key=lambda c: c.index)
        return [r for r in (_to_response(c) for c in completions) if r is not None]

    def _retry(self, prompts, results, missing: dict[int, int], seeds, params, n: int) -> None:
        """Ask once more for the missing samples of each prompt (results[i] gets them); raise if still missing."""
        idx = sorted(missing)
        self.stats["retries"] += sum(missing.values())
        logger.warning("vLLM: %d samples of %d prompts failed; retrying them once", sum(missing.values()), len(idx))
        retry_seeds = [None if seeds[i] is None else seeds[i] + RETRY_SEED_OFFSET for i in idx]
        outputs = self._run([prompts[i] for i in idx], [params(missing[i], s) for i, s in zip(idx, retry_seeds)])
        failed = 0
        for k, i in enumerate(idx):
            got = self._collect(outputs, k)[: missing[i]]
            results[i].extend(got)
            failed += missing[i] - len(got)
        if failed:
            self.stats["failures"] += failed
            raise RuntimeError(
                f"vLLM engine for model {self.model_path!r}: {failed} of {sum(missing.values())} retried samples "
                f"failed again ({len(idx)} prompts affected, {len(prompts) * n} samples requested in this call)"
            )

    def _count(self, results: list[list[Response]], seconds: float) -> None:
        s = self.stats
        s["generated_tokens"] += sum(len(r.token_ids) for rs in results for r in rs)
        s["seconds"] += seconds
        s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0

    def _run(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        """One llm.generate over token-id prompts; an exception means the engine died: RuntimeError, and broken."""
        from vllm.inputs import TokensPrompt

        try:
            with self._engine_sampling():
                return self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=self._progress_bar()
                )
        except Exception as e:
            self._broken = f"generate failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during generate: {e}") from e

    def _progress_bar(self) -> Any:
        """vLLM's per-call bar when show_progress is set and stderr is a terminal (not in a log file)."""
        if not (self.show_progress and sys.stderr.isatty()):
            return False  # vLLM divides by a disabled bar's elapsed time (0): never hand it one
        from tqdm import tqdm

        return functools.partial(tqdm, leave=False)
