"""Loading a config: defaults <- YAML file <- dotted overrides, merged by OmegaConf structured configs (which check
types), unknown keys rejected with the nearest valid one, the result validated; and the way back to YAML."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_dapo.config.base import ConfigError
from megatron_dapo.config.rules import Config


def _check_keys(node: Any, schema: type, source: str, prefix: str = "") -> None:
    """Reject keys the dataclass tree does not have, suggesting the nearest valid one."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in fields:
            valid = [f"{prefix}{name}" for name in fields]
            near = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys here: {', '.join(valid)}"
            raise ConfigError(f"{source}: unknown config key '{full}'{hint}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{full}' is a section; expected a mapping, got {value!r}")
            _check_keys(value, sub, source, f"{full}.")


def _merge(base: Any, update: dict, source: str) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{source}: config field {key}: {msg}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, type-checked and validated.

    overrides: ["algorithm.eps_high=0.3", "data.train_files=[a.jsonl,b.jsonl]"]
    """
    cfg = OmegaConf.structured(Config)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
        _check_keys(loaded, Config, f"config file {path}")
        cfg = _merge(cfg, loaded, f"config file {path}")
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"command-line override '{item}': expected KEY=VALUE, e.g. algorithm.eps_high=0.28")
        try:
            dotted = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as e:
            raise ConfigError(f"command-line overrides: {str(e).splitlines()[0]}") from None
        _check_keys(dotted, Config, "command-line override")
        cfg = _merge(cfg, dotted, "command-line override")
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config)
    return obj.validate()


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, for logs and checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
