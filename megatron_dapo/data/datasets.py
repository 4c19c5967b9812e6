"""Prompt datasets: DAPO-Math-17K and GSM8K rows from JSONL or Parquet, de-duplicated and chat-templated.

    ds = PromptDataset(["dapo-math-17k.parquet"], tokenizer)
    ds[0]      # Prompt(index=0, messages=[...], text="<|im_start|>user\n...", token_ids=[...], ...)
    ds.stats   # {"rows": 1791700, "kept": 17917, "duplicates": 1773783, ...}

Two row schemas are understood ('auto' decides per row from the keys present):

- DAPO-Math-17K: ``prompt`` (list of {"role", "content"} messages), ``reward_model``
  ({"ground_truth": str, ...}), ``data_source`` (str); other keys are ignored.
- GSM8K: ``question`` (str), ``answer`` (worked solution ending with ``#### N``),
  optional ``data_source`` (default 'gsm8k').

Loading reads and checks every row, de-duplicates by prompt text, and only then renders
the chat template and tokenizes, so DAPO-Math-17K's ~1.7M rows cost ~17k tokenizations.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.choices import BAD_ROW_POLICIES
from megatron_dapo.choices import DATASET_FORMATS as FORMATS
from megatron_dapo.reward.answers import gsm8k_answer
from megatron_dapo.types import Prompt

logger = logging.getLogger("megatron_dapo.data")

SUFFIXES = (".jsonl", ".parquet")

GSM8K_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
"""Appended to a GSM8K question to make the user message (Qwen2.5-Math's wording)."""
GSM8K_DATA_SOURCE = "gsm8k"
"""data_source of GSM8K rows that do not name one."""

_MAX_WARNINGS = 5  # skipped rows and conflicting duplicates logged one by one before going quiet
_TOKENIZE_BATCH = 1024  # prompts per call into the (Rust, multi-threaded) fast tokenizer


class DatasetError(ValueError):
    """A dataset that cannot be loaded: the message names the file, the row and the field where it can."""


class _BadRow(Exception):
    """A malformed row: field (dotted path, or None for the row as a whole) and what was expected."""

    def __init__(self, field: Optional[str], problem: str) -> None:
        super().__init__(problem)
        self.field = field
        self.problem = problem

    def describe(self) -> str:
        return f"field '{self.field}': {self.problem}" if self.field else self.problem


class _InvalidJSON:
    """Stands in for a JSONL line that does not parse, so reading and checking stay separate steps."""

    def __init__(self, error: json.JSONDecodeError) -> None:
        self.error = error


@dataclass
class _Row:
    """A checked row before templating. where: 'file: line N' / 'file: row N (0-based Parquet row index)'."""

    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    where: str


# ---------------------------------------------------------------- reading files


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (where, parsed object or _InvalidJSON) per non-blank line; line numbers are 1-based."""
    try:
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, hand-edited files) are not rows
                try:
                    obj: Any = json.loads(line)
                except json.JSONDecodeError as e:
                    obj = _InvalidJSON(e)
                yield f"{path}: line {lineno}", obj
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not valid UTF-8 text ({e}); expected JSONL, one JSON object per line") from None


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (where, row dict) per Parquet row; row indices are 0-based."""
    import pyarrow.parquet as pq  # deferred: pyarrow is heavy and JSONL-only users never need it

    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=65536)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}: row {index} (0-based Parquet row index)", row
                index += 1
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DatasetError(f"{path}: cannot read as Parquet: {e}") from None


def _check_file(path: Path) -> None:
    """Unknown suffixes and missing files are DatasetErrors naming the file."""
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type '{path.suffix}'; expected one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file does not exist")


