"""PromptDataset: both schemas from JSONL and Parquet, de-duplication, chat template, filtering, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_dapo.config import DataConfig
from megatron_dapo.data.datasets import GSM8K_INSTRUCTION, DatasetError, PromptDataset
from megatron_dapo.data.generator import generate_rows, write_jsonl, write_parquet
from megatron_dapo.model.tokenizer import CHATML_TEMPLATE, GENERATION_PROMPT, train_byte_bpe_tokenizer

# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small byte-level BPE with a ChatML template, trained once for this module."""
    rows = generate_rows("word", "gsm8k", 200, seed=1) + generate_rows("arithmetic", "dapo", 200, seed=1)
    texts = [r.get("question", "") + r.get("answer", "") for r in rows] + [
        r["prompt"][0]["content"] for r in rows if "prompt" in r
    ]
    return train_byte_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=400)


def dapo(content: str, gt="7", source: str = "math_dapo", role: str = "user") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": role, "content": content}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"index": "x"},
    }


def gsm8k(question: str, answer: str = "2 + 2 = 4\n#### 4", **extra) -> dict:
    return {"question": question, "answer": answer, **extra}


def write(path: Path, rows: list) -> Path:
    """JSONL or Parquet by suffix."""
    return write_jsonl(path, rows) if path.suffix == ".jsonl" else write_parquet(path, rows)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------ both schemas, both file types


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_dapo_schema(tmp_path, tok, suffix):
    rows = [dapo("What is 1 + 1?", "2"), dapo("What is 2 * 3?", "6"), dapo("What is 1 + 1?", "2"), dapo("Name 5.", "5")]
    ds = PromptDataset([write(tmp_path / f"d{suffix}", rows)], tok)
    assert len(ds) == 3
    assert ds.stats == dict(rows=4, kept=3, duplicates=1, bad_rows=0, too_long=0, conflicting_duplicates=0)
    assert [p.index for p in ds] == [0, 1, 2]
    assert [ds[i].index for i in range(len(ds))] == [0, 1, 2]
    assert [p.ground_truth for p in ds] == ["2", "6", "5"]
    assert {p.data_source for p in ds} == {"math_dapo"}
    assert ds[1].messages == [{"role": "user", "content": "What is 2 * 3?"}]
    for p in ds:
        assert p.text == f"<|im_start|>user\n{p.messages[0]['content']}<|im_end|>\n{GENERATION_PROMPT}"
        assert p.text.startswith("<|im_start|>user") and p.text.endswith(GENERATION_PROMPT)
        assert tok.decode(p.token_ids) == p.text
        assert p.token_ids == tok(p.text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_integer_ground_truths_become_strings(tmp_path, tok, suffix):
    ds = PromptDataset([write(tmp_path / f"i{suffix}", [dapo("A?", 6), dapo("B?", -12)])], tok)
    assert [p.ground_truth for p in ds] == ["6", "-12"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_schema(tmp_path, tok, suffix):
    rows = [
        gsm8k("How many?", "600 + 634 = <<600+634=1234>>1234\n#### 1,234"),
        gsm8k("How few?", "#### 3", data_source="openai/gsm8k"),
        gsm8k("How much?", "Half of 10 is 5. #### 2,000,000 "),
    ]
    ds = PromptDataset([write(tmp_path / f"g{suffix}", rows)], tok)
    assert [p.ground_truth for p in ds] == ["1234", "3", "2000000"]
    assert [p.data_source for p in ds] == ["gsm8k", "openai/gsm8k", "gsm8k"]
    assert ds[0].messages == [{"role": "user", "content": "How many?" + GSM8K_INSTRUCTION}]
    assert "\\boxed{}" in GSM8K_INSTRUCTION and "step by step" in GSM8K_INSTRUCTION
    assert ds[0].text.startswith("<|im_start|>user\nHow many?") and ds[0].text.endswith(GENERATION_PROMPT)
    assert tok.decode(ds[2].token_ids) == ds[2].text


def test_auto_decides_per_row_and_forced_format(tmp_path, tok):
    f = write(tmp_path / "mixed.jsonl", [dapo("A?", "1"), gsm8k("B?"), dapo("C?", "3")])
    ds = PromptDataset([f], tok)
    assert [(p.ground_truth, p.data_source) for p in ds] == [("1", "math_dapo"), ("4", "gsm8k"), ("3", "math_dapo")]
    with pytest.raises(DatasetError, match=r"line 2: .*format='dapo'.*field 'prompt'"):
        PromptDataset([f], tok, format="dapo")
    with pytest.raises(DatasetError, match=r"line 1: .*format='gsm8k'.*field 'question'"):
        PromptDataset([f], tok, format="gsm8k")


def test_mixed_parquet_has_null_columns(tmp_path, tok):
    # one Parquet table with both schemas: every row carries every column, the other schema's as null
    f = write(tmp_path / "mixed.parquet", [dapo("A?", "1"), gsm8k("B?")])
    assert [p.ground_truth for p in PromptDataset([f], tok)] == ["1", "4"]


def test_blank_lines_and_multiple_files(tmp_path, tok):
    a = write_lines(tmp_path / "a.jsonl", ["", json.dumps(dapo("A?")), "   ", json.dumps(dapo("B?")), ""])
    b = write(tmp_path / "b.parquet", [dapo("B?"), dapo("C?")])
    ds = PromptDataset([a, str(b)], tok)
    assert [p.messages[0]["content"] for p in ds] == ["A?", "B?", "C?"]
    assert ds.stats["rows"] == 4 and ds.stats["duplicates"] == 1  # de-duplicated across files


# ------------------------------------------------------------------ de-duplication


def test_dedup_counts_and_conflicts(tmp_path, tok, caplog):
    rows = []
    for rep in range(5):
        for i in range(4):
            rows.append(dapo(f"Problem {i}?", str(i if rep < 3 or i != 2 else 99)))  # problem 2 later disagrees
    rows.append(dapo("Problem 0?", "0", role="system"))  # same content, other role: another prompt
    f = write(tmp_path / "dup.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data"):
        ds = PromptDataset([f], tok)
    assert len(ds) == 5
    assert ds.stats == dict(rows=21, kept=5, duplicates=16, bad_rows=0, too_long=0, conflicting_duplicates=2)
    assert [p.ground_truth for p in ds] == ["0", "1", "2", "3", "0"]  # the first occurrence wins
    assert "keeping the first" in caplog.text and "line 15" in caplog.text

    ds = PromptDataset([f], tok, dedup=False)
    assert len(ds) == 21 and ds.stats["duplicates"] == 0 and [p.index for p in ds] == list(range(21))


def test_summary_is_logged(tmp_path, tok, caplog):
    f = write(tmp_path / "s.jsonl", [dapo("A?"), dapo("A?")])
    with caplog.at_level(logging.INFO, logger="megatron_dapo.data"):
        PromptDataset([f], tok)
    summary = [r for r in caplog.records if r.name == "megatron_dapo.data" and "kept=" in r.getMessage()]
    assert len(summary) == 1
    for key in ("rows=2", "kept=1", "duplicates=1", "bad_rows=0", "too_long=0", "conflicting_duplicates=0"):
        assert key in summary[0].getMessage()


# ------------------------------------------------------------------ too long


def test_too_long_prompts_are_dropped(tmp_path, tok):
    rows = [dapo("short?"), dapo("long " * 200 + "?"), dapo("also short?")]
    f = write(tmp_path / "t.jsonl", rows)
    full = PromptDataset([f], tok)
    lengths = [len(p.token_ids) for p in full]
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit
    ds = PromptDataset([f], tok, max_prompt_length=limit)
    assert [p.messages[0]["content"] for p in ds] == ["short?", "also short?"]
    assert [p.index for p in ds] == [0, 1]
    assert ds.stats["too_long"] == 1 and ds.stats["kept"] == 2
    assert all(len(p.token_ids) <= limit for p in ds)


# ------------------------------------------------------------------ malformed rows

GOOD = json.dumps(dapo("Fine?"))

# (id, the bad JSONL line, text the error must contain: the field or what is wrong)
BAD_ROWS = [
    ("invalid-json", '{"prompt": [', "invalid JSON"),
    ("not-an-object", "[1, 2, 3]", "expected a JSON object, got list"),
    ("no-known-keys", json.dumps({"text": "hi"}), "field 'prompt'"),
    ("prompt-not-list", json.dumps({**dapo("x"), "prompt": "What?"}), "field 'prompt'"),
    ("prompt-empty", json.dumps({**dapo("x"), "prompt": []}), "field 'prompt'"),
    ("prompt-blank", json.dumps(dapo("   ")), "field 'prompt'"),
    ("message-not-dict", json.dumps({**dapo("x"), "prompt": ["hi"]}), "field 'prompt[0]'"),
    ("message-no-role", json.dumps({**dapo("x"), "prompt": [{"content": "hi"}]}), "field 'prompt[0].role'"),
    ("message-no-content", json.dumps({**dapo("x"), "prompt": [{"role": "user"}]}), "field 'prompt[0].content'"),
    ("content-not-str", json.dumps({**dapo("x"), "prompt": [{"role": "user", "content": 5}]}), "prompt[0].content"),
    ("no-reward-model", json.dumps({k: v for k, v in dapo("x").items() if k != "reward_model"}), "'reward_model'"),
    ("reward-model-str", json.dumps({**dapo("x"), "reward_model": "7"}), "field 'reward_model'"),
    ("no-ground-truth", json.dumps({**dapo("x"), "reward_model": {"style": "rule"}}), "reward_model.ground_truth"),
    ("ground-truth-empty", json.dumps(dapo("x", gt=" ")), "field 'reward_model.ground_truth'"),
    ("ground-truth-list", json.dumps(dapo("x", gt=[1])), "field 'reward_model.ground_truth'"),
    ("ground-truth-bool", json.dumps(dapo("x", gt=True)), "field 'reward_model.ground_truth'"),
    ("no-data-source", json.dumps({k: v for k, v in dapo("x").items() if k != "data_source"}), "'data_source'"),
    ("data-source-int", json.dumps(dapo("x", source=3)), "field 'data_source'"),
    ("gsm8k-no-hashes", json.dumps(gsm8k("Q?", "The answer is 4.")), "field 'answer'"),
    ("gsm8k-empty-answer", json.dumps(gsm8k("Q?", "2 + 2 = 4\n#### ")), "field 'answer'"),
    ("gsm8k-answer-int", json.dumps(gsm8k("Q?", 4)), "field 'answer'"),
    ("gsm8k-no-question", json.dumps({"answer": "#### 4"}), "field 'question'"),
    ("gsm8k-blank-question", json.dumps(gsm8k(" ")), "field 'question'"),
    ("gsm8k-source-int", json.dumps(gsm8k("Q?", data_source=1)), "field 'data_source'"),
]


@pytest.mark.parametrize("line,expected", [case[1:] for case in BAD_ROWS], ids=[case[0] for case in BAD_ROWS])
def test_bad_row_raises_naming_file_row_and_field(tmp_path, tok, line, expected):
    f = write_lines(tmp_path / "bad.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(DatasetError) as err:
        PromptDataset([f], tok)
    msg = str(err.value)
    assert str(f) in msg and "line 3:" in msg and expected in msg, msg


@pytest.mark.parametrize("line,expected", [case[1:] for case in BAD_ROWS], ids=[case[0] for case in BAD_ROWS])
def test_bad_row_skipped_and_counted(tmp_path, tok, caplog, line, expected):
    f = write_lines(tmp_path / "bad.jsonl", [GOOD, "", line, json.dumps(dapo("Other?"))])
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data"):
        ds = PromptDataset([f], tok, on_bad_row="skip")
    assert ds.stats == dict(rows=3, kept=2, duplicates=0, bad_rows=1, too_long=0, conflicting_duplicates=0)
    assert "line 3:" in caplog.text and expected in caplog.text


def test_bad_parquet_row_names_the_0_based_row(tmp_path, tok):
    f = write(tmp_path / "bad.parquet", [gsm8k("A?"), gsm8k("B?", "no final answer"), gsm8k("C?")])
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1 \(0-based Parquet row index\).*field 'answer'"):
        PromptDataset([f], tok)
    ds = PromptDataset([f], tok, on_bad_row="skip")
    assert len(ds) == 2 and ds.stats["bad_rows"] == 1


def test_only_the_first_few_skips_are_logged(tmp_path, tok, caplog):
    f = write_lines(tmp_path / "many.jsonl", [GOOD] + ["{oops"] * 20)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data"):
        ds = PromptDataset([f], tok, on_bad_row="skip")
    assert ds.stats["bad_rows"] == 20
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) < 10


# ------------------------------------------------------------------ file-level errors


def test_missing_file(tmp_path, tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=r"nope\.jsonl.*does not exist"):
        PromptDataset([missing], tok)


@pytest.mark.parametrize("name", ["data.json", "data.csv", "data"])
def test_unsupported_extension(tmp_path, tok, name):
    f = tmp_path / name
    f.write_text(GOOD + "\n")
    with pytest.raises(DatasetError, match=rf"{name}.*unsupported file type"):
        PromptDataset([f], tok)


def test_corrupt_parquet(tmp_path, tok):
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"broken\.parquet.*Parquet"):
        PromptDataset([f], tok)


def test_empty_result_names_files_and_stats(tmp_path, tok):
    blank = write_lines(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(DatasetError, match=r"blank\.jsonl.*rows=0, kept=0"):
        PromptDataset([blank], tok)
    f = write(tmp_path / "t.jsonl", [dapo("A fairly long question?"), dapo("A fairly long question?")])
    with pytest.raises(DatasetError, match=r"t\.jsonl.*rows=2, kept=0, duplicates=1.*too_long=1"):
        PromptDataset([f], tok, max_prompt_length=3)
    with pytest.raises(DatasetError, match="bad_rows=2"):
        PromptDataset([write_lines(tmp_path / "b.jsonl", ["[]", "{}"])], tok, on_bad_row="skip")


def test_tokenizer_without_chat_template(tmp_path, tok):
    f = write(tmp_path / "a.jsonl", [dapo("A?")])
    plain = tok.__class__(tokenizer_object=tok.backend_tokenizer)
    assert plain.chat_template is None
    with pytest.raises(DatasetError, match="chat template"):
        PromptDataset([f], plain)


def test_a_tokenizer_that_adds_a_bos_gets_one_per_prompt(tmp_path, tok):
    """A Llama-3-style tokenizer: its post-processor adds <|begin_of_text|> to every encoding, and its chat template
    starts with it too. The templated text is tokenized as it is (no special tokens added): every prompt starts with
    exactly one BOS, and its ids are the template text's own (the tokenizers library's encoding, nothing added)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    bos = "<|begin_of_text|>"
    core = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    core.add_special_tokens([bos])
    bos_id = core.token_to_id(bos)
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    llama = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        clean_up_tokenization_spaces=False,
    )
    llama.chat_template = "{{- bos_token }}" + CHATML_TEMPLATE
    assert llama("Hi")["input_ids"][0] == bos_id  # the tokenizer adds a BOS of its own
    ds = PromptDataset([write(tmp_path / "a.jsonl", [dapo("What is 1 + 1?", "2"), gsm8k("B?")])], llama)
    assert len(ds) == 2
    for p in ds:
        assert p.text.startswith(bos) and p.text.count(bos) == 1
        assert p.token_ids[0] == bos_id and p.token_ids.count(bos_id) == 1, p.token_ids[:4]
        assert p.token_ids == core.encode(p.text, add_special_tokens=False).ids


def test_bad_arguments(tmp_path, tok):
    f = write(tmp_path / "a.jsonl", [dapo("A?")])
    for kwargs in (dict(format="csv"), dict(on_bad_row="ignore"), dict(max_prompt_length=0)):
        with pytest.raises(DatasetError):
            PromptDataset([f], tok, **kwargs)
    with pytest.raises(DatasetError, match="no dataset files"):
        PromptDataset([], tok)


# ------------------------------------------------------------------ config


def test_from_config(tmp_path, tok):
    train = write(tmp_path / "train.jsonl", [dapo("A?"), dapo("A?"), gsm8k("B?")])
    val = write(tmp_path / "val.parquet", [gsm8k("C?", "#### 12")])
    cfg = DataConfig(train_files=[str(train)], val_files=[str(val)], max_prompt_length=512)
    assert len(PromptDataset.from_config(cfg, tok)) == 2
    val_ds = PromptDataset.from_config(cfg, tok, split="val")
    assert [p.ground_truth for p in val_ds] == ["12"]
    assert len(PromptDataset.from_config(DataConfig(train_files=[str(train)], dedup=False), tok)) == 3
    with pytest.raises(DatasetError, match="val_files"):
        PromptDataset.from_config(DataConfig(train_files=[str(train)]), tok, split="val")
    with pytest.raises(DatasetError, match="split"):
        PromptDataset.from_config(cfg, tok, split="test")
