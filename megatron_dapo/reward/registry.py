"""The verifier registry: the config's reward.verifier -> a (response, ground_truth) -> VerifyResult function.

Built-in names (choices.VERIFIER_NAMES): 'dapo' and 'math_verify' (verifiers.py), 'hybrid' (hybrid.py), 'auto'
(hybrid for DAPO data, else math_verify); anything 'package.module:function' is a user verifier, imported once.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

from megatron_dapo.choices import VERIFIER_NAMES
from megatron_dapo.reward.answers import Verifier, VerifyResult, verify_result
from megatron_dapo.reward.hybrid import hybrid_verify
from megatron_dapo.reward.verifiers import dapo_verify, math_verify_verify


def _coerce_user_result(value: Any) -> VerifyResult:
    """A user verifier's VerifyResult | bool | float -> VerifyResult (acc = score > 0 for numbers)."""
    if isinstance(value, VerifyResult):
        score = float(value.score)
        acc, pred = bool(value.acc), value.pred
    elif isinstance(value, bool):
        return verify_result(value, None)
    elif isinstance(value, (int, float)):
        score = float(value)
        acc, pred = score > 0, None
    else:
        raise TypeError(f"a verifier must return VerifyResult, bool or float, got {type(value).__name__}")
    if not math.isfinite(score):
        raise ValueError(f"verifier returned a non-finite score {score}")
    return VerifyResult(score=score, acc=acc, pred=None if pred is None else str(pred))


def _bad_verifier(configured: str, problem: str) -> ValueError:
    return ValueError(
        f"config field reward.verifier={configured!r}: {problem}; expected one of {VERIFIER_NAMES} "
        "or a user function 'package.module:function'"
    )


@functools.lru_cache(maxsize=None)
def _load_user_verifier(configured: str) -> Verifier:
    """'package.module:function' -> a wrapped callable returning VerifyResult. Raises ValueError."""
    module_name, _, attr = configured.partition(":")
    if not module_name or not attr:
        raise _bad_verifier(configured, "a user function needs both a module and a function name")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config problem to report
        raise _bad_verifier(configured, f"cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise _bad_verifier(configured, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise _bad_verifier(configured, f"{attr!r} in module {module_name!r} is not callable")

    @functools.wraps(fn)
    def user_verifier(response: str, ground_truth: str) -> VerifyResult:
        return _coerce_user_result(fn(response, ground_truth))

    return user_verifier


def select_verifier(data_source: str, configured: str, *, math_verify_timeout_s: float | None = 5.0) -> Verifier:
    """The verifier for one row: (response, ground_truth) -> VerifyResult.

    configured: reward.verifier, i.e. 'dapo', 'math_verify', 'hybrid', 'auto' (hybrid when 'dapo'
    is in data_source, e.g. DAPO-Math-17K's 'math_dapo', else math_verify) or 'package.module:function'.
    math_verify_timeout_s: passed to math_verify_verify and hybrid_verify (None when the caller
    bounds time itself).
    Raises ValueError naming reward.verifier for an unknown name or an unimportable function.
    """
    if configured == "auto":
        configured = "hybrid" if "dapo" in (data_source or "").lower() else "math_verify"
    if configured == "dapo":
        return dapo_verify
    if configured == "math_verify":
        return functools.partial(math_verify_verify, timeout_s=math_verify_timeout_s)
    if configured == "hybrid":
        return functools.partial(hybrid_verify, timeout_s=math_verify_timeout_s)
    if ":" in configured:
        return _load_user_verifier(configured)
    raise _bad_verifier(configured, "unknown verifier name")
