"""Stage Transformer Engine 2.20.2 for GPU nodes without internet: build its PyTorch extension here, cut the set
into pieces of at most 60 MiB with a sha256 manifest, check them, and print the lines that install it there.

GPU nodes have Python 3.12 and torch 2.11.0 built for CUDA 13.0, and no network. Transformer Engine there needs
three wheels of version 2.20.2: transformer-engine-cu13 (the core library and the Python package, 276 MB),
transformer-engine (the meta package: TE checks at import that it is installed and that versions match) and
transformer-engine-torch, which PyPI ships only as source (33 C++ files, no .cu) to be compiled against the exact
torch. PyPI's torch 2.11.0 for x86-64 Linux is that CUDA 13.0 build and its nvidia-* wheels carry the CUDA, cuDNN
and NCCL headers, so the extension compiles on a CPU-only machine (a login node): no GPU and no nvcc are needed
(TE reads the CUDA version from nvcc if there is one, else from the nvidia-cuda-runtime wheel).

On the login node (internet; any Python with `packaging` runs this, a Python 3.12 builds):

    python tools/offline_install te build    # te_stage/venv (3.12, torch 2.11.0), pip wheel the extension, download
                                             # the rest into te_stage/wheels; log: te_stage/build.log (about 15 min)
    python tools/offline_install te split    # te_stage/pieces/part_NN + manifest.json + chunks.sha256, wheels.sha256
    python tools/offline_install te verify   # every chunk's sha256, reassembly, every file's sha256, zip, pip dry run
    python tools/offline_install te verify --fast   # the same checks on a small set made on the spot (+ the staged
                                                    # manifest's consistency if there is one): seconds, no network
    python tools/offline_install te commands --target DIR   # the shell lines to run there (sha256sum, cat, pip)

On a GPU node (its python3; standard library only): copy te_stage/pieces, then either run the printed lines or

    python3 tools/offline_install te install --pieces te_stage/pieces --target DIR

Pieces, manifest, checks and reassembly are pieces.py's, as for the `wheels` set. The runtime requirements are
derived, not listed: each staged wheel's Requires-Dist for Python 3.12 on x86-64 Linux, followed as for the `wheels`
set (wheels.py), skipping what the GPU nodes'
image already has (GPU_HAS: torch, einops, onnx, onnxscript, packaging...). nvidia-cudnn-frontend, which the vLLM set
leaves behind, is staged here: the extension requires it.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from unittest import mock

from megatron_dapo.cli import argument_parser

from .pieces import MIB, PIECE_MIB, check_all, check_layout, load_manifest, write_checksum_lists, write_pieces
from .staging import pip_dry_run, pip_install
from .wheels import REPO

STAGE = REPO / "te_stage"
TE_VERSION = "2.20.2"
TORCH = "torch==2.11.0"
"""PyPI's torch 2.11.0 for x86-64 Linux is the CUDA 13.0 build (+cu130 on the GPU nodes' image); its nvidia-* dependencies
bring cuda_runtime.h, cublas, cudnn.h, nccl.h, nvrtc.h that the extension includes."""
BUILD_DEPS = ["setuptools>=61", "wheel", "packaging", "pybind11", "ninja", "nvidia-cudnn-frontend>=1.29.0"]
BUILD_DEPS += ["nvidia-cuda-crt==13.0.*", "nvidia-cuda-cccl==13.0.*"]
"""crt/host_config.h (cuda_runtime.h includes it) and nv/target (cuda_fp16.h) are not in torch's CUDA 13 wheels."""
BUILD_ENV = {
    "NVTE_PYTORCH_FORCE_BUILD": "TRUE",  # else setup.py tries a prebuilt wheel from GitHub first
    "NVTE_BUILD_USE_NVIDIA_WHEELS": "1",  # headers from the nvidia-* wheels, not a local CUDA toolkit
    "NVTE_CUDA_ARCHS": "90",  # the extension has no device code; this also keeps NCCL EP on (needs >= 90)
    "NVTE_NO_LOCAL_VERSION": "1",  # else the version gets "+<git commit>" of whatever repository holds the build
    "NVTE_FRAMEWORK": "pytorch",
}
TE_NEEDS = ("nvidia-cudnn-frontend",)
"""In wheels.py's EXCLUDE (vLLM does not need it), but transformer-engine-torch requires it."""
PURE_PLATFORM = "linux_x86_64"  # the tag `pip wheel` gives the extension built here


def log(msg: str, logfile: Path | None = None) -> None:
    line = f"[offline_install te {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if logfile is not None:
        with open(logfile, "a") as f:
            f.write(line + "\n")


