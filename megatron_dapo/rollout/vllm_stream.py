"""VLLMEngine's streaming half (StreamingEngine, for the dynamic-sampling loader; the same code on CPU and GPU).

submit() adds each sample of a group as its own n=1 request, seeded seed + j exactly as generate() seeds sample j,
straight into vLLM's V1 `llm.llm_engine` (add_request / step / abort_request); step() runs one engine step and
returns the groups whose last sample finished in it. Requests ask for DELTA outputs (only the new tokens of each
step), which the engine accumulates with their logprobs and the policy version that sampled them, so a step costs
time in the tokens it produced, not in the lengths so far. abort() returns every sample's tokens so far; submitting
them back as GroupRequest.prefixes continues each from its last token (a new request over prompt + prefix). While
groups are in flight generate(), sleep() and weight updates refuse: they would run, free or change what the
in-flight requests use. Under external_launcher every rank of a vLLM TP group must make the same calls in the same
order, as for generate().
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from megatron_dapo.rollout.engine import GroupRequest, continuation_seed, validate_generate_args
from megatron_dapo.rollout.vllm_env import rejected_input
from megatron_dapo.rollout.vllm_generate import sampled_logprobs
from megatron_dapo.types import Response


@dataclass
class _StreamGroup:
    """One streamed GroupRequest while it is in flight: its n samples accumulate here, step by step.

    The per-sample lists are indexed by sample j (0..n-1); tokens[j], logprobs[j] and versions[j] all have the
    sample's length so far, prefix (from GroupRequest.prefixes) included. logprobs[j]/versions[j] are None only for
    a finished prefix that came without them (it is kept as it is).
    """

    key: int
    prompt_ids: list[int]
    n: int
    seed: int
    version: int
    tokens: list[list[int]]
    logprobs: list[list[float] | None]
    versions: list[list[int] | None]
    truncated: list[bool]
    finished: list[bool]
    request_ids: list[str | None]
    """vLLM request id of sample j while it generates; None once finished (or if it never needed a request)."""
    routes: list[Any]
    """Sample j's routes (Response.routes) once complete, when the engine captures them; else None."""
    unfinished: int
    """Samples still generating: the group is complete when this reaches 0."""

    def responses(self, texts: list[str]) -> list[Response]:
        """The n samples as Responses, in sample order; texts[j] is sample j's decoded text."""
        return [
            Response(
                token_ids=self.tokens[j],
                text=texts[j],
                logprobs=self.logprobs[j],
                truncated=self.truncated[j],
                versions=self.versions[j],
                finished=self.finished[j],
                routes=self.routes[j],
            )
            for j in range(self.n)
        ]


