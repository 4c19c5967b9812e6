"""`python tools/offline_install te` (tools/offline_install/te.py) without network or a build: its fast mode, and
what it says of a damaged or missing piece; the one command line's two sets from a bare python.

The set here is made on the spot (a few small files, one of them larger than a piece); the real one (te_stage/,
built by `python tools/offline_install te build`) is checked by `verify` where it exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from offline_install import te  # noqa: E402

sys.path.remove(str(TOOLS))

PIECE = 1000


@pytest.fixture
def staged(tmp_path):
    """A set like `split` writes: te_stage/pieces with a wheel larger than a piece, cut into byte ranges."""
    src = tmp_path / "wheels"
    src.mkdir()
    with zipfile.ZipFile(src / "big-1.0-py3-none-any.whl", "w") as z:  # stored, so over a piece
        z.writestr("big/data.bin", os.urandom(2500))
    with zipfile.ZipFile(src / "small-1.0-py3-none-any.whl", "w") as z:
        z.writestr("small/__init__.py", "x = 1\n")
    files = sorted(src.iterdir())
    pieces = tmp_path / "te_stage" / "pieces"
    manifest = te.split(src, pieces, files, PIECE, {"te_version": "test"})
    return tmp_path, files, pieces, manifest


def _verify(pieces: Path, *extra: str) -> int:
    return te.main(["--stage", str(pieces.parent), "verify", "--pieces", str(pieces), *extra])


def test_fast_mode_passes_in_seconds_without_network(tmp_path, capsys):
    t0 = time.perf_counter()
    assert te.main(["--stage", str(tmp_path / "none"), "verify", "--fast"]) == 0
    assert time.perf_counter() - t0 < 5
    assert "selftest: ok" in capsys.readouterr().out
    assert te.selftest() == []


def test_split_cuts_the_big_wheel_and_everything_checks(staged, tmp_path):
    _, files, pieces, manifest = staged
    big = next(e for e in manifest["files"] if e["name"].startswith("big"))
    assert len(big["chunks"]) >= 3 and all(c["size"] <= PIECE for c in big["chunks"])
    assert all(i["bytes"] <= PIECE for i in manifest["pieces"].values())
    assert te.check_all(manifest, pieces, tmp_path / "rx") == []
    for f in files:
        assert (tmp_path / "rx" / f.name).read_bytes() == f.read_bytes()
    # the staged manifest is checked by the fast mode too
    assert _verify(pieces, "--fast") == 0


def test_corrupted_piece_is_refused_naming_the_piece(staged, capsys):
    tmp_path, _, pieces, manifest = staged
    chunk = next(c for e in manifest["files"] if e["name"].startswith("big") for c in e["chunks"])
    path = pieces / chunk["piece"] / chunk["file"]
    path.write_bytes(bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:])  # same size, one bit off
    assert _verify(pieces) == 1
    out = capsys.readouterr().out
    assert f"{chunk['piece']}/{chunk['file']}: sha256 differs (piece {chunk['piece']} is corrupt" in out
    assert "FAILED" in out
    # installing refuses too, before pip runs
    target = tmp_path / "site"
    assert te.main(["install", "--pieces", str(pieces), "--target", str(target)]) == 1
    assert chunk["piece"] in capsys.readouterr().out and not target.exists()


def test_a_reassembled_file_that_differs_is_refused(staged, tmp_path):
    _, _, pieces, manifest = staged
    manifest["files"][0]["sha256"] = "0" * 64  # every chunk right, the whole wheel's sha256 not
    problems = te.check_all(manifest, pieces, tmp_path / "rx")
    assert problems == [f"{manifest['files'][0]['name']}: reassembled file differs from the original (size or sha256)"]


def test_missing_piece_is_refused_naming_it(staged, capsys):
    _, _, pieces, manifest = staged
    gone = sorted(manifest["pieces"])[-1]
    for f in (pieces / gone).iterdir():
        f.unlink()
    (pieces / gone).rmdir()
    assert _verify(pieces) == 1
    out = capsys.readouterr().out
    assert f"{gone}: piece folder missing" in out
    assert _verify(pieces, "--fast") == 1  # the fast mode reads the staged manifest's layout
    assert f"{gone}: piece folder missing" in capsys.readouterr().out


def test_missing_manifest_says_what_was_expected(tmp_path):
    with pytest.raises(SystemExit, match="manifest.json is missing: expected the pieces folder"):
        _verify(tmp_path / "pieces")


def test_shell_lines_reassemble_exactly_without_python(staged, capsys):
    tmp_path, files, pieces, _ = staged
    assert te.main(["commands", "--pieces", str(pieces), "--target", str(tmp_path / "site")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pip install --no-index --no-deps" in lines[-2] and "import transformer_engine.pytorch" in lines[-1]
    assert "import torch," in lines[-1]  # torch first: it loads libnccl.so.2, which TE's core library needs
    subprocess.run(["bash", "-c", "\n".join(lines[:-2])], check=True)  # sha256sum -c, cat, sha256sum -c
    for f in files:
        assert (pieces / "wheels" / f.name).read_bytes() == f.read_bytes()
    sums = dict(reversed(line.split("  ")) for line in (pieces / "wheels.sha256").read_text().splitlines())
    assert {n: hashlib.sha256((pieces / n).read_bytes()).hexdigest() for n in sums} == sums
    # a damaged piece stops the lines at the first check
    chunk = json.loads((pieces / "manifest.json").read_text())["files"][0]["chunks"][0]
    (pieces / chunk["piece"] / chunk["file"]).write_bytes(b"x")
    proc = subprocess.run(["bash", "-c", "\n".join(lines[:-2])], capture_output=True, text=True)
    assert proc.returncode != 0 and f"{chunk['piece']}/{chunk['file']}: FAILED" in proc.stdout


def test_one_command_line_runs_both_sets_on_a_bare_python(tmp_path):
    """python -I: no PYTHONPATH, no site-packages of the user, not even the script's folder on sys.path (as on a GPU
    node before anything is installed); both sets answer, and a wrong set is one error naming the two."""
    cli = [sys.executable, "-I", str(TOOLS / "offline_install")]
    proc = subprocess.run([*cli, "te", "--stage", str(tmp_path), "verify", "--fast"], capture_output=True, text=True)
    assert proc.returncode == 0 and "selftest: ok" in proc.stdout, proc.stderr
    proc = subprocess.run([*cli, "wheels", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "receive" in proc.stdout and "python tools/offline_install wheels" in proc.stdout
    proc = subprocess.run([*cli, "stage"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'stage' (choose from 'wheels', 'te')" in proc.stderr
