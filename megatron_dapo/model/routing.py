"""Mixture-of-experts routing in the trainer: the experts each router picks, routes replayed from elsewhere (R2, R3),
and what the step logs about them.

A sample's routes are [positions, moe layers, top k] small integers (`route_dtype`): for position t and MoE layer l,
the experts the token at position t went to. Positions 0 .. prompt + response - 2: the last token is never fed to a
model that samples (it predicts nothing), so neither vLLM nor the trainer's recording has a route for it; collate
gives it `placeholder_routes`, outside every count. `model.router_replay`:

- 'r3': the rollout engine's routes, carried with the sample, replayed in the old-logprob, reference and train
  forwards;
- 'r2': the old-logprob pass records its own routes (`MegatronPolicy.compute_logprobs(record_routes=True)`), the
  train step replays them;
- 'none': every forward routes by itself.

Each MoE layer's Megatron router gets a `LayerRouting` as its `router_replay` (Megatron's top-k hook: it returns the
experts the router uses) and around its `gating` (which sees the logits), driven per micro-batch by `Routing.feed`
with rows in Megatron's order: the micro-batch's [b, L] positions flattened sequence-major ([L, b] -> L * b rows),
after context parallel's split (micro-batches arrive split) and sequence parallel's (this TP rank's L / tp of
them). Megatron's own RouterReplay keeps one process-wide list of routers with one action for all, which would drive a
KL run's reference model too; here each policy drives only its own. With full activation recompute a layer's forward
runs again inside backward: the routes a forward replayed are queued per layer and the recompute takes them in
order (backward runs micro-batches in the order their forwards ran).

Metrics (`Routing.metrics`, over the valid positions of a pass, summed over micro-batches and data-parallel ranks):
moe/router_agreement, the share of (token, layer) pairs whose replayed top-k set equals the one the trainer's own
router logits would pick; moe/load_balancing_loss, Switch's E * sum_i f_i P_i per layer (f_i the share of routed
slots to expert i, P_i its mean router probability), moe/z_loss (mean squared logsumexp of the router logits) and
moe/load_imbalance (the busiest expert's tokens over the mean, 1 = balanced), each the mean over layers, plus the
imbalance of each layer.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.comm import Comm

MODES = ("off", "record", "replay")
"""A pass's routing: each router's own, its own recorded, or given routes replayed."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds an expert index: 1 byte a route up to 256 experts, else 2."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def placeholder_routes(n: int, layers: int, topk: int) -> torch.Tensor:
    """[n, layers, topk] long: experts 0..k-1 for positions with no route (row padding, a sequence's last token).
    Distinct experts, so the dispatcher sees a well-formed routing map; what they compute is never read."""
    return torch.arange(topk).expand(n, layers, topk).clone()


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recompute re-runs forwards inside it)."""
    return torch._C._current_graph_task_id() != -1


class LayerRouting:
    """One MoE layer's router as the trainer drives it (see the module docstring)."""

    def __init__(self, router, moe_index: int, num_experts: int, topk: int) -> None:
        self.moe_index, self.num_experts, self.topk = moe_index, num_experts, topk
        self.mode = "off"
        self.target: Optional[torch.Tensor] = None
        """[N, k] long: the routes the next forward replays."""
        self.valid: Optional[torch.Tensor] = None
        """[N] bool: the next forward's rows that are real tokens (counted in the metrics)."""
        self.given: Optional[torch.Tensor] = None
        """[N] bool: the rows whose routes were given (the agreement is counted over these)."""
        self.recompute = False
        """Full activation recompute: a training pass runs each forward again inside backward."""
        self.keep_for_backward = False
        """This pass has a backward that recomputes: each forward's routes are queued for it."""
        self.backward: deque[torch.Tensor] = deque()
        self.recorded: list[torch.Tensor] = []
        """[N, k] per forward of a recording pass, in forward order: on the host in the route dtype (a pass of many
        micro-batches would otherwise keep every one's int64 indices on the device)."""
        self.stats = torch.zeros(3 + 2 * num_experts, dtype=torch.float64)
        """Over a pass: rows, rows in agreement, z (sum of logsumexp^2), probabilities summed per expert [E], tokens
        routed to each expert [E]. Rows counts the valid rows; agreement only replayed forwards' given rows."""
        self.agreement_rows = 0.0
        gating = router.gating
        router.gating = lambda inp: self._observe(gating(inp))
        router.router_replay = self

    def _observe(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's logits [S, B, E] or [N, E] pass through; their z and probabilities are summed over the valid
        rows of a forward (not of its recompute)."""
        if not _in_backward() and self.valid is not None:
            with torch.no_grad():
                flat = logits.detach().reshape(-1, self.num_experts)[self.valid].double()
                lse = torch.logsumexp(flat, dim=-1)
                self.stats[0] += flat.shape[0]
                self.stats[2] += float((lse**2).sum())
                self.stats[3 : 3 + self.num_experts] += torch.softmax(flat, dim=-1).sum(0).cpu()
        return logits

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's top-k hook (moe_utils.topk_routing_with_score_function): (the scores of the chosen experts
        [N, k], their indices [N, k]) from the router's own top k, or from the replayed routes."""
        if self.mode == "replay":
            if _in_backward():
                target = self.backward.popleft()
            else:
                target = self.target
                if self.keep_for_backward:  # (the checkpointed forward itself runs without grad)
                    self.backward.append(target)
                self._count(scores, target, default_compute_topk(scores, topk, num_groups, group_topk)[1])
            return scores.gather(1, target), target
        probs, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
        if not _in_backward():
            if self.mode == "record":
                self.recorded.append(chosen.detach().to("cpu", route_dtype(self.num_experts)))
            self._count(scores, chosen, None)
        return probs, chosen

    def _count(self, scores: torch.Tensor, used: torch.Tensor, own: Optional[torch.Tensor]) -> None:
        """Tokens per expert from the routes used; with own (the router's own pick), the rows in agreement."""
        if self.valid is None:
            return
        with torch.no_grad():
            rows = used.detach()[self.valid]
            self.stats[3 + self.num_experts :] += torch.bincount(
                rows.reshape(-1).cpu(), minlength=self.num_experts
            ).double()
            if own is not None and self.given is not None:
                keep = self.given[self.valid]
                same = (rows.sort(-1).values == own.detach()[self.valid].sort(-1).values).all(-1)
                self.stats[1] += float((same & keep).sum())
                self.agreement_rows += float(keep.sum())


class Routing:
    """Every MoE router of one policy's model chunks (this rank's pipeline stages), driven per pass and
    micro-batch."""

    def __init__(self, chunks: list, arch: ModelArch, comm: Comm, recompute: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.arch, self.comm, self.layout = arch, comm, comm.layout
        self.layers: dict[int, list[LayerRouting]] = {}
        """id(chunk) -> its MoE layers' LayerRouting (the chunk as the schedule hands it to forward_step)."""
        for chunk in chunks:
            mine = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = LayerRouting(
                        module, arch.moe_index(module.layer_number - 1), arch.num_experts, arch.num_experts_per_tok
                    )
                    layer.recompute = recompute
                    mine.append(layer)
            self.layers[id(chunk)] = mine

    def all_layers(self) -> list[LayerRouting]:
        return [layer for layers in self.layers.values() for layer in layers]

    def start_pass(self, mode: str, backward: bool) -> None:
        """Before a pass of the schedule (backward: a training pass): every router in `mode`, its queues and counts
        empty."""
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r}: expected one of {MODES}")
        for layer in self.all_layers():
            layer.mode = mode
            layer.keep_for_backward = backward and layer.recompute
            layer.target = layer.valid = layer.given = None
            layer.backward.clear()
            layer.recorded = []
            layer.stats.zero_()
            layer.agreement_rows = 0.0

    def feed(self, chunk, mb) -> None:
        """Before `chunk`'s forward of micro-batch mb: each router's rows of mb (Megatron's order, this rank's
        share) and, when replaying, its routes."""
        layers = self.layers.get(id(chunk), [])
        if not layers:
            return
        valid = self._rows(mb.token_mask)
        given = self._rows(mb.route_mask) if mb.route_mask is not None else None
        for layer in layers:
            layer.valid, layer.given = valid, given
            if layer.mode == "replay":
                if mb.routes is None:
                    raise ValueError("routing replay: a micro-batch of the replayed pass has no routes")
                layer.target = self._rows(mb.routes[:, :, layer.moe_index]).long()

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """[b, L, ...] per position -> [rows, ...] in the router's order: sequence-major, and under sequence
        parallel this tensor-parallel rank's contiguous L / tp positions."""
        rows = t.transpose(0, 1)
        if self.layout.sequence_parallel:
            share = rows.shape[0] // self.layout.tp
            rows = rows[self.layout.tp_rank * share : (self.layout.tp_rank + 1) * share]
        return rows.reshape(-1, *t.shape[2:]).to(self.layout.device)

    def recorded_routes(self, forward: int, mb) -> torch.Tensor:
        """The routes this rank's routers recorded in forward number `forward` of the pass (micro-batch mb), as
        [b, L, moe layers, k] long over mb's rows; the layers of other pipeline stages hold placeholders. Under
        sequence parallel the TP ranks' shares are gathered; under context parallel the positions stay this rank's
        (mb is its share)."""
        b, length = mb.tokens.shape
        k = self.arch.num_experts_per_tok
        out = placeholder_routes(b * length, len(self.arch.moe_layers), k).view(b, length, -1, k)
        for layer in self.all_layers():
            rows = layer.recorded[forward]
            if self.layout.sequence_parallel:
                rows = rows.to(self.layout.device, torch.int64)  # NCCL takes no uint8 on every build
                rows = torch.cat(self.comm.all_gather(rows, "tp"))
            out[:, :, layer.moe_index] = rows.view(length, b, k).transpose(0, 1).cpu().long()
        return out

    def metrics(self) -> dict[str, float]:
        """The pass's routing metrics (module docstring): collective over the world (each MoE layer's counts summed
        over the ranks that route different tokens: data and context parallel, and tensor parallel under sequence
        parallel; pipeline stages each add their own layers). Identical on every rank."""
        arch, n = self.arch, self.arch.num_experts
        stats = torch.zeros(len(arch.moe_layers), 4 + 2 * n, dtype=torch.float64)
        for layer in self.all_layers():
            stats[layer.moe_index, :-1] += layer.stats
            stats[layer.moe_index, -1] += layer.agreement_rows
        # TP ranks saw the same rows unless sequence parallel split them; a virtual stage's layers are one chunk's
        copies = () if self.layout.sequence_parallel else ("tp",)
        stats = self.comm.count_once(stats.to(self.layout.device), copies).cpu()
        rows, agree, z = stats[:, 0], stats[:, 1], stats[:, 2]
        probs, tokens, given = stats[:, 3 : 3 + n], stats[:, 3 + n : 3 + 2 * n], stats[:, -1]
        if float(rows.sum()) == 0:
            return {}
        k = arch.num_experts_per_tok
        f = tokens / (rows[:, None] * k).clamp(min=1)
        p = probs / rows[:, None].clamp(min=1)
        imbalance = tokens.max(-1).values / (tokens.sum(-1) / n).clamp(min=1e-12)
        out = {
            "moe/load_balancing_loss": float((n * (f * p).sum(-1)).mean()),
            "moe/z_loss": float((z / rows.clamp(min=1)).mean()),
            "moe/load_imbalance": float(imbalance.mean()),
        }
        for i, layer in enumerate(arch.moe_layers):
            out[f"moe/load_imbalance/layer{layer}"] = float(imbalance[i])
        if float(given.sum()) > 0:
            out["moe/router_agreement"] = float(agree.sum() / given.sum())
        return out
