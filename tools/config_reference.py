"""The Markdown configuration reference, generated from the config dataclasses and their field docstrings.

    python tools/config_reference.py                         # print it
    python tools/config_reference.py --write docs/config.md  # replace the text between the markers in docs/config.md
    python tools/config_reference.py --write                 # the same: docs/config.md is the default target

The markers are `<!-- config-reference:begin -->` and `<!-- config-reference:end -->`. Each section of
megatron_dapo/config/ becomes a table (key, type, default, meaning); the meaning is the string literal that
follows the field, the same docstrings tests/test_config.py requires. tests/test_examples.py checks that
docs/config.md holds what this prints.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import typing
from pathlib import Path

from megatron_dapo.cli import argument_parser
from megatron_dapo.config import Config, field_docs

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"
DEFAULT_TARGET = Path(__file__).resolve().parent.parent / "docs" / "config.md"
"""Where the reference lives (the README links to it): what --write without a FILE replaces."""


def type_name(tp: typing.Any) -> str:
    """int, float or null, list[str], ... as a config file writes them."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:  # Optional[X]
        return f"{type_name(next(a for a in args if a is not type(None)))} or null"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(args[0])}]"
    return tp.__name__


def default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return json.dumps(value)  # JSON scalars and lists are valid YAML: null, true, "auto", []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_table(cls: type, prefix: str) -> list[str]:
    """Rows for the non-section fields of cls, keys written as prefix + name."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows = ["| Key | Type | Default | Meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        rows.append(
            f"| `{prefix}{f.name}` | {type_name(hints[f.name])} | `{_cell(default_text(f))}` | {_cell(docs[f.name])} |"
        )
    return rows


def render() -> str:
    """The whole reference: the top-level fields, then one table per section in declaration order."""
    lines = ["### Top level", "", *section_table(Config, "")]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        section = hints[f.name]
        if dataclasses.is_dataclass(section):
            summary = inspect.getdoc(section).splitlines()[0]
            lines += ["", f"### `{f.name}`: {summary}", "", *section_table(section, f"{f.name}.")]
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, block: str, source: str = "the file") -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{source}: expected a line {BEGIN} followed later by a line {END}")
    return f"{text[: start + len(BEGIN)]}\n{block}{text[end:]}"


def main(argv: list[str] | None = None) -> None:
    ap = argument_parser(__doc__)
    ap.add_argument(
        "--write",
        metavar="FILE",
        nargs="?",
        const=str(DEFAULT_TARGET),
        help="replace the text between the markers in FILE (docs/config.md when FILE is left out) instead of printing",
    )
    args = ap.parse_args(argv)
    reference = render()
    if args.write is None:
        sys.stdout.write(reference)
        return
    path = Path(args.write)
    path.write_text(replace_between_markers(path.read_text(), reference, str(path)))


if __name__ == "__main__":
    main()
