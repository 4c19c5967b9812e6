"""The offline problem generator (answers checked independently) and the byte-level BPE tokenizer."""

from __future__ import annotations

import ast
import json
import random
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from megatron_dapo.data import generator as gen
from megatron_dapo.data.datasets import PromptDataset
from megatron_dapo.model.tokenizer import GENERATION_PROMPT, SPECIAL_TOKENS, train_byte_bpe_tokenizer

REPO = Path(__file__).resolve().parents[1]
CALC = re.compile(r"<<([^=<>]+)=(-?\d+)>>(-?\d+)")
NUMBER = re.compile(r"-?\d+")


def safe_eval(expr: str) -> int:
    """Evaluate an integer expression of + - * / with Python's own precedence; nothing else is allowed."""
    tree = ast.parse(expr, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), expr
    value = eval(compile(tree, "<expr>", "eval"))
    assert value == int(value), expr
    return int(value)


def random_text(rng: random.Random, n: int) -> str:
    """n random code points from all of Unicode (surrogates excluded: they cannot be UTF-8 encoded)."""
    chars = []
    while len(chars) < n:
        c = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
        if not 0xD800 <= c <= 0xDFFF:
            chars.append(chr(c))
    return "".join(chars)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A tokenizer trained once for this module; its directory."""
    rows = gen.generate_rows("word", "gsm8k", 200, seed=3) + gen.generate_rows("arithmetic", "gsm8k", 200, seed=3)
    out = tmp_path_factory.mktemp("tok")
    train_byte_bpe_tokenizer((r["question"] + "\n" + r["answer"] for r in rows), out, vocab_size=512)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize("kind", gen.KINDS)
@pytest.mark.parametrize("schema", gen.SCHEMAS)
def test_deterministic_from_seed(kind, schema):
    a = gen.generate_rows(kind, schema, 30, seed=5)
    assert a == gen.generate_rows(kind, schema, 30, seed=5)
    assert a != gen.generate_rows(kind, schema, 30, seed=6)
    assert len(a) == 30


# ------------------------------------------------------------------ answers, checked independently


@pytest.mark.parametrize("n_operands,max_operand", [(2, 9), (3, 50), (6, 1000)])
def test_arithmetic_answers(n_operands, max_operand):
    problems = gen.generate_problems("arithmetic", 200, seed=0, n_operands=n_operands, max_operand=max_operand)
    ops_seen = set()
    for p in problems:
        m = re.fullmatch(r"What is ([\d +*-]+)\?", p.question)
        assert m, p.question
        expr = m.group(1)
        assert safe_eval(expr) == p.answer
        numbers = [int(x) for x in re.findall(r"\d+", expr)]
        assert len(numbers) == n_operands and all(1 <= x <= max_operand for x in numbers)
        ops_seen |= set(re.findall(r"[+*-]", expr))
        check_solution(p)
    assert ops_seen == {"+", "-", "*"}


def check_solution(p: gen.Problem) -> None:
    """Every calculator note <<a op b=c>>c is right, and the solution's last number is the answer."""
    notes = CALC.findall(p.solution)
    assert notes, p.solution
    for expr, value, shown in notes:
        assert safe_eval(expr) == int(value) == int(shown), (expr, value)
    assert int(NUMBER.findall(p.solution)[-1]) == p.answer


@pytest.mark.parametrize("template", sorted(gen.WORD_TEMPLATES))
def test_word_problem_answers(template):
    rng = random.Random(template)
    for max_value in (2, 20, 500):
        for _ in range(30):
            p = gen.word_problem(rng, max_value=max_value, template=template)
            assert p.question.endswith("?") and isinstance(p.answer, int) and p.answer >= 0
            check_solution(p)
            # the last step's calculation is the answer itself
            assert int(CALC.findall(p.solution)[-1][1]) == p.answer


def test_word_problems_mix_templates():
    questions = [p.question for p in gen.generate_problems("word", 60, seed=0)]
    assert any("change" in q for q in questions) and any("years" in q for q in questions)
    assert len(set(questions)) > 50


def test_bad_knobs():
    with pytest.raises(ValueError):
        gen.generate_problems("arithmetic", 1, n_operands=1)
    with pytest.raises(ValueError):
        gen.generate_problems("word", 1, max_value=1)
    with pytest.raises(ValueError):
        gen.generate_problems("geometry", 1)
    with pytest.raises(ValueError):
        gen.generate_rows("arithmetic", "csv", 1)


# ------------------------------------------------------------------ row schemas


