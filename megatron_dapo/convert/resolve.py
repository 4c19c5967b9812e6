"""Which Megatron checkpoint a path names: a converted one (megatron_io) or a training one, resolved to what a
conversion reads (resolve_megatron_checkpoint), and the training checkpoints' directory layout.

A training checkpoint (megatron_dapo.checkpoint: run/checkpoints/step_N/dist) holds the same kind of model
dist checkpoint, next to the optimizer's, but no config.json or tokenizer: resolve_megatron_checkpoint finds
them (--hf-config, else model.hf_path in run/config.yaml), so the conversion tool reads either kind.
The layout is defined here, below megatron_dapo.checkpoint, which writes it: conversion reads it without
importing the trainer's side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.convert.common import ConvertError
from megatron_dapo.convert.megatron_io import META_FILE, hf_model_hint, read_metadata, saved_dtype

if TYPE_CHECKING:
    from megatron_dapo.model.arch import ModelArch

RUN_CONFIG = "config.yaml"
"""What megatron_dapo.train writes into its run directory; model.hf_path names the HF model the run started from."""
COMPLETE = "COMPLETE"
"""The marker file of a finished training checkpoint save (step_N/COMPLETE, holding the world size)."""
LATEST = "latest"
"""The file in a checkpoints/ directory that names its newest complete step_N, replaced last on save."""


class UnsafeCheckpoint(ConvertError):
    """A checkpoint's state file names code to run: refused, nothing of it run."""


def rank_state_file(step_dir: str | Path, rank: int) -> Path:
    """step_N/state/rankRRRRR.pt: rank's scheduler, RNG states and trainer state (megatron_dapo.checkpoint)."""
    return Path(step_dir) / "state" / f"rank{rank:05d}.pt"


def read_rank_state(path: Any) -> dict[str, Any]:
    """A rank's state file (a path, or a file object), read by torch's weights-only unpickler allowed megatron_dapo/safe_pickle.py's list
    (tensors, plain containers, numpy arrays, the project's records): a file naming anything else is refused
    (UnsafeCheckpoint, one line naming the file and what it named), nothing of it run."""
    import pickle
    import re

    import torch

    from megatron_dapo import safe_pickle

    with torch.serialization.safe_globals(safe_pickle.allowed_objects()):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL ([\w.]+)", str(e))
            raise UnsafeCheckpoint(
                f"{path}: refused to load: it names {named.group(1) if named else 'something'} to run, which no "
                "megatron-dapo checkpoint holds (only tensors, plain data, numpy arrays and its own records); "
                "nothing of it was run. A checkpoint from elsewhere: remove it, or start in another trainer.run_dir"
            ) from None


@dataclass
class MegatronSource:
    """A Megatron checkpoint resolved to what a conversion reads (resolve_megatron_checkpoint)."""

    dist_dir: Path
    """The model's distributed checkpoint: model/ of a converted checkpoint, step_N/dist of a training one."""
    hf_dir: Path
    """The directory whose config.json and tokenizer files go with the weights."""
    arch: ModelArch
    dtype: str
    """Parameter dtype of the saved model: 'bf16', 'fp16' or 'fp32'."""
    saved: str
    """For logs: 'saved at tp=2 pp=1', or 'training checkpoint step_00000010, saved by 2 rank(s) at tp=2 pp=1'."""
    step: Path | None = None
    """The step_N directory of a training checkpoint; None for a converted one."""


