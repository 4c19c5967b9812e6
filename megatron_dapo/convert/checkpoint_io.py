"""Checkpoint files for the conversion tools (and the trainer's checkpoints): HF safetensors in and out,
Megatron distributed checkpoints of the model, and the small metadata file that ties them together.

A converted checkpoint directory (tools/convert_hf_to_megatron.py) looks like this:

    DIR/megatron_dapo.json        CheckpointMeta: family, tp, pp, dtype, source, format version
    DIR/config.json               the Hugging Face files that are not weights, copied verbatim
    DIR/tokenizer*.json, ...      (so DIR alone is enough to go back to Hugging Face)
    DIR/model/                    megatron.core.dist_checkpointing checkpoint of the GPTModel

A training checkpoint (megatron_dapo.checkpoint: run/checkpoints/step_N/dist) holds the same kind of model
dist checkpoint, next to the optimizer's, but no config.json or tokenizer: resolve_megatron_checkpoint finds
them (--hf-config, else model.hf_path in run/config.yaml), so the conversion tool reads either kind.

Torch is imported lazily (inside the functions that need it) so the tools answer --help and refuse bad
arguments in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from megatron_dapo.model.arch import ModelArch

FORMAT_NAME = "megatron_dapo.dist_checkpoint"
FORMAT_VERSION = 1
META_FILE = "megatron_dapo.json"
MODEL_SUBDIR = "model"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPE_NAMES = ("bf16", "fp16", "fp32")
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Weight formats never copied along with the config and tokenizer files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".distcp")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


class ConvertError(ValueError):
    """A checkpoint we cannot read or write: the message names the file (and tensor or field) at fault."""


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' -> torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def hf_config_dtype(hf_dir: str | Path, default: str = "bf16") -> str:
    """The dtype a Hugging Face config.json declares ('torch_dtype', or 'dtype' in transformers 5), as 'bf16'|..."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return default
    declared = config.get("dtype") or config.get("torch_dtype")
    return _HF_DTYPES.get(str(declared), default)


