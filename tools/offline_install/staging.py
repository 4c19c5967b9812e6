"""Install vLLM 0.25.0, megatron-core and what they need onto GPU nodes with no internet, in pieces of at most 60 MiB.

The usual cluster: a login node with internet, GPU nodes without. The GPU nodes' image is expected to hold Python
3.12, torch 2.11.0 built for CUDA 13, triton and transformers (wheels.GPU_HAS lists what is never downloaded).
vLLM 0.25.0 pins exactly that torch, so the rest can be downloaded on the login node and installed on a GPU node
with pip --no-index. The set is cut into pieces, each checked on arrival, so that it can cross a link that moves
a limited size at a time (and a broken copy is found piece by piece, not after a 2 GB transfer).

On the login node (any Python; downloads from PyPI):

    python tools/offline_install wheels stage     # resolve, download, split into gpu_stage/part_NN, write the manifest
    python tools/offline_install wheels verify    # reassemble in a temporary folder: sizes, sha256, zip, pip dry run
    python tools/offline_install wheels commands  # what to run on a GPU node, per piece (JSON lines): the command and
                                                  # the files it needs there; the last piece's installs

On a GPU node (its python3; only the standard library and `packaging`), with the checkout and the pieces copied:

    python3 tools/offline_install wheels receive gpu_stage/part_03   # check a piece against the manifest, keep it
    python3 tools/offline_install wheels install --target .gpu_site  # reassemble, check, pip install --no-index

What travels is derived, not listed by hand: the roots (vllm==0.25.0 and this package's install_requires, read from
setup.py) and, recursively, every Requires-Dist of each downloaded wheel's METADATA for Python 3.12 on x86-64
Linux, except the packages in GPU_HAS (already on the GPU nodes' image) and in EXCLUDE (deliberately left behind,
each with its reason). Both lists are plain constants in wheels.py, meant to be edited for another image. Version
requirements on GPU_HAS packages cannot be checked on the login node; `install` checks them on the GPU node and
prints any mismatch. A project with no wheel for the target is built on the login node with `pip wheel` if it is pure Python (antlr4-python3-runtime
4.9.3 ships only an sdist).

Pieces (pieces.py): files are packed first-fit by decreasing size into folders of at most --piece-mib; a file
larger than that (the vLLM wheel, 250 MB) is cut into byte ranges. gpu_stage/manifest.json records every file's
size and sha256 and every chunk's piece, offset, size and sha256, so each piece is checked on arrival and each file
after reassembly. Transformer Engine is the other set of this command line (`te`, te.py): its PyTorch extension is
compiled on the login node. The pip steps both sets share are here: pip_target_args, pip_dry_run, check_present.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_dapo.cli import argument_parser

from .pieces import (
    MIB,
    PIECE_MIB,
    check_all,
    check_chunk,
    load_manifest,
    missing_chunks,
    reassemble,
    write_pieces,
)
from .wheels import EXCLUDE, PLATFORMS, REPO, TARGET_PYTHON, VLLM, Resolver, setup_requires

STAGE = REPO / "gpu_stage"
TRANSFER_LIMIT = 64 * MIB
"""What `stage` checks one transfer against: a piece with the checkout (its tracked and untracked files) beside it,
as the commands that `commands` prints copy them. Set it to your link's limit."""


