"""Files cut into pieces of at most a given size, the manifest that checks them, and their reassembly.

A file larger than a piece travels as byte ranges; manifest.json records every file's size and sha256 and every
chunk's piece, offset, size and sha256, so each piece is checked on arrival and each file after reassembly; the
same checks, reassembly and zip test serve both sets (`wheels`: gpu_stage/, `te`: te_stage/pieces/). Standard
library only (it runs on a GPU node before anything is installed there).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

MIB = 1 << 20
PIECE_MIB = 60
"""The largest piece by default (--piece-mib), for both sets."""


def sha256_of(path: Path, offset: int = 0, size: int | None = None) -> str:
    """sha256 of size bytes of path from offset (the whole rest of the file when size is None)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left is None or left > 0:
            block = f.read(MIB if left is None else min(MIB, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h.hexdigest()


def plan_pieces(files: list[tuple[str, int]], piece_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Pack files [(name, size)] into pieces of at most piece_bytes: [[(name, offset, size) chunk, ...], ...].

    A file larger than a piece is cut into piece-sized byte ranges (the last range may share its piece); the
    chunks are then placed first-fit in decreasing size order. Deterministic for the same input.
    """
    chunks = []
    for name, size in files:
        offsets = range(0, max(size, 1), piece_bytes)
        chunks += [(name, off, min(piece_bytes, size - off)) for off in offsets]
    chunks.sort(key=lambda c: (-c[2], c[0], c[1]))
    pieces: list[list[tuple[str, int, int]]] = []
    used: list[int] = []
    for chunk in chunks:
        for i in range(len(pieces)):
            if used[i] + chunk[2] <= piece_bytes:
                pieces[i].append(chunk)
                used[i] += chunk[2]
                break
        else:
            pieces.append([chunk])
            used.append(chunk[2])
    return pieces


def write_pieces(src: Path, out: Path, files: list[Path], piece_bytes: int, meta: dict) -> dict:
    """Cut files into out/part_NN/ folders and return the manifest (meta plus files, chunks and pieces)."""
    for old in out.glob("part_*"):
        shutil.rmtree(old)
    sizes = {f.name: f.stat().st_size for f in files}
    plan = plan_pieces(sorted(sizes.items()), piece_bytes)
    entries = {
        name: {"name": name, "size": size, "sha256": sha256_of(src / name), "chunks": []}
        for name, size in sizes.items()
    }
    pieces = {}
    for i, chunks in enumerate(plan, 1):
        piece = f"part_{i:02d}"
        (out / piece).mkdir(parents=True)
        for name, offset, size in chunks:
            # a whole file travels under its own name, a byte range as name.partK (K: its index in the file)
            travel = name if size == sizes[name] else f"{name}.part{offset // piece_bytes:02d}"
            with open(src / name, "rb") as f, open(out / piece / travel, "wb") as g:
                f.seek(offset)
                g.write(f.read(size))
            entries[name]["chunks"].append(
                {
                    "piece": piece,
                    "file": travel,
                    "offset": offset,
                    "size": size,
                    "sha256": sha256_of(out / piece / travel),
                }
            )
        pieces[piece] = {"bytes": sum(c[2] for c in chunks), "chunks": len(chunks)}
    for entry in entries.values():
        entry["chunks"].sort(key=lambda c: c["offset"])
    manifest = dict(meta, piece_bytes=piece_bytes, files=[entries[n] for n in sorted(entries)], pieces=pieces)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def load_manifest(
    stage: Path, expected: str = "run `python tools/offline_install wheels stage` on the login node and copy it"
) -> dict:
    """stage/manifest.json; a missing one is one error line saying what was expected there."""
    path = stage / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: {expected}")
    return json.loads(path.read_text())


def check_chunk(path: Path, chunk: dict) -> str | None:
    """Why the chunk at path is wrong, or None when its size and sha256 match the manifest."""
    if not path.is_file():
        return "missing"
    if path.stat().st_size != chunk["size"]:
        return f"{path.stat().st_size} bytes, expected {chunk['size']}"
    if sha256_of(path) != chunk["sha256"]:
        return "sha256 differs"
    return None


def reassemble(manifest: dict, find_chunk, out: Path) -> list[Path]:
    """Join every file's chunks (find_chunk(chunk) -> its path) into out; raise if a size or sha256 differs."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for entry in manifest["files"]:
        dst = out / entry["name"]
        with open(dst, "wb") as g:
            for chunk in entry["chunks"]:
                g.write(find_chunk(chunk).read_bytes())
        if dst.stat().st_size != entry["size"] or sha256_of(dst) != entry["sha256"]:
            raise RuntimeError(f"{entry['name']}: reassembled file differs from the original (size or sha256)")
        paths.append(dst)
    return paths


def check_layout(manifest: dict, pieces: Path) -> list[str]:
    """Problems found without reading the data: each file's chunks cover it exactly, every chunk is present at its
    size, no piece over the limit (in the manifest or on disk). Fast enough for every test run."""
    problems = []
    for entry in manifest["files"]:
        pos = 0
        for c in entry["chunks"]:
            if c["offset"] != pos:
                problems.append(f"{entry['name']}: chunk {c['file']} starts at {c['offset']}, expected {pos}")
            pos = c["offset"] + c["size"]
            path = pieces / c["piece"] / c["file"]
            if not (pieces / c["piece"]).is_dir():
                problems.append(f"{c['piece']}: piece folder missing (expected {path})")
            elif not path.is_file():
                problems.append(f"{c['piece']}/{c['file']}: missing from piece {c['piece']}")
            elif path.stat().st_size != c["size"]:
                problems.append(f"{c['piece']}/{c['file']}: {path.stat().st_size} bytes, expected {c['size']}")
        if pos != entry["size"]:
            problems.append(f"{entry['name']}: chunks cover {pos} bytes, expected {entry['size']}")
    for piece, info in manifest["pieces"].items():
        on_disk = sum(p.stat().st_size for p in (pieces / piece).iterdir()) if (pieces / piece).is_dir() else 0
        for size in (info["bytes"], on_disk):
            if size > manifest["piece_bytes"]:
                problems.append(f"{piece}: {size} bytes, over the {manifest['piece_bytes']}-byte limit")
    return sorted(set(problems))


def check_all(manifest: dict, pieces: Path, out: Path) -> list[str]:
    """Every chunk's size and sha256, then reassembly into out with every file's sha256, then a zip test."""
    problems = check_layout(manifest, pieces)
    for entry in manifest["files"]:
        for c in entry["chunks"]:
            why = check_chunk(pieces / c["piece"] / c["file"], c)
            if why and why != "missing":  # missing is already reported, with its piece
                problems.append(f"{c['piece']}/{c['file']}: {why} (piece {c['piece']} is corrupt: copy it again)")
    if problems:
        return sorted(set(problems))
    try:
        paths = reassemble(manifest, lambda c: pieces / c["piece"] / c["file"], out)
    except RuntimeError as e:
        return [str(e)]
    for path in paths:
        if path.suffix == ".whl":
            try:
                with zipfile.ZipFile(path) as z:
                    bad = z.testzip()
            except zipfile.BadZipFile as e:
                bad = f"not a zip file ({e})"
            if bad is not None:
                problems.append(f"{path.name}: expected a valid wheel (zip), member {bad} is corrupt")
    return problems


def write_checksum_lists(manifest: dict, out: Path) -> None:
    """out/chunks.sha256 (every chunk, as piece/file) and out/wheels.sha256 (every file, as wheels/name): what
    `sha256sum -c` checks on a node without Python (the reassembled files in out/wheels)."""
    chunks = [f"{c['sha256']}  {c['piece']}/{c['file']}" for e in manifest["files"] for c in e["chunks"]]
    (out / "chunks.sha256").write_text("\n".join(chunks) + "\n")
    (out / "wheels.sha256").write_text("".join(f"{e['sha256']}  wheels/{e['name']}\n" for e in manifest["files"]))


def missing_chunks(manifest: dict, recv: Path, piece: str) -> list[str]:
    """The chunks of a piece not yet received (in recv, at their full size)."""
    return [
        c["file"]
        for e in manifest["files"]
        for c in e["chunks"]
        if c["piece"] == piece and not ((recv / c["file"]).is_file() and (recv / c["file"]).stat().st_size == c["size"])
    ]
