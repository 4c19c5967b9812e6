"""Reward verifiers (DAPO 'Answer:' and math-verify) and the process pool's limits and isolation."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# pytest puts tests/ on sys.path and spawned pool workers inherit it: they import tests/reward_helpers.py.
from megatron_dapo.config import RewardConfig  # noqa: E402
from megatron_dapo.reward import (  # noqa: E402
    RewardBatch,
    RewardPool,
    VerifyResult,
    dapo_verify,
    hybrid_verify,
    math_verify_verify,
    select_verifier,
)

HUGE = 1_000_000
"""Characters in a huge response. A linear verifier takes well under a second on it; a quadratic one (a regex that
backtracks, a loop that rescans) takes ~1e12 steps, hours at the ~1e8 steps a second of Python's regex engine, and
so runs into pytest-timeout's hang guard (900 s) instead of passing."""


# --------------------------------------------------------------------------- verifiers the pool's workers load
# by name ('test_reward:...'): pytest puts tests/ on sys.path and spawned workers inherit it


def whoami(response: str, ground_truth: str) -> VerifyResult:
    """Right whatever the response; pred: the pid of the worker process that scored it."""
    return VerifyResult(1.0, True, str(os.getpid()))


def alarm_left(response: str, ground_truth: str) -> VerifyResult:
    """Right whatever the response; pred: the seconds left on this process's SIGALRM timer (the soft limit)."""
    return VerifyResult(1.0, True, repr(signal.getitimer(signal.ITIMER_REAL)[0]))


# --------------------------------------------------------------------------- dapo_verify


def test_dapo_correct_and_wrong():
    assert dapo_verify("Let me think... 6 * 7 = 42.\nAnswer: 42", "42") == VerifyResult(1.0, True, "42")
    assert dapo_verify("Let me think... 6 * 7 = 41.\nAnswer: 41", "42") == VerifyResult(-1.0, False, "41")


def test_dapo_without_answer_line_is_wrong_with_no_pred():
    assert dapo_verify("The result is \\boxed{42}.", "42") == VerifyResult(-1.0, False, None)
    assert dapo_verify("", "42") == VerifyResult(-1.0, False, None)


def test_dapo_last_answer_wins_and_is_case_insensitive():
    assert dapo_verify("Answer: 41\nwait, I made a mistake.\nANSWER : 42", "42").acc
    assert not dapo_verify("answer: 42\nno...\nAnswer: 41", "42").acc
    assert dapo_verify("Final answer: 41. Actually, the answer: 42", "42").pred == "42"
    assert dapo_verify("Answer:\n\n  42", "42").pred == "42"  # the answer on the next line


def test_dapo_answer_far_from_the_end():
    many_colons = "Answer: 42\n" + "".join(f"note {i}: ok\n" for i in range(500))
    assert dapo_verify(many_colons, "42").pred == "42"
    assert dapo_verify("Answer" + " " * 500 + ":  42\n" + "x: y\n" * 3, "42").pred == "42"
    assert dapo_verify("x: 1\n" * 100 + "no final line", "42").pred is None


@pytest.mark.parametrize(
    "answer_line, gold",
    [
        ("Answer: $42$", "42"),
        ("Answer: \\boxed{42}", "42"),
        ("Answer: $\\boxed{42}$.", "42"),
        ("**Answer:** 42", "42"),
        ("Answer: 1,000", "1000"),
        ("Answer: 1,234,567", "1234567"),
        ("Answer: 90 degrees", "90"),
        ("Answer: 90^\\circ", "90"),
        ("Answer: 12 \\text{ cm}^2", "12"),
        ("Answer: 15 dollars", "15"),
        ("Answer: \\$15", "15"),
        ("Answer: 25\\%", "25"),
        ("Answer: x = 7", "7"),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),
        ("Answer: \\tfrac12", "\\frac{1}{2}"),
        ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
        ("Answer: \\text{(B)}", "(B)"),
        ("Answer: 2 \\times 3", "2\\times3"),
        ("Answer: \\left( 1, 2 \\right)", "(1,2)"),
        ("Answer: −5", "-5"),
        ("Answer: 42.", "42"),
    ],
)
def test_dapo_normalisation(answer_line, gold):
    assert dapo_verify(f"Some reasoning.\n{answer_line}", gold).acc


