"""`python tools/offline_install wheels` (tools/offline_install/staging.py, pieces.py): its pieces, manifest and
reassembly on synthetic files, the GPU node's side (receive, install) refusing a damaged or missing piece, and the
commands it prints. No network."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import torch

from megatron_dapo.preflight import run as preflight

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from offline_install import staging  # noqa: E402
from offline_install.pieces import plan_pieces, reassemble, write_pieces  # noqa: E402

sys.path.remove(str(TOOLS))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_staging_splits_checks_and_reassembles_files_exactly(tmp_path, capsys):
    src = tmp_path / "wheels"
    src.mkdir()
    rng = torch.Generator().manual_seed(0)
    sizes = {"big-1.0-py3-none-any.whl": 2500, "mid-1.0-py3-none-any.whl": 700, "small-1.0-py3-none-any.whl": 90}
    files = []
    for name, size in sizes.items():
        (src / name).write_bytes(bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist()))
        files.append(src / name)
    out = tmp_path / "gpu_stage"
    manifest = write_pieces(src, out, files, 1000, {"present": {}, "projects": {}})
    assert manifest == json.loads((out / "manifest.json").read_text())
    # every piece within the limit; the big file in byte ranges, the small ones whole, nothing lost
    assert all(sum(p.stat().st_size for p in (out / piece).iterdir()) <= 1000 for piece in manifest["pieces"])
    by_name = {f["name"]: f for f in manifest["files"]}
    assert [c["size"] for c in by_name["big-1.0-py3-none-any.whl"]["chunks"]] == [1000, 1000, 500]
    assert [c["file"] for c in by_name["mid-1.0-py3-none-any.whl"]["chunks"]] == ["mid-1.0-py3-none-any.whl"]
    assert len(manifest["pieces"]) == 4  # 1000 | 1000 | 700 + 90 | 500: first fit by decreasing size
    assert sum(p["bytes"] for p in manifest["pieces"].values()) == sum(sizes.values())

    # on the GPU node: pieces arrive one at a time, in any order; a damaged one is refused and named
    damaged = out / "part_04" / next(iter(os.listdir(out / "part_04")))
    good = damaged.read_bytes()
    damaged.write_bytes(b"x" + good[1:])
    assert staging.main(["--out", str(out), "receive", str(out / "part_04")]) == 1
    assert "sha256 differs" in capsys.readouterr().out
    damaged.write_bytes(good)
    for piece in ("part_03", "part_01", "part_04"):
        assert staging.main(["--out", str(out), "receive", str(out / piece)]) == 0
    assert "received 3/4 pieces; missing part_02" in capsys.readouterr().out
    assert staging.main(["--out", str(out), "install", "--target", str(tmp_path / "site")]) == 2
    assert "missing pieces part_02" in capsys.readouterr().out
    assert staging.main(["--out", str(out), "receive", str(out / "part_02")]) == 0
    rebuilt = reassemble(manifest, lambda c: out / "recv" / c["file"], tmp_path / "rx")
    assert {p.name: _sha(p) for p in rebuilt} == {f.name: _sha(f) for f in files}


def test_node_commands_take_every_piece_then_install_and_run_every_preflight_check():
    manifest = {"pieces": {f"part_{i:02d}": {} for i in range(1, 7)}}
    calls = staging.node_commands(manifest, "gpu_stage")
    assert len(calls) == 7  # one per piece, the last one installing and starting the preflight, then the rest
    assert all(len(c["command"]) <= 2000 and len(c.get("carry", [])) <= 8 for c in calls)  # short job lines
    assert [c["carry"][0] for c in calls[:-1]] == [f"gpu_stage/part_{i:02d}" for i in range(1, 7)]
    assert "install --target .gpu_site" in calls[5]["command"] and "preflight.py" in calls[5]["command"]
    names = [n for c in calls for only in re.findall(r"--only (\S+)", c["command"]) for n in only.split(",")]
    assert sorted(names) == sorted(preflight.BY_NAME)  # the two preflight commands between them run every check once


def test_plan_pieces_is_deterministic_and_never_exceeds_a_piece():
    files = [("a", 10), ("b", 35), ("c", 7), ("d", 0), ("e", 21)]
    plan = plan_pieces(files, 16)
    assert plan == plan_pieces(list(reversed(files)), 16)
    assert all(sum(size for _, _, size in piece) <= 16 for piece in plan)
    covered = {}
    for piece in plan:
        for name, offset, size in piece:
            covered.setdefault(name, []).append((offset, size))
    for name, size in files:  # each file's ranges tile it exactly
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and sum(s for _, s in ranges) == size
        assert all(a + s == b for (a, s), (b, _) in zip(ranges, ranges[1:]))