class StreamMixin:
    """submit() / step() / abort(): the part of VLLMEngine (vllm_engine.py) that streams groups.

    VLLMEngine calls _init_streaming() at construction and provides llm, model_path, max_model_len, stats, _broken,
    _check_ready(), _sampling_params() and _engine_sampling().
    """

    def _init_streaming(self) -> None:
        """No group in flight."""
        self._groups: dict[int, _StreamGroup] = {}  # streamed groups in flight, by key
        self._sample_of: dict[str, tuple[_StreamGroup, int]] = {}  # vLLM request id -> (its group, sample j)
        self._done_at_submit: list[int] = []  # keys of groups submitted already complete: the next step returns them
        self._stream_requests = 0  # makes each streamed request's id unique for the engine's lifetime
        self._internal: dict[str, str] = {}  # our request id -> vLLM's internal one (route capture's key)
        self.route_capture = None  # RouteCapture when the engine captures routes (VLLMEngine capture_routes)
        self._updating_in_flight = False  # update_weights_in_flight() is applying weights under streamed groups

    def submit(
        self,
        groups: list[GroupRequest],
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        """Queue the groups' samples as vLLM requests (see StreamingEngine.submit); nothing is queued if it raises.

        Sample j of a group is one n=1 request seeded group.seed + j: the same seed, hence the same tokens, as
        sample j of generate([prompt_ids], n, ..., seed=group.seed). A continued sample (an unfinished prefix of
        k tokens) is a request over prompt_ids + its k tokens with max_tokens - k left, seeded
        continuation_seed(group.seed + j, k); with nothing left it is complete (truncated) without a request.
        A finished prefix is kept as it is. A group with nothing to generate is returned by the next step().
        """
        plans = self._plan_stream(groups, temperature, top_p, max_tokens)
        self._check_ready()
        from vllm.sampling_params import RequestOutputKind

        recs = [self._new_stream_group(g, plan) for g, plan in zip(groups, plans)]
        added: list[str] = []
        try:
            for rec, plan in zip(recs, plans):
                for j, request in enumerate(plan):
                    if request is None:
                        continue
                    ids, seed, limit = request
                    params = self._sampling_params(1, temperature, top_p, limit, stop_token_ids, seed)
                    params.output_kind = RequestOutputKind.DELTA  # each step returns only its new tokens
                    rid = f"stream-{self._stream_requests}"
                    self._stream_requests += 1
                    internal = self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)
                    added.append(rid)
                    rec.request_ids[j] = rid
                    if self.route_capture is not None:
                        self._internal[rid] = internal
                        self.route_capture.expect(internal)
        except Exception as e:  # take back what this call queued: a submit is all or nothing
            with contextlib.suppress(Exception):
                self.llm.llm_engine.abort_request(added)
            for rid in added:
                self._take_routes(rid)
            if rejected_input(e):  # vLLM rejected an input (e.g. a token id outside the vocabulary)
                raise ValueError(f"vLLM rejected a request of this submit: {e}") from e
            self._broken = f"submit failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during submit: {e}") from e
        for rec in recs:
            self._groups[rec.key] = rec
            for j, rid in enumerate(rec.request_ids):
                if rid is not None:
                    self._sample_of[rid] = (rec, j)
            if rec.unfinished == 0:
                self._done_at_submit.append(rec.key)
        self.stats["requests"] += len(added)  # sequences asked for: continuations count, kept samples do not

    def _plan_stream(
        self, groups: list[GroupRequest], temperature: float, top_p: float, max_tokens: int
    ) -> list[list[tuple[list[int], int, int] | None]]:
        """Validate a submit (ValueError, nothing changed) and plan it: per group, per sample j, the request to add
        as (prompt token ids, seed, max_tokens), or None for a sample that needs none (a finished prefix, or an
        unfinished one already at max_tokens)."""
        seen: set[int] = set()
        dup = []
        for g in groups:
            if g.key in seen or g.key in self._groups:
                dup.append(g.key)
            seen.add(g.key)
        if dup:
            raise ValueError(
                f"group keys {dup} are already in flight (or repeated in this submit): keys must be unique"
            )
        plans = []
        for g in groups:
            try:
                validate_generate_args([g.prompt_ids], g.n, temperature, top_p, max_tokens)
            except ValueError as e:
                raise ValueError(f"group {g.key}: {e}") from None
            if g.prefixes is not None and len(g.prefixes) != g.n:
                raise ValueError(f"group {g.key}: {len(g.prefixes)} prefixes for n={g.n} samples")
            plan: list[tuple[list[int], int, int] | None] = []
            for j in range(g.n):
                prefix = None if g.prefixes is None else g.prefixes[j]
                done = [] if prefix is None else list(prefix.token_ids)
                if prefix is not None and not prefix.finished:
                    if (
                        prefix.logprobs is None
                        or prefix.versions is None
                        or not (len(prefix.logprobs) == len(prefix.versions) == len(done))
                    ):
                        raise ValueError(
                            f"group {g.key} sample {j}: an unfinished prefix needs logprobs and versions, one per token"
                        )
                if (prefix is not None and prefix.finished) or max_tokens - len(done) <= 0:
                    plan.append(None)
                    continue
                ids = list(g.prompt_ids) + done
                if len(ids) >= self.max_model_len:
                    raise ValueError(
                        f"group {g.key} sample {j}: prompt + prefix has {len(ids)} tokens: "
                        f"max_model_len={self.max_model_len} leaves no room"
                    )
                # a continued sample's seed depends on where it resumes (== seed + j when it has no tokens yet)
                seed = g.seed + j if prefix is None else continuation_seed(g.seed + j, len(done))
                plan.append((ids, seed, max_tokens - len(done)))
            plans.append(plan)
        return plans

    @staticmethod
    def _new_stream_group(g: GroupRequest, plan: list[tuple[list[int], int, int] | None]) -> _StreamGroup:
        """g's record, its prefixes copied in. A sample planned without a request is complete from the start:
        a finished prefix as it is, an unfinished one already at max_tokens as truncated."""
        rec = _StreamGroup(
            key=g.key,
            prompt_ids=list(g.prompt_ids),
            n=g.n,
            seed=g.seed,
            version=g.version,
            tokens=[[] for _ in range(g.n)],
            logprobs=[[] for _ in range(g.n)],
            versions=[[] for _ in range(g.n)],
            truncated=[False] * g.n,
            finished=[request is None for request in plan],
            request_ids=[None] * g.n,
            routes=[None] * g.n,
            unfinished=sum(request is not None for request in plan),
        )
        for j, prefix in enumerate(g.prefixes or []):
            rec.tokens[j] = list(prefix.token_ids)
            rec.logprobs[j] = None if prefix.logprobs is None else list(prefix.logprobs)
            rec.versions[j] = None if prefix.versions is None else list(prefix.versions)
            if plan[j] is None:  # kept as it is: so are its routes (a continued one gets its re-prefill's)
                rec.routes[j] = prefix.routes
            if plan[j] is None:
                rec.truncated[j] = prefix.truncated if prefix.finished else True
        return rec

    def step(self) -> list[tuple[int, list[Response]]]:
        """One engine step (see StreamingEngine.step): [(key, n Responses in sample order)] for each group whose
        last sample finished in it, in the order they finished; [] and no engine call when nothing generates.

        Each sample's new tokens (DELTA outputs) are appended with their logprobs and the group's version. A
        finish reason other than "stop" (EOS or a stop token, kept in token_ids) or "length" (max_tokens or
        max_model_len: truncated) means vLLM failed the request: RuntimeError, and the engine is marked unusable.
        """
        self.stats["stream_steps"] += 1
        finished_now: list[_StreamGroup] = []
        if self._sample_of:
            self._check_ready()
            t0 = time.perf_counter()
            try:
                with self._engine_sampling():
                    outputs = self.llm.llm_engine.step()
            except Exception as e:
                self._broken = f"step failed: {type(e).__name__}: {e}"
                raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during step: {e}") from e
            for out in outputs:
                rec = self._take_output(out)
                if rec is not None:
                    finished_now.append(self._groups.pop(rec.key))
            self.stats["stream_busy_steps"] += 1
            self.stats["seconds"] += time.perf_counter() - t0
            s = self.stats
            s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        # groups submitted complete finished before anything this step produced: they come first
        complete = [self._groups.pop(k) for k in self._done_at_submit] + finished_now
        self._done_at_submit.clear()
        return self._decoded(complete)

    def _take_output(self, out: Any) -> _StreamGroup | None:
        """Append one request's new tokens (a DELTA RequestOutput) to its sample; returns the sample's group
        when this output finished the group's last sample."""
        found = self._sample_of.get(out.request_id)
        if found is None:  # a request aborted after it was scheduled: nobody wants its tokens
            return None
        rec, j = found
        c = out.outputs[0]  # n=1: the only sample of the request
        new = list(c.token_ids)
        # An output may carry only the finish. Its logprobs are then never read: vLLM 0.25 hands such a delta the
        # whole logprob history (`logprobs[-0:]` in v1/engine/output_processor.py), 0.32 an empty slice.
        lps = sampled_logprobs(c.logprobs, new) if new else []
        if lps is None or (out.finished and c.finish_reason not in ("stop", "length")):
            why = "logprobs missing" if lps is None else f"finish_reason={c.finish_reason!r}"
            self._broken = f"streamed request failed ({why})"
            raise RuntimeError(
                f"vLLM engine for model {self.model_path!r}: streamed request of group {rec.key} sample {j} "
                f"failed ({why})"
            )
        rec.tokens[j].extend(new)
        rec.logprobs[j].extend(lps)
        rec.versions[j].extend([rec.version] * len(new))
        self.stats["generated_tokens"] += len(new)
        if not out.finished:
            return None
        del self._sample_of[out.request_id]
        rec.request_ids[j] = None
        rec.finished[j] = True
        rec.truncated[j] = c.finish_reason == "length"
        if self.route_capture is not None:
            self.route_capture.finished(self._internal[out.request_id], c)
            rec.routes[j] = self._finished_routes(out.request_id, rec, j)
        rec.unfinished -= 1
        return rec if rec.unfinished == 0 else None

    def abort(self, keys: list[int]) -> dict[int, list[Response]]:
        """Stop these groups and forget them (see StreamingEngine.abort): {key: n Responses in sample order}, a
        finished sample whole, the others with their tokens, logprobs and versions so far and finished=False.

        Raises KeyError (nothing aborted) for a key not in flight.
        """
        keys = list(dict.fromkeys(keys))
        unknown = [k for k in keys if k not in self._groups]
        if unknown:
            raise KeyError(f"groups {unknown} are not in flight (never submitted, already returned or aborted)")
        recs = [self._groups.pop(k) for k in keys]
        self._done_at_submit = [k for k in self._done_at_submit if k in self._groups]
        rids = [rid for rec in recs for rid in rec.request_ids if rid is not None]
        for rid in rids:
            rec, j = self._sample_of.pop(rid)
            rec.routes[j] = self._take_routes(rid)  # what was computed before the stop
        if rids and self._broken is None:  # a dead engine has nothing left to stop
            try:
                self.llm.llm_engine.abort_request(rids)
            except Exception as e:
                self._broken = f"abort failed: {type(e).__name__}: {e}"
                raise RuntimeError(f"vLLM engine for model {self.model_path!r} failed during abort: {e}") from e
        self.stats["stream_aborted_tokens"] += sum(
            len(toks) for rec in recs for toks, fin in zip(rec.tokens, rec.finished) if not fin
        )
        return dict(self._decoded(recs))

    def _take_routes(self, rid: str):
        """A request's captured routes (by our request id), forgotten by the capture; None without capture."""
        if self.route_capture is None:
            return None
        return self.route_capture.take(self._internal.pop(rid))

    def _finished_routes(self, rid: str, rec: _StreamGroup, j: int):
        """A finished sample's routes: one per position but the last, the prompt's and every token's (a continued
        sample's prompt holds its tokens before the pause: their routes are the continuation's re-prefill)."""
        routes = self._take_routes(rid)
        want = len(rec.prompt_ids) + len(rec.tokens[j]) - 1
        if routes.shape[0] != want:
            self._broken = f"routes of group {rec.key} sample {j}: {routes.shape[0]} positions, expected {want}"
            raise RuntimeError(
                f"vLLM engine for model {self.model_path!r}: captured routes for {routes.shape[0]} positions of group "
                f"{rec.key} sample {j}, expected {want} (prompt + tokens - 1): is prefix caching on?"
            )
        return routes

    def in_flight(self) -> int:
        """Groups submitted and neither returned by step() nor aborted."""
        return len(self._groups)

    def unfinished(self) -> int:
        """Samples of the groups in flight still generating or queued (see StreamingEngine.unfinished)."""
        return len(self._sample_of)

    def _decoded(self, recs: list[_StreamGroup]) -> list[tuple[int, list[Response]]]:
        """[(key, Responses)] of these groups, their text from one batched decode of all their samples."""
        if not recs:
            return []
        flat = [toks for rec in recs for toks in rec.tokens]
        texts = self.llm.get_tokenizer().batch_decode(flat, skip_special_tokens=True)
        out, i = [], 0
        for rec in recs:
            out.append((rec.key, rec.responses(texts[i : i + rec.n])))
            i += rec.n
        return out

    def _retag_in_flight(self, version: int) -> None:
        """Tokens the groups in flight sample from now on are tagged `version` (the weights just applied)."""
        for rec in self._groups.values():
            rec.version = version

    def _refuse_while_streaming(self, what: str) -> None:
        if self._groups and not self._updating_in_flight:
            raise RuntimeError(
                f"{what} refused: {len(self._groups)} streamed groups are in flight (keys "
                f"{list(self._groups)[:8]}); abort() them (or let step() finish them) first"
            )