def test_dapo_rows():
    problems = gen.generate_problems("word", 5, seed=1)
    for i, (row, p) in enumerate(zip(gen.generate_rows("word", "dapo", 5, seed=1), problems)):
        assert row["data_source"] == "synthetic_dapo"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(p.answer)}
        assert row["extra_info"]["index"] == str(i)
        [message] = row["prompt"]
        assert message["role"] == "user"
        assert message["content"] == (
            "Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            f"{p.question}\n\n"
            'Remember to put your answer on its own line after "Answer:".'
        )


def test_gsm8k_rows():
    problems = gen.generate_problems("arithmetic", 5, seed=1)
    for row, p in zip(gen.generate_rows("arithmetic", "gsm8k", 5, seed=1), problems):
        assert row == {
            "question": p.question,
            "answer": f"{p.solution}\n#### {p.answer}",
            "data_source": "synthetic_gsm8k",
        }
        solution, final = row["answer"].rsplit("\n#### ", 1)
        assert int(final) == p.answer == int(NUMBER.findall(solution)[-1])


@pytest.mark.parametrize("schema", gen.SCHEMAS)
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rows_load_back_through_prompt_dataset(tmp_path, tok, schema, suffix):
    problems = gen.generate_problems("word", 40, seed=2)
    rows = gen.generate_rows("word", schema, 40, seed=2)
    write = gen.write_jsonl if suffix == ".jsonl" else gen.write_parquet
    ds = PromptDataset([write(tmp_path / f"rows{suffix}", rows)], tok)
    assert ds.stats["rows"] == 40 and ds.stats["bad_rows"] == 0
    by_question = {p.question: str(p.answer) for p in problems}
    assert len(ds) == len(by_question)
    for prompt in ds:
        [question] = [q for q in by_question if q in prompt.messages[0]["content"]]
        assert prompt.ground_truth == by_question[question]
        assert prompt.data_source == f"synthetic_{schema}"
        assert prompt.text.endswith(GENERATION_PROMPT)


def test_write_jsonl_keeps_unicode(tmp_path):
    path = gen.write_jsonl(tmp_path / "sub" / "u.jsonl", [{"question": "Ünïcødé 你好?", "answer": "#### 1"}])
    assert "你好" in path.read_text(encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8")) == {"question": "Ünïcødé 你好?", "answer": "#### 1"}


# ------------------------------------------------------------------ command line


def test_cli_main_in_process(tmp_path, capsys):
    out = tmp_path / "a.parquet"
    assert gen.main(["--kind", "arithmetic", "--schema", "dapo", "--n", "7", "--seed", "4", "--out", str(out)]) == 0
    assert "wrote 7" in capsys.readouterr().out
    import pyarrow.parquet as pq

    assert pq.read_table(out).to_pylist() == gen.generate_rows("arithmetic", "dapo", 7, seed=4)


def test_cli_as_module(tmp_path):
    out = tmp_path / "w.jsonl"
    cmd = [sys.executable, "-m", "megatron_dapo.data.generator", "--kind", "word", "--schema", "gsm8k"]
    cmd += ["--n", "5", "--seed", "9", "--max-value", "30", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == gen.generate_rows("word", "gsm8k", 5, seed=9, max_value=30)


def test_cli_rejects_bad_suffix(tmp_path):
    with pytest.raises(SystemExit):
        gen.main(["--n", "1", "--out", str(tmp_path / "x.csv")])


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_files_and_special_tokens(tok_dir, tok):
    assert (tok_dir / "tokenizer.json").is_file()
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in SPECIAL_TOKENS:
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [special]
    assert tok("hello", add_special_tokens=True)["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


def test_tokenizer_round_trips_random_unicode_after_reload(tok):
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 60)) + rng.choice(["", " .", "  \t\n\r\n", " n't 12345 ", "e\u0301"])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        == text[: -len(GENERATION_PROMPT)]
    )


def test_tokenizer_in_a_qwen2_model_dir(tok_dir, tok, tmp_path):
    # transformers 5.x loads Qwen2Tokenizer for a directory with a Qwen2 config.json and rebuilds the
    # pre-tokenizer with an NFC normalizer: our tokenizer uses Qwen2's split, so NFC text gets the same ids
    from transformers import AutoTokenizer, Qwen2Config

    model_dir = tmp_path / "model"
    shutil.copytree(tok_dir, model_dir)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
    cfg.save_pretrained(model_dir)
    qwen = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(1)
    for _ in range(100):
        text = unicodedata.normalize("NFC", random_text(rng, 40) + " The answer is 1234.\n")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert qwen(text, add_special_tokens=False)["input_ids"] == ids
        assert qwen.decode(ids) == text
    assert qwen.eos_token_id == tok.eos_token_id and qwen.pad_token_id == tok.pad_token_id


def test_tokenizer_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_byte_bpe_tokenizer(["abc"], tmp_path, vocab_size=100)