@pytest.mark.parametrize("pred, gold", [("5.0", "5"), ("5", "5.00"), ("0.50", ".5"), ("+3", "3"), ("1e3", "1000")])
def test_dapo_numeric_equality(pred, gold):
    assert dapo_verify(f"Answer: {pred}", gold).acc


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("12345678901234567891", "12345678901234567890"),  # equal as floats, not as numbers
        ("1,2,3", "123"),  # a list, not a thousands separator
        ("5cm", "50"),
        ("", "0"),
        ("\\frac{1}{2}", "0.5"),  # DAPO compares strings; math-verify is the symbolic one
        ("420", "42"),  # the gold followed by more characters
        ("42abc", "42"),
        ("4.25", "4.2"),
    ],
)
def test_dapo_near_misses_are_wrong(pred, gold):
    assert not dapo_verify(f"Answer: {pred}", gold).acc


HUGE_RESPONSES = {
    "answer_words": lambda: "answer " * (HUGE // 7),
    "digits_then_letter": lambda: "Answer: " + "1" * HUGE + "x",
    "commas": lambda: "Answer: " + "1," * (HUGE // 2),
    "open_boxes": lambda: "Answer: " + "\\boxed{" * (HUGE // 7),
    "nested_text": lambda: "Answer: " + "\\text{" * (HUGE // 12) + "}" * (HUGE // 12),
    "nested_braces": lambda: "Answer: " + "{" * (HUGE // 2) + "}" * (HUGE // 2),
    "spaces": lambda: "Answer:" + " " * HUGE,
    "spaces_before_colon": lambda: "Answer" + " " * HUGE + ":",
}


@pytest.mark.parametrize("name", HUGE_RESPONSES)
def test_dapo_is_linear_on_huge_inputs(name):
    # no clock: a quadratic verifier would not finish before the hang guard (HUGE)
    assert dapo_verify(HUGE_RESPONSES[name](), "5").score == -1.0


def test_dapo_is_linear_on_huge_random_text(seed):
    # 'answer', colons, braces and digits at random; no 9 anywhere, so no answer in it can equal the gold 9
    rng = random.Random(seed)
    text = "".join(rng.choices("ab{}\\$ :=\n012345678,.answerAnswer", k=HUGE))
    assert dapo_verify(text, "9").score == -1.0


# --------------------------------------------------------------------------- math_verify_verify


def test_math_verify_boxed_fraction_equals_decimal_gold():
    # The one in-process call with math-verify's own SIGALRM limit (the others pass None: an alarm here
    # would cancel pytest-timeout's in signal mode).
    result = math_verify_verify("So the probability is \\boxed{\\frac{1}{2}}.", "0.5", timeout_s=5)
    assert result.acc and result.score == 1.0 and result.pred == "\\frac{1}{2}"


def test_math_verify_gsm8k_gold():
    gold = "She buys 1,000 + 234 = 1,234 apples.\n#### 1,234"
    assert math_verify_verify("1000 + 234 = 1234\n#### 1234", gold, timeout_s=None) == VerifyResult(1.0, True, "1234")
    assert math_verify_verify("1000 + 234 = 1234\n#### 1,234", gold, timeout_s=None).acc
    assert math_verify_verify("So she has \\boxed{1234} apples.", gold, timeout_s=None).acc
    assert not math_verify_verify("#### 1235", gold, timeout_s=None).acc
    assert not math_verify_verify("So she has \\boxed{1243} apples.", gold, timeout_s=None).acc


def test_math_verify_wrong_and_missing_answers():
    wrong = math_verify_verify("\\boxed{\\frac{1}{3}}", "0.5", timeout_s=None)
    assert wrong == VerifyResult(-1.0, False, "\\frac{1}{3}")
    assert math_verify_verify("I do not know.", "0.5", timeout_s=None) == VerifyResult(-1.0, False, None)


def test_math_verify_compares_the_prediction_to_the_gold_not_the_reverse():
    # math-verify is asymmetric: a number prediction of an equation gold is wrong, an equation prediction of a
    # number gold with that right-hand side is right (verify(gold, pred); swapped, both flip)
    assert not math_verify_verify("so \\boxed{4}", "x^2+y^2=4", timeout_s=None).acc
    assert math_verify_verify("so \\boxed{x^2+y^2=4}", "x^2+y^2=4", timeout_s=None).acc
    assert math_verify_verify("so \\boxed{x^2+y^2=4}", "4", timeout_s=None).acc


def test_math_verify_latex_golds_and_no_timeout():
    assert math_verify_verify("$\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}", timeout_s=None).acc
    assert math_verify_verify("the point is \\boxed{(1,2)}", "(1, 2)", timeout_s=None).acc
    assert not math_verify_verify("the point is \\boxed{(2,1)}", "(1, 2)", timeout_s=None).acc


# --------------------------------------------------------------------------- select_verifier


def test_select_verifier_builtin_names():
    assert select_verifier("math_dapo", "auto").func is hybrid_verify
    assert select_verifier("anything", "dapo") is dapo_verify
    # auto on a non-DAPO source is math-verify: a boxed answer counts, an 'Answer:' line alone need not
    gsm8k = select_verifier("openai/gsm8k", "auto")
    assert gsm8k("\\boxed{0.5}", "\\frac{1}{2}").acc
    assert select_verifier("math_dapo", "math_verify")("\\boxed{0.5}", "\\frac{1}{2}").acc


def test_select_verifier_user_functions():
    assert select_verifier("x", "reward_helpers:exact")("7", "7") == VerifyResult(1.0, True, None)
    assert select_verifier("x", "reward_helpers:exact")("7", "8") == VerifyResult(-1.0, False, None)
    assert select_verifier("x", "reward_helpers:half_credit")("7", "8") == VerifyResult(0.5, True, None)
    assert select_verifier("x", "reward_helpers:as_result")("abc", "8") == VerifyResult(1.0, True, "3")


@pytest.mark.parametrize(
    "configured, mentions",
    [
        ("bogus", "unknown verifier name"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("reward_helpers:no_such_function", "has no attribute 'no_such_function'"),
        ("reward_helpers:", "needs both a module and a function name"),
    ],
)
def test_select_verifier_bad_config(configured, mentions):
    with pytest.raises(ValueError, match="reward.verifier") as info:
        select_verifier("x", configured)
    assert mentions in str(info.value) and "package.module:function" in str(info.value)


# --------------------------------------------------------------------------- RewardPool


@pytest.fixture(scope="module")
def auto_pool():
    with RewardPool(num_workers=2, timeout_s=2.0, verifier="auto") as pool:
        yield pool


@pytest.fixture(scope="module")
def naughty_pool():
    with RewardPool(num_workers=2, timeout_s=1.0, worker_memory_mb=1024, verifier="reward_helpers:misbehave") as pool:
        yield pool


def test_pool_preserves_order_with_mixed_verifiers(auto_pool):
    n = 240
    responses, golds, sources = [], [], []
    for i in range(n):
        answer = i + 1 if i % 3 == 0 else i  # every third response is wrong
        if i % 2 == 0:
            responses.append(f"Reasoning about item {i}...\nAnswer: {answer}")
            golds.append(str(i))
            sources.append("math_dapo")
        else:
            responses.append(f"Reasoning about item {i}... so it is \\boxed{{{answer}}}.")
            golds.append(f"Work.\n#### {i}")
            sources.append("openai/gsm8k")
    batch = auto_pool.score(responses, golds, sources)
    assert isinstance(batch, RewardBatch)
    assert batch.acc == [i % 3 != 0 for i in range(n)]
    assert batch.scores == [-1.0 if i % 3 == 0 else 1.0 for i in range(n)]
    assert batch.preds == [str(i + 1 if i % 3 == 0 else i) for i in range(n)]
    assert batch.status == ["ok"] * n
    assert batch.metrics["reward/timeouts"] == 0 and batch.metrics["reward/errors"] == 0
    assert batch.metrics["reward/responses_per_s"] > 0 and batch.metrics["reward/seconds"] > 0


def test_pool_power_tower_left_associative_is_just_wrong(auto_pool):
    # math-verify reads 9^9^9^9^9 as (((9^9)^9)^9)^9 = 9^6561: cheap, so simply incorrect (scored, not timed out)
    batch = auto_pool.score(["\\boxed{9^9^9^9^9}"], ["81"], ["openai/gsm8k"])
    assert batch.scores == [-1.0] and batch.acc == [False] and batch.status == ["ok"]


def test_pool_power_tower_right_associative_times_out(auto_pool):
    # 9^(9^(9^(9^9))) cannot be computed (9^(9^9) alone has 3.7e8 digits): the time limit ends it, the pool goes on
    batch = auto_pool.score(["\\boxed{9^{9^{9^{9^9}}}}"], ["81"], ["openai/gsm8k"])
    assert batch.scores == [-1.0] and batch.status == ["timeout"]
    assert batch.metrics["reward/timeouts"] == 1
    assert auto_pool.score(["\\boxed{81}"], ["81"], ["openai/gsm8k"]).status == ["ok"]


@pytest.mark.parametrize("source", ["math_dapo", "openai/gsm8k"])
def test_pool_random_garbage(seed, auto_pool, source):
    rng = random.Random(seed)
    garbage = "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(200_000))
    batch = auto_pool.score([garbage], ["5"], [source])
    assert batch.scores == [-1.0] and batch.acc == [False]
    assert batch.status[0] in ("ok", "timeout")  # scored wrong, or too long to score: never an exception


def test_pool_invalid_utf8_and_lone_surrogates(auto_pool, caplog):
    responses = [b"Answer: 5", b"Answer: \xff\xfe 5", "Answer: 5 \ud800", "\\boxed{5} \udfff", 12345]
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.reward"):
        batch = auto_pool.score(responses, ["5"] * 5, ["math_dapo", "math_dapo", "math_dapo", "gsm8k", "gsm8k"])
    assert batch.status[:2] == ["ok", "error"] and batch.status[4] == "error"
    assert batch.scores[:2] == [1.0, -1.0] and batch.scores[4] == -1.0
    assert batch.status[2] in ("ok", "error") and batch.status[3] in ("ok", "error")  # scored or not, never a crash
    assert batch.metrics["reward/errors"] == batch.status.count("error") >= 2
    messages = [r.getMessage() for r in caplog.records if r.name == "megatron_dapo.reward"]
    assert any("response 1 error" in m and "invalid UTF-8" in m and "\\xff\\xfe" in m for m in messages)


def test_pool_mismatched_lengths(auto_pool):
    with pytest.raises(ValueError, match="same length"):
        auto_pool.score(["Answer: 1", "Answer: 2"], ["1"], ["math_dapo", "math_dapo"])
    with pytest.raises(ValueError, match="same length"):
        auto_pool.score(["Answer: 1"], ["1"], [])


def test_pool_empty_call(auto_pool):
    batch = auto_pool.score([], [], [])
    assert batch.scores == [] and batch.status == [] and batch.metrics["reward/errors"] == 0


def test_pool_sleeping_verifier_times_out_and_pool_recovers(naughty_pool):
    # 'sleep' sleeps 10,000 s: without the time limit this call would run into the hang guard
    batch = naughty_pool.score(["sleep"], ["x"], ["src"])
    assert batch.status == ["timeout"] and batch.scores == [-1.0] and batch.metrics["reward/timeouts"] == 1
    again = naughty_pool.score(["a", "b"], ["a", "c"], ["src", "src"])
    assert again.scores == [1.0, -1.0] and again.status == ["ok", "ok"]


def test_pool_kills_worker_stuck_in_c_code(naughty_pool):
    # 'burn' is minutes in one C call that no signal interrupts: only the parent's SIGKILL stops it in time (status
    # 'timeout'; left to finish, it would be scored 'ok')
    responses = ["a", "burn", "b", "c", "d", "e"]
    batch = naughty_pool.score(responses, ["a", "x", "b", "c", "d", "z"], ["src"] * 6)
    assert batch.status == ["ok", "timeout", "ok", "ok", "ok", "ok"]
    assert batch.scores == [1.0, -1.0, 1.0, 1.0, 1.0, -1.0]
    assert batch.metrics["reward/timeouts"] == 1 and batch.metrics["reward/worker_restarts"] >= 1
    assert naughty_pool.score(["a"], ["a"], ["src"]).scores == [1.0]


def test_pool_worker_exit_is_an_error_and_rest_is_rescored():
    with RewardPool(num_workers=1, timeout_s=5.0, verifier="reward_helpers:misbehave") as pool:
        responses = ["a", "crash", "b", "c", "crash", "d"]
        batch = pool.score(responses, ["a", "x", "b", "x", "x", "d"], ["src"] * 6)
        assert batch.status == ["ok", "error", "ok", "ok", "error", "ok"]
        assert batch.scores == [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
        assert batch.metrics["reward/errors"] == 2 and batch.metrics["reward/worker_restarts"] == 2
        assert pool.score(["a"], ["a"], ["src"]).status == ["ok"]


def test_pool_exceptions_and_memory_errors_are_errors(naughty_pool):
    batch = naughty_pool.score(["boom", "eat", "a"], ["x", "x", "a"], ["src"] * 3)
    assert batch.status == ["error", "error", "ok"]
    assert batch.scores == [-1.0, -1.0, 1.0]
    assert batch.metrics["reward/errors"] == 2


def test_pool_rejects_non_finite_user_scores():
    with RewardPool(num_workers=1, verifier="reward_helpers:nan_score") as pool:
        batch = pool.score(["a"], ["a"], ["src"])
        assert batch.status == ["error"] and batch.scores == [-1.0]


def test_pool_user_float_scores_are_correct_only_above_zero():
    """reward.verifier=package.module:function returning floats, through the pool the trainer builds
    (RewardPool.from_config): 1.0 is correct; a 0/1 reward's 0.0 and a negative score are wrong (acc, which dynamic
    sampling filters on); the scores stay as returned."""
    cfg = RewardConfig(verifier="reward_helpers:gold_as_score", num_workers=1)
    with RewardPool.from_config(cfg) as pool:
        batch = pool.score(["a", "b", "c"], ["0.0", "1.0", "-0.5"], ["src"] * 3)
    assert batch.status == ["ok"] * 3 and batch.scores == [0.0, 1.0, -0.5]
    assert batch.acc == [False, True, False]


_MAIN_SCRIPT = """
import os, sys
with open(os.environ["REWARD_TEST_MARK"], "a") as f:  # runs again in each worker if spawn re-imports __main__
    f.write(f"{os.getpid()}\\n")

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    from megatron_dapo.reward import RewardPool

    with RewardPool(num_workers=1, verifier="reward_helpers:torch_loaded") as pool:
        print(pool.score(["a"], ["a"], ["src"]).status, pool.score(["a"], ["a"], ["src"]).acc)
"""


def test_pool_workers_do_not_rerun_main_script_or_import_torch(tmp_path):
    # A trainer script imports torch at the top; spawn would re-run that import in every worker.
    script, mark = tmp_path / "train_like.py", tmp_path / "mark.txt"
    script.write_text(_MAIN_SCRIPT)
    env = {**os.environ, "REWARD_TEST_MARK": str(mark)}
    proc = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).resolve().parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['ok'] [False]"  # torch_loaded: acc False means no torch in the worker
    assert len(mark.read_text().splitlines()) == 1


def test_pool_workers_that_cannot_start_raise_runtime_error():
    pool = RewardPool(num_workers=1, verifier="reward_helpers:parent_only")  # importable here, not in workers
    try:
        with pytest.raises(RuntimeError, match="failed to start 3 times.*reward.verifier"):
            pool.score(["a"], ["a"], ["src"])
    finally:
        pool.close()


def test_pool_bad_verifier_config():
    with pytest.raises(ValueError, match="reward.verifier"):
        RewardPool(verifier="nonsense")
    with pytest.raises(ValueError, match="reward.verifier"):
        RewardPool(verifier="no_such_module_xyz:f")


def test_pool_from_config_and_close():
    cfg = RewardConfig(verifier="dapo", num_workers=1, timeout_s=3.0, worker_memory_mb=2048)
    pool = RewardPool.from_config(cfg)
    assert (pool.num_workers, pool.timeout_s, pool.worker_memory_mb, pool.verifier) == (1, 3.0, 2048, "dapo")
    assert pool.score(["Answer: 3"], ["3"], ["math_dapo"]).scores == [1.0]
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(["Answer: 3"], ["3"], ["math_dapo"])


def test_pool_replaces_a_worker_that_died_between_calls():
    with RewardPool(num_workers=1, verifier="test_reward:whoami") as pool:
        victim = pool._workers[0].proc
        victim_pid = str(victim.pid)
        assert pool.score(["a"], ["a"], ["src"]).preds == [victim_pid]
        victim.kill()  # e.g. the kernel's OOM killer, while the pool is idle
        victim.join()
        batch = pool.score(["a", "b"], ["a", "b"], ["src", "src"])
        assert batch.status == ["ok", "ok"] and batch.scores == [1.0, 1.0]  # no response is blamed for it
        replacement = str(pool._workers[0].proc.pid)
        assert batch.preds == [replacement] * 2 and replacement != victim_pid
        assert batch.metrics["reward/worker_restarts"] == 1  # counted once, in the next ticket


def test_pool_workers_outlive_the_stop_signals():
    """Slurm and torchrun signal the whole process group; the trainer finishes its step, which scores."""
    with RewardPool(num_workers=2, verifier="test_reward:whoami") as pool:
        for w in pool._workers:  # a worker still starting up keeps the default handlers: wait for its first message
            multiprocessing.connection.wait([w.conn, w.proc.sentinel])
        pool.poll()  # reads the 'ready' messages
        assert all(w.ready for w in pool._workers)
        pids = [w.proc.pid for w in pool._workers]
        for pid in pids:
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
                os.kill(pid, sig)
        # One response per idle worker, in slot order. A worker reads its request only after the signals sent before
        # it are delivered, so each answer proves that very process survived them.
        batch = pool.score(["a", "b"], ["a", "b"], ["src", "src"])
        assert batch.status == ["ok", "ok"] and batch.preds == [str(pid) for pid in pids]
        assert batch.metrics["reward/worker_restarts"] == 0


def test_pool_arms_the_soft_limit_for_each_response():
    """The worker's own SIGALRM limit (timeout_s) runs while each response is scored: what stops a verifier that
    sleeps or loops in Python without the cost of killing and restarting the worker."""
    with RewardPool(num_workers=1, timeout_s=7.0, verifier="test_reward:alarm_left") as pool:
        batch = pool.score(["a", "b", "c"], ["a", "b", "c"], ["src"] * 3)
    assert batch.status == ["ok"] * 3
    assert all(0 < float(left) <= 7.0 for left in batch.preds), batch.preds


# ----------------------------------------------------------------------------- avg@k and pass@k


@pytest.mark.parametrize("problems,k", [(1, 1), (7, 1), (13, 4), (50, 32)])
def test_accuracy_at_k_against_float64_reference(seed, problems, k):
    from megatron_dapo.reward.accuracy import accuracy_at_k

    rng = random.Random(seed)
    p_right = [rng.random() for _ in range(problems)]
    correct = [[rng.random() < p for _ in range(k)] for p in p_right]
    correct[0] = [False] * k  # a problem never solved counts for neither
    avg = np.mean(np.array(correct, dtype=np.float64))
    pass_k = np.mean(np.array([any(row) for row in correct], dtype=np.float64))
    got = accuracy_at_k(correct)
    assert got == {"avg_at_k": avg, "pass_at_k": pass_k, "k": float(k), "problems": float(problems)}
    assert accuracy_at_k([[True] * k] * problems)["avg_at_k"] == 1.0
    assert accuracy_at_k([[False] * k] * problems)["pass_at_k"] == 0.0


def test_accuracy_at_k_rejects_no_problems_and_ragged_k():
    from megatron_dapo.reward.accuracy import accuracy_at_k

    with pytest.raises(ValueError, match="no problems"):
        accuracy_at_k([])
    with pytest.raises(ValueError, match=r"same k >= 1 samples, got \[2, 1\]"):
        accuracy_at_k([[True, False], [True]])
    with pytest.raises(ValueError, match="same k >= 1"):
        accuracy_at_k([[]])
