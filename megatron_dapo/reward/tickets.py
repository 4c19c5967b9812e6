"""The reward pool's parent-side records: a Ticket per submit() call and the RewardBatch it becomes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

_EXCERPT_CHARS = 80

Key = tuple[int, int]
"""(ticket, index of the response in its ticket): how the parent names a response to the workers and back."""


@dataclass
class RewardBatch:
    """Scores of one score() call or ticket; every list has one entry per response, in input order."""

    scores: list[float]
    """+1.0 correct, -1.0 otherwise (also for 'timeout' and 'error')."""
    acc: list[bool]
    """Raw correctness."""
    preds: list[str | None]
    """The extracted answers (None when none was found or scoring failed)."""
    status: list[str]
    """'ok' | 'timeout' | 'error'."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/timeouts, reward/errors (counts in this call or ticket), reward/seconds (from submit to the
    last result), reward/responses_per_s, reward/accuracy, reward/score_mean, reward/worker_restarts
    (see RewardPool.submit for which ticket a restart is counted in)."""


class Ticket:
    """One submit() call: its responses, its results so far and what its metrics need."""

    def __init__(self, ticket_id: int, n: int) -> None:
        self.id = ticket_id
        self.scores = [-1.0] * n
        self.acc = [False] * n
        self.preds: list[str | None] = [None] * n
        self.status = [""] * n
        self.pending = n
        """Indices without a result yet."""
        self.tasks: dict[int, tuple[str, str, str]] = {}
        """index -> (text, gold, source) of the responses that go to the workers, in index order."""
        self.restarts = 0
        self.submitted_at = time.monotonic()
        self.done_at = self.submitted_at if n == 0 else 0.0
        """When the last result came in (reward/seconds ends there, not when result() collects it)."""

    def set(self, idx: int, score: float, acc: bool, pred: str | None, status: str) -> None:
        if self.status[idx] == "":
            self.pending -= 1
            if self.pending == 0:
                self.done_at = time.monotonic()
        self.scores[idx], self.acc[idx], self.preds[idx], self.status[idx] = score, acc, pred, status

    def batch(self) -> RewardBatch:
        """The results as a RewardBatch (input order) with this ticket's metrics."""
        n = len(self.scores)
        seconds = self.done_at - self.submitted_at
        metrics = {
            "reward/timeouts": float(self.status.count("timeout")),
            "reward/errors": float(self.status.count("error")),
            "reward/seconds": seconds,
            "reward/responses_per_s": n / seconds if seconds > 0 else 0.0,
            "reward/accuracy": sum(self.acc) / n if n else 0.0,
            "reward/score_mean": sum(self.scores) / n if n else 0.0,
            "reward/worker_restarts": float(self.restarts),
        }
        return RewardBatch(scores=self.scores, acc=self.acc, preds=self.preds, status=self.status, metrics=metrics)


def excerpt(response: Any) -> str:
    # repr() escapes lone surrogates and control characters, so logging never fails on them.
    return (
        f"{response[:_EXCERPT_CHARS]!r} ({len(response)} chars)"
        if isinstance(response, (str, bytes))
        else repr(response)[:_EXCERPT_CHARS]
    )


def as_text(response: Any, gold: Any, source: Any) -> tuple[str, str]:
    """(text, problem): the response as str, or a description of why it cannot be scored."""
    if not isinstance(gold, str) or not isinstance(source, str):
        return "", f"ground truth and data source must be str, got {type(gold).__name__} and {type(source).__name__}"
    if isinstance(response, bytes):
        try:
            return response.decode("utf-8", errors="strict"), ""
        except UnicodeDecodeError as e:
            return "", f"invalid UTF-8 ({e.reason} at byte {e.start})"
    if isinstance(response, str):
        return response, ""
    return "", f"response must be str or bytes, got {type(response).__name__}"