def working_tree_bytes() -> int:
    """Bytes of the checkout a GPU node needs besides the pieces: tracked and untracked-not-ignored files."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    )
    names = [n for n in proc.stdout.decode().split("\0") if n]
    total = sum((REPO / n).stat().st_size for n in names if (REPO / n).is_file())
    shared = REPO / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


def cmd_stage(args) -> int:
    t0 = time.perf_counter()
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    roots = [VLLM, *setup_requires()]
    print(f"roots: {', '.join(roots)}")
    resolver = Resolver(wheels, [sys.executable, "-m", "pip"])
    resolver.run(roots)
    files = sorted(resolver.got.values())
    meta = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": TARGET_PYTHON,
        "roots": roots,
        "projects": {
            n: {"file": p.name, "required_by": sorted(resolver.required_by[n])} for n, p in sorted(resolver.got.items())
        },
        "present": {n: sorted(v) for n, v in sorted(resolver.present.items())},
        "excluded": {n: {"reason": EXCLUDE[n], "required_by": sorted(v)} for n, v in sorted(resolver.excluded.items())},
    }
    manifest = write_pieces(wheels, args.out, files, args.piece_mib * MIB, meta)
    total = sum(f["size"] for f in manifest["files"])
    tree = working_tree_bytes()
    print(
        f"\nstaged {len(files)} wheels, {total / 1e6:.1f} MB, in {len(manifest['pieces'])} pieces of at most "
        f"{args.piece_mib} MiB under {args.out} ({time.perf_counter() - t0:.0f} s)"
    )
    for piece, info in manifest["pieces"].items():
        print(f"  {piece}: {info['bytes'] / MIB:5.1f} MiB, {info['chunks']} files or byte ranges")
    print(f"left behind (EXCLUDE): {', '.join(manifest['excluded'])}")
    print(f"expected on the GPU nodes (GPU_HAS), checked by `install` there: {', '.join(manifest['present'])}")
    biggest = max(info["bytes"] for info in manifest["pieces"].values())
    limit = TRANSFER_LIMIT / MIB
    if biggest + tree > TRANSFER_LIMIT:
        print(
            f"WARNING: a piece ({biggest / MIB:.1f} MiB) + the checkout ({tree / MIB:.1f} MiB) exceed {limit:.0f} MiB"
        )
        return 1
    print(f"largest transfer: {biggest / MIB:.1f} MiB piece + {tree / MIB:.1f} MiB checkout <= {limit:.0f} MiB")
    return 0


def pip_target_args(target: Path) -> list[str]:
    return [
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
    ]


def pip_dry_run(paths: list[Path], tmp: Path, extra_platforms: tuple[str, ...] = ()) -> tuple[list[str], int | None]:
    """Would pip install every wheel for Python TARGET_PYTHON on x86-64 Linux (tags right) with --target? Returns
    (problems, how many wheels it would install; None when it refused). extra_platforms: tags beyond manylinux
    (linux_x86_64: a wheel built on the login node)."""
    platforms = [x for p in [*PLATFORMS, *extra_platforms] for x in ("--platform", p)]
    cross = ["--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, "--only-binary=:all:"]
    report = tmp / "report.json"
    cmd = [sys.executable, "-m", "pip", *pip_target_args(tmp / "site"), *cross, "--dry-run"]
    proc = subprocess.run([*cmd, "-q", "--report", str(report), *map(str, paths)], capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"pip dry run (Python {TARGET_PYTHON}, x86-64 Linux) refused the set:\n{proc.stderr[-3000:]}"], None
    return [], len(json.loads(report.read_text())["install"])


def cmd_verify(args) -> int:
    manifest = load_manifest(args.out)
    limit = manifest["piece_bytes"]
    with tempfile.TemporaryDirectory() as tmp:
        problems = check_all(manifest, args.out, Path(tmp) / "wheels")
        if not problems:
            problems, would = pip_dry_run(sorted((Path(tmp) / "wheels").glob("*.whl")), Path(tmp))
            if would is not None:
                print(f"pip install --dry-run (Python {TARGET_PYTHON}, manylinux x86-64) would install {would} wheels")
    sizes = [info["bytes"] for info in manifest["pieces"].values()]
    print(
        f"{len(manifest['files'])} files, {sum(f['size'] for f in manifest['files']) / 1e6:.1f} MB in {len(sizes)} "
        f"pieces (largest {max(sizes) / MIB:.1f} MiB <= {limit / MIB:.0f} MiB); every chunk and every reassembled file "
        f"against its sha256, zip test of each wheel: " + ("FAILED" if problems else "passed")
    )
    print("\n".join(problems))
    return 1 if problems else 0


# ----------------------------------------------------------------------------- what to run on a GPU node


def preflight_commands() -> list[str]:
    """The preflight in two commands of at most 10 minutes each (--deadline-s skips a check that would not finish,
    so each fits a short job). The first runs the checks no CPU can stand in for (the trainer end to end, both
    modes, the vLLM checks, the MoE train step with the engine's routes replayed), then the short core checks; the
    second the timing rows, which can wait."""
    run = "PYTHONPATH=$PWD/.gpu_site PYTHONUNBUFFERED=1 python3 tools/preflight.py"
    return [
        f"{run} --deadline-s 420 --only env,train_e2e,inflight_update,sleep_wake,bridge,bridge_fp8,moe "
        f"--json $OUT/preflight_a.json; "
        f"{run} --deadline-s 100 --only limits,kernel_equality,determinism,train_tiny,te --json $OUT/preflight_b.json",
        f"{run} --deadline-s 400 --only train_0.5b,train_1.5b,profile,kernel_timing --json $OUT/preflight_c.json",
    ]


def node_commands(manifest: dict, rel: str) -> list[dict]:
    """What to run on a GPU node, in order, as {"command", "carry": the files it needs there beside the checkout,
    "timeout_s"}: one per piece (rel: the staging folder, relative to the checkout), the last piece's also installing
    and running the first preflight command ($OUT: a folder for its JSON), then the second preflight command."""
    pieces = list(manifest["pieces"])
    calls = []
    for i, piece in enumerate(pieces):
        command = f"python3 tools/offline_install wheels receive {rel}/{piece}"
        if i == len(pieces) - 1:
            command += (
                f" && python3 tools/offline_install wheels install --target .gpu_site && {preflight_commands()[0]}"
            )
        calls.append({"command": command, "carry": [f"{rel}/{piece}", f"{rel}/manifest.json"], "timeout_s": 600})
    calls.append({"command": preflight_commands()[1], "timeout_s": 600})
    return calls


def cmd_commands(args) -> int:
    if not args.out.is_relative_to(REPO):
        raise SystemExit(f"{args.out} is outside the checkout: the commands name the pieces relative to it")
    for call in node_commands(load_manifest(args.out), str(args.out.relative_to(REPO))):
        print(json.dumps(call))
    return 0


# ----------------------------------------------------------------------------- on a GPU node: receive and install


def cmd_receive(args) -> int:
    stage = args.piece.resolve().parent
    manifest = load_manifest(stage)
    piece = args.piece.name
    if piece not in manifest["pieces"]:
        raise SystemExit(f"{piece} is not in {stage / 'manifest.json'} (pieces: {', '.join(manifest['pieces'])})")
    recv = stage / "recv"
    recv.mkdir(exist_ok=True)
    bad = []
    for entry in manifest["files"]:
        for chunk in (c for c in entry["chunks"] if c["piece"] == piece):
            why = check_chunk(args.piece / chunk["file"], chunk)
            if why:
                bad.append(f"{chunk['file']}: {why}")
            else:
                shutil.move(str(args.piece / chunk["file"]), recv / chunk["file"])
    have = sorted(p for p in manifest["pieces"] if not missing_chunks(manifest, recv, p))
    missing = [p for p in manifest["pieces"] if p not in have]
    print(f"{piece}: " + ("; ".join(bad) if bad else "every chunk matches its sha256"))
    print(
        f"received {len(have)}/{len(manifest['pieces'])} pieces"
        + (f"; missing {', '.join(missing)}" if missing else "")
    )
    return 1 if bad else 0


def check_present(manifest: dict) -> list[str]:
    """Requirements on the packages expected on this GPU node (GPU_HAS) that its installed versions do not meet."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    notes = []
    for name, wants in manifest["present"].items():
        try:
            have = version(name)
        except PackageNotFoundError:
            notes.append(f"{name}: not installed here (wanted by {'; '.join(wants)})")
            continue
        for want in wants:
            spec = want.split(" (", 1)[0]
            try:
                ok = spec == "any" or SpecifierSet(spec).contains(have, prereleases=True)
            except InvalidSpecifier:
                ok = True
            if not ok:
                notes.append(f"{name} {have} does not meet {want}")
    return notes


def pip_install(paths: list[Path], target: Path, present: dict, *extra: str) -> int:
    """GPU node: note what this node's own packages miss of `present` ({name: [what wants it]}: noted, not installed),
    then pip install the wheels (and extra, e.g. this repository) into target; pip's exit status."""
    for note in check_present({"present": present}):
        print(f"note: {note}")
    cmd = [sys.executable, "-m", "pip", *pip_target_args(target), "--no-build-isolation", "-q"]
    return subprocess.run([*cmd, *map(str, paths), *extra]).returncode


def cmd_install(args) -> int:
    t0 = time.perf_counter()
    stage = args.out
    manifest = load_manifest(stage)
    recv = stage / "recv"
    missing = [p for p in manifest["pieces"] if missing_chunks(manifest, recv, p)]
    if missing:
        print(f"missing pieces {', '.join(missing)}: send them again (receive), then install")
        return 2
    paths = reassemble(manifest, lambda c: recv / c["file"], stage / "wheels_rx")
    rc = pip_install(paths, args.target, manifest["present"], str(REPO))
    print(
        f"installed {len(paths)} wheels and megatron-dapo into {args.target} in {time.perf_counter() - t0:.0f} s"
        if rc == 0
        else "pip install failed"
    )
    return rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argument_parser(__doc__, prog)
    ap.add_argument("--out", type=Path, default=STAGE, help="the staging folder (ignored by git)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    stage = sub.add_parser("stage", help="login node: resolve, download, split, write the manifest")
    stage.add_argument("--piece-mib", type=int, default=PIECE_MIB, help="largest piece, MiB")
    sub.add_parser("verify", help="login node: reassemble and check everything, pip dry run")
    sub.add_parser("commands", help="login node: print what to run on a GPU node (JSON, one per line)")
    receive = sub.add_parser("receive", help="GPU node: check a piece and keep it")
    receive.add_argument("piece", type=Path)
    install = sub.add_parser("install", help="GPU node: reassemble, check, install with pip --target")
    install.add_argument("--target", type=Path, default=REPO / ".gpu_site")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    run = {"stage": cmd_stage, "verify": cmd_verify, "commands": cmd_commands}
    run.update(receive=cmd_receive, install=cmd_install)
    return run[args.cmd](args)