def _iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (where, raw row) for every row of a .jsonl or .parquet file."""
    _check_file(path)
    return _iter_jsonl(path) if path.suffix == ".jsonl" else _iter_parquet(path)


# ---------------------------------------------------------------- checking rows


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _require_str(row: dict, field: str, what: str = "a string") -> str:
    value = row.get(field)
    if field not in row or value is None:
        raise _BadRow(field, f"missing; expected {what}")
    if not isinstance(value, str):
        raise _BadRow(field, f"expected {what}, got {_type_name(value)} {value!r:.80}")
    return value


def _parse_messages(value: Any) -> list[dict[str, str]]:
    """DAPO's prompt: a non-empty list of {"role": str, "content": str}; extra message keys are dropped."""
    if value is None:
        raise _BadRow("prompt", "missing; expected a list of chat messages")
    if not isinstance(value, list):
        raise _BadRow("prompt", f"expected a list of chat messages, got {_type_name(value)} {value!r:.80}")
    if not value:
        raise _BadRow("prompt", "empty list; expected at least one chat message")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _BadRow(f"prompt[{i}]", f"expected a message object with 'role' and 'content', got {_type_name(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if m.get(key) is None else f"got {_type_name(m[key])}"
                raise _BadRow(f"prompt[{i}].{key}", f"{got}; expected a string")
        if not m["role"]:
            raise _BadRow(f"prompt[{i}].role", "empty; expected a role such as 'user'")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        raise _BadRow("prompt", "every message content is empty; expected a non-empty prompt")
    return messages


def _parse_dapo(row: dict) -> tuple[list[dict[str, str]], str, str]:
    """DAPO-Math-17K row -> (messages, ground_truth, data_source)."""
    messages = _parse_messages(row.get("prompt"))
    rm = row.get("reward_model")
    if rm is None:
        raise _BadRow("reward_model", 'missing; expected an object {"ground_truth": ...}')
    if not isinstance(rm, dict):
        raise _BadRow("reward_model", f'expected an object {{"ground_truth": ...}}, got {_type_name(rm)}')
    gt = rm.get("ground_truth")
    expected = "a non-empty string or an integer"
    if gt is None:
        raise _BadRow("reward_model.ground_truth", f"missing; expected {expected}")
    if isinstance(gt, int) and not isinstance(gt, bool):
        gt = str(gt)  # some exports store integer answers as numbers
    if not isinstance(gt, str):
        raise _BadRow("reward_model.ground_truth", f"expected {expected}, got {_type_name(gt)} {gt!r:.80}")
    if not gt.strip():
        raise _BadRow("reward_model.ground_truth", f"empty; expected {expected}")
    data_source = _require_str(row, "data_source", "a string naming the source, e.g. 'math_dapo'")
    return messages, gt.strip(), data_source


def _gsm8k_ground_truth(answer: str) -> str:
    """'... #### 1,234' -> '1234': the text after the last '####', thousands separators removed."""
    if "####" not in answer:
        raise _BadRow("answer", "no '#### N' final answer; expected a worked solution ending with '#### N'")
    gt = gsm8k_answer(answer)  # the verifier's own reading of a GSM8K gold
    if not gt:
        raise _BadRow("answer", "empty final answer after '####'; expected '#### N'")
    return gt


def _parse_gsm8k(row: dict) -> tuple[list[dict[str, str]], str, str]:
    """GSM8K row -> (messages, ground_truth, data_source)."""
    question = _require_str(row, "question")
    if not question.strip():
        raise _BadRow("question", "empty; expected the problem text")
    gt = _gsm8k_ground_truth(_require_str(row, "answer", "a worked solution ending with '#### N'"))
    source = row.get("data_source")
    if source is None:
        source = GSM8K_DATA_SOURCE
    elif not isinstance(source, str):
        raise _BadRow("data_source", f"expected a string, got {_type_name(source)}")
    return [{"role": "user", "content": question + GSM8K_INSTRUCTION}], gt, source


def _parse_row(obj: Any, fmt: str) -> tuple[list[dict[str, str]], str, str]:
    """Check one raw row against the schema fmt ('auto' picks per row); raise _BadRow when malformed."""
    if isinstance(obj, _InvalidJSON):
        raise _BadRow(None, f"invalid JSON ({obj.error.msg} at column {obj.error.colno}); expected one JSON object")
    if not isinstance(obj, dict):
        raise _BadRow(None, f"expected a JSON object, got {_type_name(obj)}")
    if fmt == "auto":
        # Parquet files carry every column on every row, so a present-but-null key counts as absent
        if obj.get("prompt") is not None or obj.get("reward_model") is not None:
            fmt = "dapo"
        elif obj.get("question") is not None or obj.get("answer") is not None:
            fmt = "gsm8k"
        else:
            raise _BadRow("prompt", "missing; expected a DAPO row (field 'prompt') or a GSM8K row (field 'question')")
    return _parse_dapo(obj) if fmt == "dapo" else _parse_gsm8k(obj)


def _prompt_key(messages: list[dict[str, str]]) -> tuple[tuple[str, str], ...]:
    """The de-duplication key: every message's role and content, in order."""
    return tuple((m["role"], m["content"]) for m in messages)


# ---------------------------------------------------------------- the dataset


class PromptDataset(Sequence):
    """De-duplicated, chat-templated prompts from JSONL/Parquet files; ds[i] is a Prompt with index i.

    files: list[str | Path], .jsonl or .parquet. tokenizer: a transformers tokenizer with a chat template.
    format: 'auto' | 'dapo' | 'gsm8k'. dedup: drop rows whose prompt was already seen (first wins).
    on_bad_row: 'error' (raise DatasetError at the first malformed row) | 'skip' (drop and count it).
    max_prompt_length: prompts with more tokens than this after templating are dropped and counted.

    stats: dict[str, int]: rows (read), kept (== len), duplicates, bad_rows (skipped), too_long, and
    conflicting_duplicates (same prompt, another ground truth; also in duplicates). rows is the sum of kept,
    duplicates, bad_rows and too_long; with dedup=False nothing is counted as a duplicate.
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer: Any,
        format: str = "auto",
        dedup: bool = True,
        on_bad_row: str = "error",
        max_prompt_length: int = 2048,
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]  # a lone path is an easy mistake; a str would otherwise be read per character
        if format not in FORMATS:
            raise DatasetError(f"format={format!r}: expected one of {FORMATS}")
        if on_bad_row not in BAD_ROW_POLICIES:
            raise DatasetError(f"on_bad_row={on_bad_row!r}: expected one of {BAD_ROW_POLICIES}")
        if max_prompt_length < 1:
            raise DatasetError(f"max_prompt_length={max_prompt_length}: expected an integer >= 1")
        if not files:
            raise DatasetError("no dataset files given; expected at least one .jsonl or .parquet file")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DatasetError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; prompts are rendered with "
                "tokenizer.apply_chat_template, so use an instruct/chat tokenizer or set tokenizer.chat_template"
            )
        self.files = [Path(f) for f in files]
        for path in self.files:
            _check_file(path)  # every file up front: a typo in the last file should not cost a long read first
        self.format = format
        self.dedup = dedup
        self.on_bad_row = on_bad_row
        self.max_prompt_length = max_prompt_length
        self.stats: dict[str, int] = dict.fromkeys(
            ("rows", "kept", "duplicates", "bad_rows", "too_long", "conflicting_duplicates"), 0
        )
        rows = self._read_unique_rows()
        self._prompts = self._render(rows, tokenizer)
        self.stats["kept"] = len(self._prompts)
        summary = ", ".join(f"{k}={v}" for k, v in self.stats.items())
        logger.info("PromptDataset: %d file(s) [%s]: %s", len(self.files), self._names(), summary)
        if not self._prompts:
            raise DatasetError(f"no prompts left in {self._names()} after filtering ({summary})")

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, split: str = "train") -> PromptDataset:
        """Build from a DataConfig: split 'train' reads cfg.train_files, 'val' cfg.val_files."""
        if split not in ("train", "val"):
            raise DatasetError(f"split={split!r}: expected 'train' or 'val'")
        files = cfg.train_files if split == "train" else cfg.val_files
        if not files:
            raise DatasetError(f"data.{split}_files is empty; expected at least one .jsonl or .parquet file")
        return cls(
            list(files),
            tokenizer,
            format=cfg.format,
            dedup=cfg.dedup,
            on_bad_row=cfg.on_bad_row,
            max_prompt_length=cfg.max_prompt_length,
        )

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Prompt:  # type: ignore[override]
        return self._prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self._prompts)

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts from {self._names()})"

    def _names(self) -> str:
        return ", ".join(str(f) for f in self.files)

    def _read_unique_rows(self) -> list[_Row]:
        """Read and check every row of every file; return the first occurrence of each prompt."""
        seen: dict[tuple[tuple[str, str], ...], str] = {}  # prompt key -> ground truth of its first occurrence
        kept: list[_Row] = []
        for path in self.files:
            for where, obj in _iter_file(path):
                self.stats["rows"] += 1
                try:
                    messages, gt, source = _parse_row(obj, self.format)
                except _BadRow as e:
                    self._bad_row(where, e)
                    continue
                if self.dedup:
                    key = _prompt_key(messages)
                    first_gt = seen.get(key)
                    if first_gt is not None:
                        self._duplicate(where, first_gt, gt)
                        continue
                    seen[key] = gt
                kept.append(_Row(messages, gt, source, where))
        return kept

    def _bad_row(self, where: str, e: _BadRow) -> None:
        fmt = "" if self.format == "auto" else f" (format={self.format!r})"
        message = f"{where}: malformed row{fmt}: {e.describe()}"
        if self.on_bad_row == "error":
            raise DatasetError(message + "; pass on_bad_row='skip' (data.on_bad_row=skip) to drop such rows")
        self.stats["bad_rows"] += 1
        if self.stats["bad_rows"] <= _MAX_WARNINGS:
            logger.warning("skipping %s", message)
        elif self.stats["bad_rows"] == _MAX_WARNINGS + 1:
            logger.warning("skipping more malformed rows; the count is in the summary")

    def _duplicate(self, where: str, first_gt: str, gt: str) -> None:
        self.stats["duplicates"] += 1
        if gt != first_gt:
            self.stats["conflicting_duplicates"] += 1
            if self.stats["conflicting_duplicates"] <= _MAX_WARNINGS:
                logger.warning(
                    "%s: duplicate prompt with ground truth %r, the first occurrence has %r; keeping the first",
                    where,
                    gt,
                    first_gt,
                )

    def _render(self, rows: list[_Row], tokenizer: Any) -> list[Prompt]:
        """Chat template + tokenization of the kept rows; drop (and count) those over max_prompt_length."""
        texts = []
        for row in rows:
            try:
                text = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template may reject a role or a message order: say which row
                raise DatasetError(f"{row.where}: the tokenizer's chat template failed on this prompt: {e}") from e
            if not isinstance(text, str):
                raise DatasetError(f"tokenizer.apply_chat_template(tokenize=False) returned {type(text).__name__}")
            texts.append(text)
        prompts: list[Prompt] = []
        for start in range(0, len(texts), _TOKENIZE_BATCH):
            batch = texts[start : start + _TOKENIZE_BATCH]
            ids_batch = tokenizer(batch, add_special_tokens=False)["input_ids"]
            for row, text, ids in zip(rows[start : start + _TOKENIZE_BATCH], batch, ids_batch):
                if len(ids) > self.max_prompt_length:
                    self.stats["too_long"] += 1
                    continue
                prompts.append(Prompt(len(prompts), row.messages, text, list(ids), row.ground_truth, row.data_source))
        return prompts
