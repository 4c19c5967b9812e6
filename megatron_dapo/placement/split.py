"""Which train rank trains which response of a batch: the trainer's share of each mini-batch, and where the rollout
side sends each response (exchange.deliver colocated; the rollout controller's per-rank replies asynchronous)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.records import GroupMeta


def minibatch_ids(batch: list[GroupMeta], mini_batch_size: int, dp: int, dp_rank: int) -> list[list[SampleId]]:
    """The (key, j) of every response data-parallel rank dp_rank trains, per mini-batch.

    Responses are taken in batch order (group by group, sample by sample); each mini-batch of
    mini_batch_size is split into dp equal contiguous shares (check_distributed guarantees they are equal).
    """
    flat = [(g.key, j) for g in batch for j in range(len(g.lengths))]
    slices = []
    for start in range(0, len(flat), mini_batch_size):
        part = flat[start : start + mini_batch_size]
        share = len(part) // dp
        slices.append(part[dp_rank * share : (dp_rank + 1) * share])
    return slices


@dataclass(frozen=True)
class TrainSplit:
    """minibatch_ids for every train rank: dp_rank_of[r] is train rank r's data-parallel rank (its TP, PP and CP
    peers train the same share)."""

    mini_batch_size: int
    dp: int
    dp_rank_of: tuple[int, ...]

    def minibatches(self, batch: list[GroupMeta], dp_rank: int) -> list[list[SampleId]]:
        """The ids data-parallel rank dp_rank trains, per mini-batch."""
        return minibatch_ids(batch, self.mini_batch_size, self.dp, dp_rank)

    def wanted_by(self, batch: list[GroupMeta]) -> Callable[[int], list[SampleId]]:
        """train rank -> the ids it trains, flat, in training order."""
        per_dp = {d: [sid for mb in self.minibatches(batch, d) for sid in mb] for d in range(self.dp)}
        return lambda rank: per_dp[self.dp_rank_of[rank]]