def complete_steps(root: str | Path) -> list[Path]:
    """The complete training checkpoints (step_N directories with a COMPLETE marker) under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file())


def step_candidates(root: str | Path) -> list[Path]:
    """What a resume tries, in order: the step `latest` names, then the other complete ones, newest first."""
    root = Path(root)
    complete = complete_steps(root)[::-1]
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        return [named] + [p for p in complete if p != named]
    return complete


def training_step_dir(path: str | Path) -> Path | None:
    """The complete training checkpoint (step_N directory) that path names; None when it holds none at all.

    path is a step_N directory, a run directory or its checkpoints/ (megatron_dapo.checkpoint's layout): of a
    run, the step its `latest` file names, else the newest complete one. Raises ConvertError naming the path
    for a step_N directory without its COMPLETE marker, and for a run whose every step lacks one.
    """
    path = Path(path)
    if (path / COMPLETE).is_file() or (path / "dist").is_dir():
        if not (path / COMPLETE).is_file():
            raise ConvertError(
                f"{path} is an incomplete training checkpoint (no {COMPLETE} marker: its save did not finish); "
                "convert a complete step, or the run directory for the newest complete one"
            )
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if not steps and not (root / LATEST).is_file():
        return None
    step = next((p for p in step_candidates(root) if (p / COMPLETE).is_file()), None)
    if step is None:
        raise ConvertError(
            f"{root} holds no complete training checkpoint: {', '.join(steps) or 'no step_N directory'} "
            f"(none has a {COMPLETE} marker: their saves did not finish)"
        )
    return step


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as plain YAML ({} without one): read raw, so older or newer configs still do."""
    import yaml

    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConvertError(f"{path}: cannot read the run's config: {e}") from None
    return loaded if isinstance(loaded, dict) else {}


def resolve_megatron_checkpoint(path: str | Path, hf_config: str | Path | None = None) -> MegatronSource:
    """What tools/convert_megatron_to_hf.py reads from path, whichever kind of Megatron checkpoint it is.

    A converted checkpoint (megatron_dapo.json, from tools/convert_hf_to_megatron.py) carries its own
    config.json and tokenizer. A training checkpoint (a run directory, its checkpoints/ or one step_N:
    training_step_dir) carries weights only: its config.json and tokenizer come from hf_config, else from
    the HF directory model.hf_path names in the run's config.yaml (run/checkpoints/step_N -> run/config.yaml).
    Raises ConvertError (or ArchError) naming the path when path is neither, a step is incomplete, or no
    config.json can be found.
    """
    from megatron_dapo.model.arch import ModelArch

    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"checkpoint directory {path} does not exist")
    if (path / META_FILE).is_file():
        if hf_config is not None:
            raise ConvertError(
                f"--hf-config is for training checkpoints: {path} is a converted checkpoint ({META_FILE}) "
                "with its own config.json and tokenizer"
            )
        meta = read_metadata(path)
        arch = ModelArch.from_hf_dir(path)  # the checkpoint's copy of config.json
        if arch.family != meta.family:
            raise ConvertError(
                f"{path}: {META_FILE} says family '{meta.family}' but config.json describes a '{arch.family}' model"
            )
        return MegatronSource(path / meta.model_dir, path, arch, meta.dtype, f"saved at tp={meta.tp} pp={meta.pp}")

    step = training_step_dir(path)
    if step is None:
        raise ConvertError(
            f"{path} is not a megatron-dapo checkpoint: {META_FILE} is missing{hf_model_hint(path)}, and it is no "
            "training checkpoint either (a run directory, its checkpoints/ or a step_N/ with dist/ and COMPLETE)"
        )
    run_dir = step.parent.parent
    run = _run_config(run_dir)
    if hf_config is not None:
        hf_dir, origin = Path(hf_config), "--hf-config"
    else:
        hf_path = (run.get("model") or {}).get("hf_path")
        if not hf_path:
            why = "names no model.hf_path" if run else "does not exist"
            raise ConvertError(
                f"{step}: a training checkpoint holds no config.json or tokenizer, and {run_dir / RUN_CONFIG} {why}: "
                "pass --hf-config DIR (the Hugging Face model the run started from)"
            )
        hf_dir, origin = Path(hf_path), f"model.hf_path in {run_dir / RUN_CONFIG}"
    if not (hf_dir / "config.json").is_file():
        how = "" if hf_config is not None else " (pass it with --hf-config DIR)"
        raise ConvertError(
            f"{origin} names {hf_dir}, which has no config.json: the training checkpoint {step} needs the "
            f"Hugging Face model directory the run started from{how}"
        )
    arch = ModelArch.from_hf_dir(hf_dir)
    dist_dir = step / "dist"
    dtype = saved_dtype(dist_dir)
    ranks = (step / COMPLETE).read_text().strip() or "?"
    par = run.get("parallel") or {}
    layout = f" at tp={par['tp']} pp={par['pp']}" if "tp" in par and "pp" in par else ""
    saved = f"training checkpoint {step.name}, saved by {ranks} rank(s){layout}"
    return MegatronSource(dist_dir, hf_dir, arch, dtype, saved, step=step)