def format_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as Hugging Face shard sizes)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (Hugging Face's max_shard_size syntax)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise ConvertError(f"size '{text}' is not understood; expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    number, unit = float(m.group(1)), m.group(2).rstrip("B") or ""
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale:
        raise ConvertError(f"size '{text}' has an unknown unit; expected KB, MB, GB, KiB, MiB or GiB")
    size = int(number * scale[unit])
    if size <= 0:
        raise ConvertError(f"size '{text}' must be positive")
    return size


# ---------------------------------------------------------------- directories and metadata


def prepare_output_dir(out: str | Path, force: bool, keep: tuple[str | Path, ...] = (), clear: bool = False) -> Path:
    """Check (and with clear=True, empty and create) an output directory.

    Refuses a non-empty directory unless force, and refuses outright a directory that is or contains one of
    `keep` (the input), which --force would otherwise delete. Call with clear=False to validate only.
    """
    out = Path(out).absolute()
    for k in keep:
        k = Path(k).resolve()
        if out.resolve() == k or out.resolve() in k.parents:
            raise ConvertError(f"--out {out} is (or contains) the input directory {k}; choose another directory")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConvertError(f"--out {out} is not empty; pass --force to replace its contents")
        if clear:
            for child in out.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    if clear:
        out.mkdir(parents=True, exist_ok=True)
    return out


def copy_non_weight_files(src: str | Path, dst: str | Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the top-level files of src that are not weights (config, generation config, tokenizer, README...).

    Weight files and their indexes, hidden files, subdirectories and the names in `skip` stay behind.
    Returns the copied file names.
    """
    copied = []
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name in skip or f.name in _WEIGHT_INDEXES:
            continue
        if f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(f, Path(dst) / f.name)
        copied.append(f.name)
    return copied


@dataclass
class CheckpointMeta:
    """What megatron_dapo.json says about a Megatron checkpoint directory."""

    family: str
    """Model family, 'qwen2' or 'llama' (ModelArch.family)."""
    tp: int
    """Tensor-parallel size it was saved from (any other loads it: dist_checkpointing reshards)."""
    pp: int
    """Pipeline-parallel size it was saved from."""
    dtype: str
    """Parameter dtype of the saved model: 'bf16', 'fp16' or 'fp32'."""
    source: str = ""
    """Where the weights came from (the Hugging Face directory, or a training run)."""
    model_dir: str = MODEL_SUBDIR
    """The dist checkpoint's directory, relative to the checkpoint directory."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form additions (megatron-core version, creation time, training step...)."""


def write_metadata(ckpt_dir: str | Path, meta: CheckpointMeta) -> Path:
    """Write ckpt_dir/megatron_dapo.json."""
    path = Path(ckpt_dir) / META_FILE
    path.write_text(json.dumps(asdict(meta), indent=2) + "\n")
    return path


def read_metadata(ckpt_dir: str | Path) -> CheckpointMeta:
    """Read ckpt_dir/megatron_dapo.json; a ConvertError names the file when the directory is not one of ours."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / META_FILE
    if not ckpt_dir.is_dir():
        raise ConvertError(f"checkpoint directory {ckpt_dir} does not exist")
    if not path.is_file():
        hint = (
            " (it looks like a Hugging Face model: use convert_hf_to_megatron.py)"
            if any(ckpt_dir.glob("*.safetensors"))
            else ""
        )
        raise ConvertError(
            f"{ckpt_dir} is not a megatron-dapo checkpoint: {path.name} is missing{hint}; "
            "create one with tools/convert_hf_to_megatron.py"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ConvertError(
            f"{path}: field 'format' is {raw.get('format') if isinstance(raw, dict) else raw!r}, "
            f"expected '{FORMAT_NAME}'"
        )
    if raw.get("format_version") != FORMAT_VERSION:
        raise ConvertError(
            f"{path}: field 'format_version'={raw.get('format_version')!r} is not supported; expected {FORMAT_VERSION}"
        )
    try:
        meta = CheckpointMeta(**raw)
    except TypeError as e:
        raise ConvertError(f"{path}: {e}") from None
    if meta.dtype not in DTYPE_NAMES:
        raise ConvertError(f"{path}: field 'dtype'={meta.dtype!r}, expected one of {DTYPE_NAMES}")
    if not (ckpt_dir / meta.model_dir / "metadata.json").is_file():
        raise ConvertError(
            f"{path}: field 'model_dir' names {ckpt_dir / meta.model_dir}, which holds no Megatron distributed "
            "checkpoint (metadata.json is missing)"
        )
    return meta


# ---------------------------------------------------------------- any Megatron checkpoint: converted or training

RUN_CONFIG = "config.yaml"
"""What megatron_dapo.train writes into its run directory; model.hf_path names the HF model the run started from."""
_COMPLETE = "COMPLETE"  # megatron_dapo.checkpoint's marker of a finished save


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


def training_step_dir(path: str | Path) -> Path | None:
    """The complete training checkpoint (step_N directory) that path names; None when it holds none at all.

    path is a step_N directory, a run directory or its checkpoints/ (megatron_dapo.checkpoint's layout): of a
    run, the step its `latest` file names, else the newest complete one. Raises ConvertError naming the path
    for a step_N directory without its COMPLETE marker, and for a run whose every step lacks one.
    """
    path = Path(path)
    if (path / _COMPLETE).is_file() or (path / "dist").is_dir():
        if not (path / _COMPLETE).is_file():
            raise ConvertError(
                f"{path} is an incomplete training checkpoint (no {_COMPLETE} marker: its save did not finish); "
                "convert a complete step, or the run directory for the newest complete one"
            )
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if not steps and not (root / "latest").is_file():
        return None
    from megatron_dapo.checkpoint import CheckpointManager

    step = next((p for p in CheckpointManager(root).candidates() if (p / _COMPLETE).is_file()), None)
    if step is None:
        raise ConvertError(
            f"{root} holds no complete training checkpoint: {', '.join(steps) or 'no step_N directory'} "
            f"(none has a {_COMPLETE} marker: their saves did not finish)"
        )
    return step


def _saved_dtype(dist_dir: Path) -> str:
    """The parameter dtype a model dist checkpoint stores (its embedding's), as 'bf16' | 'fp16' | 'fp32'."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (dist_dir / "metadata.json").is_file():
        raise ConvertError(f"{dist_dir} is not a Megatron distributed checkpoint: metadata.json is missing")
    key = "embedding.word_embeddings.weight"
    try:
        stored = FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata[key]
    except KeyError:
        raise ConvertError(f"{dist_dir}: the distributed checkpoint holds no '{key}': not a GPT model") from None
    except Exception as e:  # an unreadable .metadata: pickle, OS errors...
        raise ConvertError(f"{dist_dir}: cannot read the distributed checkpoint's metadata: {e}") from None
    name = str(stored.properties.dtype).removeprefix("torch.")
    if name not in _HF_DTYPES:
        raise ConvertError(f"{dist_dir}: '{key}' is stored as {name}, expected one of {sorted(_HF_DTYPES)}")
    return _HF_DTYPES[name]


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
        hint = (
            " (it looks like a Hugging Face model: use convert_hf_to_megatron.py)"
            if any(path.glob("*.safetensors"))
            else ""
        )
        raise ConvertError(
            f"{path} is not a megatron-dapo checkpoint: {META_FILE} is missing{hint}, and it is no training "
            "checkpoint either (a run directory, its checkpoints/ or a step_N/ with dist/ and COMPLETE)"
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
    dtype = _saved_dtype(dist_dir)
    ranks = (step / _COMPLETE).read_text().strip() or "?"
    par = run.get("parallel") or {}
    layout = f" at tp={par['tp']} pp={par['pp']}" if "tp" in par and "pp" in par else ""
    saved = f"training checkpoint {step.name}, saved by {ranks} rank(s){layout}"
    return MegatronSource(dist_dir, hf_dir, arch, dtype, saved, step=step)


# ---------------------------------------------------------------- Hugging Face safetensors in


class SafetensorsReader(Mapping):
    """The tensors of a Hugging Face model directory as a lazy, read-only Mapping[str, Tensor].

    Handles a single model.safetensors, several *.safetensors, or shards listed in
    model.safetensors.index.json. Only headers are read up front; `reader[name]` reads that one tensor
    (safetensors memory-maps the file), `shape(name)` and `meta(name)` read nothing.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self._handles: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConvertError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from None
            for name, file in weight_map.items():
                self.file_of[name] = self.dir / file
            for file in sorted(set(self.file_of.values())):
                if not file.is_file():
                    raise ConvertError(f"{index} lists the shard {file.name}, which is missing from {self.dir}")
                self._open(file)  # a truncated or damaged shard fails here, named, not deep inside a load
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                found = ", ".join(sorted(f.name for f in self.dir.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES)))
                also = f" (found {found}: only safetensors are read; re-save with safe_serialization)" if found else ""
                raise ConvertError(f"no *.safetensors weights in {self.dir}{also}")
            for file in files:
                for name in self._open(file).keys():
                    self.file_of[name] = file

    def _open(self, file: Path):
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ConvertError(f"{file}: cannot read safetensors file: {e}") from None
        return self._handles[file]

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.file_of.values()))

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file header alone."""
        return tuple(self._open(self.file_of[name]).get_slice(name).get_shape())

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device stand-in with the tensor's shape: conversions run on it without reading data."""
        import torch

        return torch.empty(self.shape(name), device="meta")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(name)
        return self._open(self.file_of[name]).get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


class _PartialView(Mapping):
    """reader's real tensors for the names `wanted` accepts, meta stand-ins for every other one; records accesses."""

    def __init__(self, reader: SafetensorsReader, wanted: Callable[[str], bool]) -> None:
        self.reader, self.wanted, self.accessed = reader, wanted, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.accessed.add(name)
        return self.reader[name] if self.wanted(name) else self.reader.meta(name)

    def __contains__(self, name: object) -> bool:
        return name in self.reader

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader)

    def __len__(self) -> int:
        return len(self.reader)


def check_hf_tensors(reader: SafetensorsReader, arch: ModelArch) -> list[str]:
    """Names and shapes of every tensor the arch needs, from the headers alone (no data is read).

    Raises ConvertError naming the tensor (and both shapes) for a missing or mis-shaped one; returns the
    names of the tensors the conversion will not use (e.g. lm_head.weight of a tied model).
    """
    from megatron_dapo.convert.layouts import hf_to_megatron

    view = _PartialView(reader, wanted=lambda name: False)
    try:
        hf_to_megatron(view, arch)
    except KeyError as e:
        raise ConvertError(f"{reader.dir}: {e.args[0]}") from None
    except ValueError as e:
        raise ConvertError(f"{reader.dir}: {e}") from None
    return sorted(set(reader) - view.accessed)


_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MEGATRON_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
# Megatron name -> HF name of the tensors outside the layers (a group of their own each).
_NON_LAYER = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _hf_group(hf_name: str) -> str:
    m = _HF_LAYER_RE.match(hf_name)
    return f"layer{m.group(1)}" if m else hf_name


def _megatron_group(name: str) -> str:
    m = _MEGATRON_LAYER_RE.match(name)
    return f"layer{m.group(1)}" if m else _NON_LAYER.get(name, name)


class LazyMegatronWeights(Mapping):
    """Full Megatron tensors (convert.layouts.hf_to_megatron names and layouts) built on demand from HF files.

    Hand it to provider.load_full_weights: each rank then reads only the HF tensors of the parameters it
    holds. Tensors are built one group (a layer, or the embedding, final norm or output layer) at a time
    and only the last group is cached, so memory stays at one layer beyond the model itself when the
    names are asked for in model order.
    """

    def __init__(self, reader: SafetensorsReader, arch: ModelArch) -> None:
        from megatron_dapo.convert.layouts import megatron_names

        self.reader, self.arch = reader, arch
        self.names = megatron_names(arch)
        self._group: str | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        from megatron_dapo.convert.layouts import hf_to_megatron

        if name not in self.names:
            raise KeyError(name)
        group = _megatron_group(name)
        if group != self._group:
            self._cache, self._group = {}, None  # free the previous group before reading the next
            view = _PartialView(self.reader, wanted=lambda hf_name: _hf_group(hf_name) == group)
            full = hf_to_megatron(view, self.arch)
            self._cache = {k: v for k, v in full.items() if _megatron_group(k) == group}
            self.bytes_read += sum(v.numel() * v.element_size() for v in self._cache.values())
            self._group = group
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# ---------------------------------------------------------------- Hugging Face safetensors out


class ShardWriter:
    """Writes named tensors into Hugging Face safetensors shards of at most max_shard_bytes each.

    Tensors are cast to `dtype` and copied as they arrive (so they never alias the model or each
    other); a shard is written as soon as the next tensor would not fit, so at most one shard is
    held. A tensor larger than max_shard_bytes gets a shard of its own (as transformers does).
    `close()` names the files model-0000i-of-0000n.safetensors with model.safetensors.index.json, or
    model.safetensors alone when everything fits in one.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int, dtype: torch.dtype) -> None:
        self.out_dir, self.max_shard_bytes, self.dtype = Path(out_dir), max_shard_bytes, dtype
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ConvertError(f"tensor '{name}' written twice")
        t = tensor.detach().to(device="cpu", dtype=self.dtype, copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".shard-{len(self._written):05d}.safetensors.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})  # transformers checks "format"
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give every shard its final name and write the index; returns the files."""
        if self._pending:
            self._flush()
        n = len(self._written)
        if n == 0:
            raise ConvertError("no tensors to write")
        if n == 1:
            final = self.out_dir / SINGLE_FILE
            os.replace(self._written[0][0], final)
            return [final]
        files, weight_map = [], {}
        for i, (tmp, names) in enumerate(self._written):
            final = self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files


def set_config_dtype(config_path: str | Path, dtype: str) -> None:
    """Rewrite the dtype a copied config.json declares to the dtype the weights were written in."""
    path = Path(config_path)
    config = json.loads(path.read_text())
    hf_name = {v: k for k, v in _HF_DTYPES.items()}[dtype]
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = hf_name
    path.write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------- Megatron dist checkpoints


def _unwrap(chunk):
    """Megatron's DDP wrapper has no sharded_state_dict: use the module inside."""
    return chunk.module if hasattr(chunk, "module") else chunk


def model_sharded_state_dict(chunks: list) -> dict:
    """The chunks' sharded state dict, Megatron-LM's layout: {'model': ...} or {'model0': ..., 'model1': ...}.

    Tensor keys in it are global (layer numbers across pipeline stages and virtual chunks), so a
    checkpoint loads into any TP/PP/VPP layout.
    """
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


@contextlib.contextmanager
def in_process_write_results():
    """Let a synchronous torch_dist save hand its write results over in this process.

    Megatron's default channel is a queue in a spawned multiprocessing Manager, which must import torch
    to unpickle the results: ~4 s per process on CPU, and it re-imports __main__. A synchronous save
    puts and gets them in the calling process, so a plain queue does; the default is restored after.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:  # another megatron-core layout: keep its default
        yield
        return
    if getattr(fsa, "_results_queue", 0) is not None:  # already made (or renamed): leave it alone
        yield
        return
    fsa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fsa._results_queue = None


def save_megatron_checkpoint(chunks: list, ckpt_dir: str | Path) -> float:
    """dist_checkpointing.save of the model chunks into ckpt_dir (created; collective: every rank calls).

    Synchronous. Returns the seconds it took. The directory should be empty: Megatron only warns when
    it is not.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with in_process_write_results():
        dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))
    dist.barrier()
    return time.perf_counter() - t0


def _first_failure(e: Exception) -> str:
    """The message of the first rank's failure inside torch DCP's CheckpointException (else of e itself)."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        return str(first[0] if isinstance(first, tuple) else first)
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def load_megatron_checkpoint(chunks: list, ckpt_dir: str | Path) -> float:
    """Load a model dist checkpoint into chunks of any TP/PP layout (collective: every rank calls).

    ckpt_dir is the dist checkpoint itself, or a converted checkpoint directory holding megatron_dapo.json
    (then its model/ is loaded). Vocabulary padding may differ from the saved layout's (Megatron zero-fills
    the difference); the local and Transformer Engine layer specs store the same keys. Returns seconds.
    """
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / META_FILE).is_file():
        ckpt_dir = ckpt_dir / read_metadata(ckpt_dir).model_dir
    if not (ckpt_dir / "metadata.json").is_file():
        raise ConvertError(f"{ckpt_dir} is not a Megatron distributed checkpoint: metadata.json is missing")
    sharded = model_sharded_state_dict(chunks)
    with torch.no_grad():
        try:
            loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
        except (CheckpointingException, CheckpointException, KeyError) as e:  # e.g. a shape from another config
            raise ConvertError(f"{ckpt_dir}: the checkpoint does not fit this model: {_first_failure(e)}") from e
        for key, chunk in zip(sharded, chunks):
            _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    return time.perf_counter() - t0