def run_logged(cmd: list[str], logfile: Path, env: dict | None = None) -> None:
    """Run cmd with its output appended to logfile; on failure raise with the log's tail."""
    log("$ " + shlex.join(cmd), logfile)
    t0 = time.perf_counter()
    with open(logfile, "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = "".join(open(logfile).readlines()[-40:])
        raise SystemExit(f"{tail}\nfailed (exit {rc}): {shlex.join(cmd)}\nthe whole output is in {logfile}")
    log(f"  done in {time.perf_counter() - t0:.0f} s", logfile)


def find_python312(given: str | None) -> str:
    """A Python 3.12 interpreter: --python, else python3.12 on PATH, else pyenv's (its shim may not resolve)."""
    candidates = (
        [given]
        if given
        else [shutil.which("python3.12"), *glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))]
    )
    for exe in filter(None, candidates):
        proc = subprocess.run(
            [exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True, text=True
        )
        if proc.stdout.strip() == "True":
            return exe
    raise SystemExit(f"no Python 3.12 found (tried {candidates}): the wheel must be cp312; pass --python")


def cmd_build(args) -> int:
    from . import wheels as wheelmod

    t0 = time.perf_counter()
    stage, wheels = args.stage, args.stage / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    logfile = stage / "build.log"
    logfile.write_text("")
    times = {}
    venv = stage / "venv"
    vpy = str(venv / "bin" / "python")
    t = time.perf_counter()
    if not (venv / "bin" / "python").is_file():
        run_logged([find_python312(args.python), "-m", "venv", str(venv)], logfile)
    run_logged([vpy, "-m", "pip", "install", "-q", "--upgrade", "pip"], logfile)
    run_logged([vpy, "-m", "pip", "install", TORCH, *BUILD_DEPS], logfile)
    times["venv_and_torch_s"] = round(time.perf_counter() - t)
    probe = "import sys, torch; print(sys.version_info[:2] == (3, 12), torch.__version__, torch.version.cuda)"
    proc = subprocess.run([vpy, "-c", probe], capture_output=True, text=True)
    ok, torch_version, cuda = (proc.stdout.split() + ["?"] * 3)[:3]
    if ok != "True" or not torch_version.startswith("2.11.0") or not (cuda or "").startswith("13."):
        raise SystemExit(f"{venv}: expected Python 3.12 and torch 2.11.0 for CUDA 13, got {ok=} {torch_version} {cuda}")
    log(f"torch {torch_version}, CUDA {cuda}", logfile)

    for old in wheels.glob("transformer_engine_torch-*.whl"):
        old.unlink()
    env = dict(os.environ, **BUILD_ENV, MAX_JOBS=str(args.jobs), PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env["NVTE_CUDA_ARCHS"] = args.archs
    t = time.perf_counter()
    # --no-cache-dir: pip would otherwise reuse a wheel it built before, whatever the environment now says
    cmd = [vpy, "-m", "pip", "wheel", "-v", "--no-cache-dir", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    run_logged([*cmd, f"transformer-engine-torch=={TE_VERSION}"], logfile, env)
    times["compile_s"] = round(time.perf_counter() - t)
    built = sorted(wheels.glob(f"transformer_engine_torch-{TE_VERSION}-cp312-cp312-*.whl"))
    if len(built) != 1:
        raise SystemExit(
            f"expected one transformer_engine_torch-{TE_VERSION}-cp312-cp312-*.whl in {wheels}, found {built}"
        )
    with zipfile.ZipFile(built[0]) as z:
        if not any(n.startswith("transformer_engine/wheel_lib/transformer_engine_torch") for n in z.namelist()):
            raise SystemExit(f"{built[0]}: no transformer_engine/wheel_lib/transformer_engine_torch*.so inside")

    # the extension's Requires-Dist (transformer_engine_cu13, pydantic, nvdlfw-inspect...) and the meta package
    t = time.perf_counter()
    roots = [f"transformer-engine=={TE_VERSION}", *wheelmod.wheel_requires(built[0])]
    resolver = wheelmod.Resolver(wheels, [sys.executable, "-m", "pip"])
    keep = {k: v for k, v in wheelmod.EXCLUDE.items() if k not in TE_NEEDS}
    with mock.patch.dict(wheelmod.EXCLUDE, keep, clear=True):
        resolver.run(roots)
    times["download_s"] = round(time.perf_counter() - t)
    files = [built[0], *sorted(resolver.got.values())]
    times["total_s"] = round(time.perf_counter() - t0)
    build = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "te_version": TE_VERSION,
        "torch": torch_version,
        "cuda": cuda,
        "python": "3.12",
        "cuda_archs": args.archs,
        "build_env": {**BUILD_ENV, "NVTE_CUDA_ARCHS": args.archs},
        "times": times,
        "wheels": [{"name": p.name, "size": p.stat().st_size} for p in files],
        "projects": {
            n: {"file": p.name, "required_by": sorted(resolver.required_by[n])} for n, p in sorted(resolver.got.items())
        },
        "present": {n: sorted(v) for n, v in sorted(resolver.present.items())},
        "excluded": {n: sorted(v) for n, v in sorted(resolver.excluded.items())},
    }
    (stage / "build.json").write_text(json.dumps(build, indent=1))
    for p in files:
        log(f"  {p.name}: {p.stat().st_size / MIB:.1f} MiB", logfile)
    log(f"expected on the GPU node (not staged): {', '.join(build['present'])}", logfile)
    log(f"build done in {times['total_s']} s ({times}); next: split", logfile)
    return 0


def cmd_split(args) -> int:
    build_json = args.stage / "build.json"
    if not build_json.is_file():
        raise SystemExit(f"{build_json} is missing: run `python tools/offline_install te build` first")
    build = json.loads(build_json.read_text())
    wheels = args.stage / "wheels"
    files = [wheels / w["name"] for w in build["wheels"]]
    for path, want in zip(files, build["wheels"]):
        if not path.is_file() or path.stat().st_size != want["size"]:
            raise SystemExit(f"{path}: expected a file of {want['size']} bytes (build.json); run build again")
    out = args.stage / "pieces"
    split(wheels, out, files, args.piece_mib * MIB, {k: v for k, v in build.items() if k != "wheels"})
    manifest = json.loads((out / "manifest.json").read_text())
    for piece, info in manifest["pieces"].items():
        print(f"  {piece}: {info['bytes'] / MIB:5.1f} MiB, {info['chunks']} files or byte ranges")
    print(f"{len(files)} wheels in {len(manifest['pieces'])} pieces of at most {args.piece_mib} MiB under {out}")
    return 0


def split(src: Path, out: Path, files: list[Path], piece_bytes: int, meta: dict) -> dict:
    """write_pieces, plus chunks.sha256 and wheels.sha256 so that `sha256sum -c` checks them without Python."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = write_pieces(src, out, files, piece_bytes, meta)
    write_checksum_lists(manifest, out)
    return manifest


def load(pieces: Path) -> dict:
    return load_manifest(pieces, "expected the pieces folder that `split` wrote (part_NN + manifest.json)")


def selftest() -> list[str]:
    """Split a small set made here (one file over a piece) at 4 KiB pieces, check, reassemble, compare bytes; then
    corrupt a chunk and drop a piece: both must be refused naming the piece."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "pieces"
        src.mkdir()
        data = {"big.bin": os.urandom(10_000), "small.txt": b"transformer engine\n", "empty": b"", "mid.whl": b""}
        with zipfile.ZipFile(src / "mid.whl", "w") as z:
            z.writestr("pkg/__init__.py", "x = 1\n" * 300)
        data["mid.whl"] = (src / "mid.whl").read_bytes()
        for name, blob in data.items():
            (src / name).write_bytes(blob)
        manifest = split(src, out, [src / n for n in data], 4096, {"selftest": True})
        problems += check_all(manifest, out, Path(tmp) / "rx")
        problems += [
            f"{n}: reassembled bytes differ" for n, b in data.items() if (Path(tmp) / "rx" / n).read_bytes() != b
        ]
        chunk = next(c for e in manifest["files"] if e["name"] == "big.bin" for c in e["chunks"])
        path = out / chunk["piece"] / chunk["file"]
        path.write_bytes(b"\0" + path.read_bytes()[1:])
        if not any(chunk["piece"] in p and "sha256" in p for p in check_all(manifest, out, Path(tmp) / "rx2")):
            problems.append(f"a corrupted chunk in {chunk['piece']} was not refused")
        shutil.rmtree(out / chunk["piece"])
        if not any(chunk["piece"] in p and "missing" in p for p in check_layout(manifest, out)):
            problems.append(f"a missing piece {chunk['piece']} was not refused")
    return problems


def cmd_verify(args) -> int:
    t0 = time.perf_counter()
    pieces = args.pieces
    if args.fast:
        problems = selftest()
        if (pieces / "manifest.json").is_file():
            problems += check_layout(load(pieces), pieces)
        what = "selftest" + (f" and {pieces}'s layout" if (pieces / "manifest.json").is_file() else "")
    else:
        manifest = load(pieces)
        with tempfile.TemporaryDirectory() as tmp:
            problems = check_all(manifest, pieces, Path(tmp) / "wheels")
            if not problems:
                paths = sorted((Path(tmp) / "wheels").glob("*.whl"))
                problems, _ = pip_dry_run(paths, Path(tmp), extra_platforms=(PURE_PLATFORM,))
        sizes = [i["bytes"] for i in manifest["pieces"].values()]
        what = (
            f"{len(manifest['files'])} files, {sum(f['size'] for f in manifest['files']) / 1e6:.1f} MB in "
            f"{len(sizes)} pieces (largest {max(sizes) / MIB:.1f} MiB): sha256 of every chunk and file, zip, pip dry run"
        )
    for p in problems:
        print(p)
    print(f"{what}: {'FAILED' if problems else 'ok'} ({time.perf_counter() - t0:.1f} s)")
    return 1 if problems else 0


def shell_lines(manifest: dict, pieces: str, target: str) -> list[str]:
    """What a GPU node runs, with sha256sum, cat and pip only (pieces: the folder copied there)."""
    lines = [
        "set -euo pipefail",
        f"cd {shlex.quote(pieces)}",
        "sha256sum --quiet -c chunks.sha256      # every piece arrived intact",
        "mkdir -p wheels",
    ]
    for e in manifest["files"]:
        parts = " ".join(shlex.quote(f"{c['piece']}/{c['file']}") for c in e["chunks"])
        lines.append(f"cat {parts} > {shlex.quote('wheels/' + e['name'])}")
    lines += [
        "sha256sum --quiet -c wheels.sha256      # every wheel reassembled exactly",
        f"python3 -m pip install --no-index --no-deps --no-compile --target {shlex.quote(target)} wheels/*.whl",
        f'PYTHONPATH={shlex.quote(target)}:"${{PYTHONPATH:-}}" python3 -c "import torch, transformer_engine as te; '
        f'import transformer_engine.pytorch; print(te.__version__)"',
    ]
    return lines


def cmd_commands(args) -> int:
    print("\n".join(shell_lines(load(args.pieces), args.there or str(args.pieces), args.target)))
    return 0


def cmd_install(args) -> int:
    """There: check every chunk, reassemble, check every wheel, pip install --no-index --no-deps --target."""
    manifest = load(args.pieces)
    with tempfile.TemporaryDirectory() as tmp:  # the pieces may sit on a read-only shared file system
        problems = check_all(manifest, args.pieces, Path(tmp))
        if problems:
            print("\n".join(problems))
            return 1
        paths = sorted(Path(tmp).glob("*.whl"))
        # what TE needs of this node's own packages (torch, einops, onnx...): noted, not installed
        rc = pip_install(paths, args.target, manifest.get("present", {}))
    print(f"installed {len(paths)} wheels into {args.target}" if rc == 0 else "pip install failed")
    return rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argument_parser(__doc__, prog)
    ap.add_argument("--stage", type=Path, default=STAGE, help="the staging folder (ignored by git)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="here: Python 3.12 venv with torch 2.11.0, compile the extension, download")
    build.add_argument("--python", help="a Python 3.12 interpreter (default: python3.12, else pyenv's)")
    build.add_argument("--archs", default=BUILD_ENV["NVTE_CUDA_ARCHS"], help="NVTE_CUDA_ARCHS")
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (MAX_JOBS)")
    split_p = sub.add_parser("split", help="here: cut the wheels into pieces with a manifest")
    split_p.add_argument("--piece-mib", type=int, default=PIECE_MIB, help="largest piece, MiB")
    for name, text in [
        ("verify", "check the pieces"),
        ("commands", "print the lines to run there"),
        ("install", "there: check, reassemble, pip install"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--pieces", type=Path, default=None, help="the pieces folder (default: STAGE/pieces)")
        if name == "verify":
            p.add_argument("--fast", action="store_true", help="a small set made on the spot + the manifest's layout")
        else:
            p.add_argument("--target", default=".te_site", type=Path if name == "install" else str, help="pip --target")
        if name == "commands":
            p.add_argument("--there", help="the pieces folder's path on the GPU node (default: --pieces)")
    args = ap.parse_args(argv)
    args.stage = args.stage.resolve()
    if getattr(args, "pieces", "unset") is None:
        args.pieces = args.stage / "pieces"
    run = dict(build=cmd_build, split=cmd_split, verify=cmd_verify, commands=cmd_commands, install=cmd_install)
    return run[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
