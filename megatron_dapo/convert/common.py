"""What the conversion modules and tools share: their error type, output directories and byte sizes.

Imports nothing heavy, so the tools answer --help and refuse bad arguments in a fraction of a second.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path


class ConvertError(ValueError):
    """A checkpoint we cannot read or write: the message names the file (and tensor or field) at fault."""


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
