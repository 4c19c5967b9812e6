"""Rule-based answer verifiers: pure functions from (response, ground_truth) to a VerifyResult.

- ``dapo_verify``: the DAPO-Math-17K rule. The last ``Answer: ...`` in the response is
  normalised (in the spirit of Minerva's ``normalize_final_answer``) and compared with the
  normalised gold as strings, or as numbers when both are plain numbers.
- ``math_verify_verify``: Hugging Face math-verify 0.9.0 (LaTeX / boxed answers), with
  GSM8K-style ``#### N`` golds and responses.

The hybrid verifier (the default for DAPO data) is hybrid.py; registry.py maps the config's reward.verifier to
one of them. The text primitives they share are answers.py's.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from megatron_dapo.reward.answers import (
    VerifyResult,
    alarm_seconds,
    extract_dapo_answer,
    gsm8k_answer,
    normalize_answer,
    numbers_equal,
    verify_result,
)

# A prompt's G responses share one gold: normalise it once.
_normalize_gold = functools.lru_cache(maxsize=4096)(normalize_answer)


def dapo_verify(response: str, ground_truth: str) -> VerifyResult:
    """DAPO-Math-17K: +1 when the last 'Answer: X' line's X equals the gold after normalisation.

    response: the decoded model output; ground_truth: the reference answer (e.g. '34').
    Returns VerifyResult(score ±1, acc, pred=normalised X or None when no 'Answer:' line).
    """
    raw = extract_dapo_answer(response)
    if raw is None:
        return verify_result(False, None)
    pred = normalize_answer(raw)
    gold = _normalize_gold(ground_truth)
    correct = bool(pred) and (pred == gold or numbers_equal(pred, gold))
    return verify_result(correct, pred)


# --------------------------------------------------------------------------- math-verify

_GSM8K_ANSWER_RE = re.compile(r"####[ \t]*\$?[ \t]*([+-]?\d[\d,]*(?:\.\d+)?)")


def _gsm8k_prediction(response: str) -> str | None:
    """The number after the last '#### ' in a response, commas removed, or None."""
    last = None
    for match in _GSM8K_ANSWER_RE.finditer(response):
        last = match
    return last.group(1).replace(",", "") if last else None


def _first_string(parsed: list[Any]) -> str | None:
    # parse() returns [sympy_expr, matched_text]; str() of a huge sympy expression can hang, the text cannot.
    for item in parsed:
        if isinstance(item, str):
            return item
    return None


def math_verify_verify(response: str, ground_truth: str, timeout_s: float | None = 5.0) -> VerifyResult:
    """Verify with math-verify 0.9.0: +1 when the response's answer is mathematically equal to the gold.

    Gold: LaTeX, a bare expression ('0.5', '\\frac{1}{2}') or GSM8K ('... #### 1,234' -> '1234');
    an empty (or whitespace) gold scores every response wrong.
    Prediction: the number after the response's last '#### ' when present, else what
    math-verify extracts (the last \\boxed{}, else the last LaTeX / plain expression).
    timeout_s: math-verify's own SIGALRM limit per parse/compare (rounded up to whole seconds;
    only works in a process's main thread); None disables it, the caller then bounds time.
    Raises ValueError when math-verify cannot parse a non-empty gold.
    """
    from math_verify import parse, verify  # sympy takes ~1 s to import: only scoring processes pay it

    secs = alarm_seconds(timeout_s)
    gsm8k_pred = _gsm8k_prediction(response)
    pred = parse(gsm8k_pred if gsm8k_pred is not None else response, parsing_timeout=secs)
    gold_text = gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth.strip()
    if not gold_text:
        return verify_result(False, _first_string(pred))
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"  # math-verify's LaTeX extractor needs a delimiter
    gold = parse(gold_text, parsing_timeout=secs)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth[:200]!r}")
    if not pred:
        return verify_result(False, None)
    correct = verify(gold, pred, timeout_seconds=secs)
    return verify_result(bool(correct), _first_string(pred))
