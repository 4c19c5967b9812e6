"""Hugging Face model directories: safetensors in (lazily, tensor by tensor) and out (in shards), and the files
that are not weights (config.json, tokenizer...) that travel with them.

Torch is imported lazily (inside the functions that need it) so the tools answer --help and refuse bad
arguments in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from megatron_dapo.convert.common import ConvertError
from megatron_dapo.model.dtypes import DTYPE_OF_HF_NAME, HF_DTYPE_NAMES

if TYPE_CHECKING:
    import torch

    from megatron_dapo.model.arch import ModelArch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight formats never copied along with the config and tokenizer files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".distcp")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def hf_config_dtype(hf_dir: str | Path, default: str = "bf16") -> str:
    """The dtype a Hugging Face config.json declares ('torch_dtype', or 'dtype' in transformers 5), as 'bf16'|..."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return default
    declared = config.get("dtype") or config.get("torch_dtype")
    return DTYPE_OF_HF_NAME.get(str(declared), default)


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
    hf_name = HF_DTYPE_NAMES[dtype]
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = hf_name
    path.write_text(json.dumps(config, indent=2) + "\n")
