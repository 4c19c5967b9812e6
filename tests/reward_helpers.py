"""User verifiers for tests/test_reward.py, test_sampler_runs.py and test_trainer.py, imported by name
('reward_helpers:...') in the pool's workers."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from megatron_dapo.reward.answers import VerifyResult


def exact(response: str, ground_truth: str) -> bool:
    """Correct when the stripped response equals the stripped gold."""
    return response.strip() == ground_truth.strip()


def one_in_four(response: str, ground_truth: str) -> bool:
    """Right for a quarter of all texts, by their hash: informative groups from a model that knows nothing."""
    return hashlib.sha1(response.encode()).digest()[0] % 4 == 0


def half_credit(response: str, ground_truth: str) -> float:
    """A float score: 0.5 whatever the response."""
    return 0.5


def gold_as_score(response: str, ground_truth: str) -> float:
    """A float score: the ground truth read as a number (a 0/1 reward's 0.0 is a wrong answer)."""
    return float(ground_truth)


def as_result(response: str, ground_truth: str) -> VerifyResult:
    """A full VerifyResult whose pred is the response's length."""
    return VerifyResult(score=1.0, acc=True, pred=str(len(response)))


def sleepy(response: str, ground_truth: str) -> bool:
    """Sleeps forever on 'sleep', else exact match."""
    if response == "sleep":
        time.sleep(10_000)
    return exact(response, ground_truth)


def busy_c(response: str, ground_truth: str) -> bool:
    """One C call that never checks signals on 'burn' (~minutes, so only SIGKILL stops it), else exact match."""
    if response == "burn":
        return hashlib.pbkdf2_hmac("sha256", b"p", b"s", 10**9).hex() == ground_truth
    return exact(response, ground_truth)


def crashy(response: str, ground_truth: str) -> bool:
    """Kills its own process on 'crash', else exact match."""
    if response == "crash":
        os._exit(1)
    return exact(response, ground_truth)


def hungry(response: str, ground_truth: str) -> bool:
    """Allocates 8 GiB on 'eat' (over the worker's memory limit), else exact match."""
    if response == "eat":
        return len(bytearray(8 * 2**30)) > 0
    return exact(response, ground_truth)


def raises(response: str, ground_truth: str) -> bool:
    """Raises on 'boom', else exact match."""
    if response == "boom":
        raise ZeroDivisionError("boom")
    return exact(response, ground_truth)


def nan_score(response: str, ground_truth: str) -> float:
    """A non-finite score, which the pool must reject as an error."""
    return float("nan")


def torch_loaded(response: str, ground_truth: str) -> bool:
    """True when torch was imported into this (worker) process."""
    return "torch" in sys.modules


def misbehave(response: str, ground_truth: str) -> bool:
    """Misbehaves on a keyword ('sleep', 'burn', 'crash', 'eat', 'boom'), else exact match."""
    for verifier in (sleepy, busy_c, crashy, hungry, raises):
        verifier(response, "")  # each acts only on its own keyword
    return exact(response, ground_truth)


def __getattr__(name: str):
    # 'reward_helpers:parent_only' exists in the test process but not in a spawned worker: a start failure.
    if name == "parent_only" and multiprocessing.parent_process() is None:
        return exact
    # 'reward_helpers:holds_start_up': the trainer's start-up stops where its reward pool loads the verifier (the
    # policy and the engine up); it writes the file $HELD_IN_START_UP names, then only a signal ends the process.
    if name == "holds_start_up":
        Path(os.environ["HELD_IN_START_UP"]).write_text(f"{os.getpid()}\n")
        while True:
            signal.pause()
    raise AttributeError(name)
