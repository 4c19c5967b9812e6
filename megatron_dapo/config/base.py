"""What every section module shares: the config's error, the check that raises it, and the field docstrings."""

from __future__ import annotations

import ast
import inspect
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run: the message names the source, the field and what was expected."""


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of a config dataclass: the string literal right after each field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        node.target.id: inspect.cleandoc(nxt.value.value)
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    """Unless ok, raise ConfigError naming the field, its value and what was expected."""
    if not ok:
        raise ConfigError(f"config field {key}={value!r}: expected {expected}")


def either(values: tuple[str, ...]) -> str:
    """'a, b or c': a short list of allowed values, as an error's expectation names them."""
    return f"{', '.join(values[:-1])} or {values[-1]}"
