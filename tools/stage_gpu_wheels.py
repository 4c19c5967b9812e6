"""Bring vLLM 0.25.0, megatron-core and what they need to the GPU machine, in pieces of at most 60 MiB.

The GPU machine (ENVIRONMENT.md, "When a GPU is at hand") has Python 3.12, torch 2.11.0 built for CUDA 13, triton
3.6 and transformers, and no network. vLLM 0.25.0 pins exactly that torch, so it can run there if its wheels travel:
one `run` call carries at most 64 MiB with the working tree, and the machine keeps ignored files between calls
while it stays warm (about 30 s after each), so consecutive calls assemble the set piece by piece.

Here (any Python; downloads from PyPI):

    python tools/stage_gpu_wheels.py stage       # resolve, download, split into gpu_stage/part_NN, write the manifest
    python tools/stage_gpu_wheels.py verify      # reassemble in a temporary folder: sizes, sha256, zip test, pip dry run
    python tools/stage_gpu_wheels.py commands    # the device `run` calls: one per piece, the last one installs

There (python3 of the GPU image; only the standard library and `packaging`):

    python3 tools/stage_gpu_wheels.py receive gpu_stage/part_03   # check a piece against the manifest and keep it
    python3 tools/stage_gpu_wheels.py install --target .gpu_site  # reassemble, check, pip install --no-index --no-deps

What travels is derived, not listed by hand: the roots (vllm==0.25.0 and this package's install_requires, read from
setup.py) and, recursively, every Requires-Dist of each downloaded wheel's METADATA for Python 3.12 on x86-64
Linux, except the packages in GPU_HAS (already on the GPU image) and in EXCLUDE (deliberately left behind, each
with its reason). Both lists are plain constants below, meant to be edited. Version requirements on GPU_HAS
packages cannot be checked here; `install` checks them there and prints any mismatch. A project with no wheel for
the target is built here with `pip wheel` if it is pure Python (antlr4-python3-runtime 4.9.3 ships only an sdist).

Pieces: files are packed first-fit by decreasing size into folders of at most --piece-mib; a file larger than
that (the vLLM wheel, 250 MB) is cut into byte ranges. gpu_stage/manifest.json records every file's size and
sha256 and every chunk's piece, offset, size and sha256, so each piece is checked on arrival and each file after
reassembly. Transformer Engine is not staged (README, "GPU preflight": its core library alone is 276 MB and its
PyTorch extension must be compiled there).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / "gpu_stage"
MIB = 1 << 20
PIECE_MIB = 60
CARRY_LIMIT = 64 * MIB
"""What one device call may carry: working tree + carried paths (device README, Limits)."""

VLLM = "vllm==0.25.0"
TARGET_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
"""Every manylinux tag the GPU image (Ubuntu 24.04, glibc 2.39) can load: pip matches each listed tag exactly."""
TARGET_ENV = {
    "python_version": TARGET_PYTHON,
    "python_full_version": TARGET_PYTHON + ".3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
}
"""Marker environment of the GPU machine's python3, for Requires-Dist markers."""

GPU_HAS = frozenset(
    # the GPU image's Python packages, as listed in the device notes' KINDS.md (read 2026-11-17): never staged
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
    opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
    six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp
    """.split()
)

EXCLUDE = {
    # vLLM 0.25.0 requirements left behind. The offline LLM engine on a dense bf16 Qwen2 (what the trainer and the
    # preflight run) imports none of them: they are kernels for other models or quantisations, video decoding, or
    # the OpenAI-compatible server, and vLLM imports them lazily or behind availability checks. Together they are
    # over a gigabyte (flashinfer-cubin and nvidia-cutlass-dsl alone are hundreds of MB).
    "torchcodec": "video decoding for multimodal inputs",
    "pynvvideocodec": "video decoding for multimodal inputs",
    "flashinfer-python": "optional attention/sampling kernels; vLLM's own FlashAttention serves Hopper",
    "flashinfer-cubin": "prebuilt flashinfer kernels (see flashinfer-python)",
    "tilelang": "kernels for sparse/MLA attention models",
    "nvidia-cutlass-dsl": "CuTe DSL kernels for MLA/FP4/Mamba models",
    "quack-kernels": "CuTe DSL kernels (see nvidia-cutlass-dsl)",
    "humming-kernels": "quantised MoE kernels",
    "tokenspeed-mla": "MLA attention kernels (DeepSeek-style models)",
    "nvidia-cudnn-frontend": "cuDNN attention frontend, not the default backend",
    "fastsafetensors": "alternative checkpoint loader (load_format=fastsafetensors)",
    "anthropic": "the Anthropic-compatible API server",
    "mcp": "tool servers for the API server",
    "prometheus-fastapi-instrumentator": "the API server's metrics",
    "model-hosting-container-standards": "SageMaker hosting of the API server",
    "watchfiles": "the API server's reloader",
    "opentelemetry-sdk": "request tracing (off unless configured)",
    "opentelemetry-api": "request tracing (off unless configured)",
    "opentelemetry-exporter-otlp": "request tracing (off unless configured)",
    "opentelemetry-semantic-conventions-ai": "request tracing (off unless configured)",
}
"""Projects never staged, with the reason. Their own requirements are not followed either."""

PINS = {
    # vLLM 0.25.0 pins apache-tvm-ffi==0.1.9, and xgrammar 0.2.6+ needs apache-tvm-ffi>=0.1.10 (vLLM asks for
    # xgrammar>=0.2.1,<1): the newest xgrammar that fits is 0.2.5.post1. This resolver takes the newest version
    # that meets the requirements seen so far and does not backtrack, so such a pin is how a conflict is settled.
    "xgrammar": "<0.2.6",
}
"""Extra version constraints, applied whenever the project is required."""


def normalize(name: str) -> str:
    """PEP 503 project name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


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


def wheel_project(filename: str) -> tuple[str, str]:
    """(normalized project, version) from a wheel's file name."""
    name, version = Path(filename).name.split("-")[:2]
    return normalize(name), version


def wheel_requires(path: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]  # the headers; the description follows the first blank line
    return [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]


def setup_requires() -> list[str]:
    """install_requires of this repository's setup.py (read from its syntax tree; setup() is never run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(elt) for elt in node.value.elts]
    raise RuntimeError("setup.py has no install_requires list")


# ----------------------------------------------------------------------------- here: resolve and download


class Resolver:
    """Follows Requires-Dist from the roots, downloading one wheel per project for the GPU machine."""

    def __init__(self, wheels: Path, pip: list[str]) -> None:
        from packaging.specifiers import SpecifierSet

        self.wheels, self.pip = wheels, pip
        self.spec: dict[str, SpecifierSet] = {}  # merged version requirements per staged project
        self.extras: dict[str, set[str]] = {}
        self.required_by: dict[str, set[str]] = {}
        self.got: dict[str, Path] = {}  # project -> its wheel
        self.present: dict[str, set[str]] = {}  # GPU_HAS project -> requirements on it ("spec (by whom)")
        self.excluded: dict[str, set[str]] = {}  # EXCLUDE project -> who asked for it

    def run(self, roots: list[str]) -> None:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet

        queue = [(Requirement(r), "<roots>") for r in roots]
        while queue:
            wanted: list[str] = []
            for req, parent in queue:
                name = normalize(req.name)
                if name in GPU_HAS:
                    self.present.setdefault(name, set()).add(f"{req.specifier or 'any'} ({parent})")
                    continue
                if name in EXCLUDE:
                    self.excluded.setdefault(name, set()).add(parent)
                    continue
                self.required_by.setdefault(name, set()).add(parent)
                pin = SpecifierSet(PINS.get(name, ""))
                self.spec[name] = self.spec.get(name, pin) & req.specifier
                new_extras = set(req.extras) - self.extras.get(name, set())
                self.extras.setdefault(name, set()).update(req.extras)
                if name in self.got:
                    version = wheel_project(self.got[name].name)[1]
                    if not self.spec[name].contains(version, prereleases=True):
                        raise RuntimeError(
                            f"{name} {version} was staged, but {parent} needs {name}{req.specifier} "
                            f"(all requirements: {self.spec[name]}): settle it in PINS"
                        )
                    if new_extras:  # the wheel is here; follow what the new extras add
                        wanted.append(name)
                elif name not in wanted:
                    wanted.append(name)
            self._download([n for n in wanted if n not in self.got])
            queue = [(r, n) for n in wanted for r in self._requirements(n)]

    def _requirements(self, name: str):
        """Requirements of a staged project for the GPU machine, with the extras asked of it."""
        from packaging.requirements import Requirement

        out = []
        for line in wheel_requires(self.got[name]):
            req = Requirement(line)
            envs = [dict(TARGET_ENV, extra=e) for e in sorted(self.extras[name]) or [""]]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                out.append(req)
        return out

    def _cached(self, name: str) -> Path | None:
        """The newest wheel of the project already downloaded that meets its requirements, if any."""
        from packaging.version import Version

        fits = [
            (Version(version), path)
            for path in self.wheels.glob("*.whl")
            for project, version in [wheel_project(path.name)]
            if project == name and self.spec[name].contains(version, prereleases=True)
        ]
        return max(fits)[1] if fits else None

    def _download(self, names: list[str]) -> None:
        todo = []
        for name in names:
            cached = self._cached(name)
            if cached is not None:
                self.got[name] = cached
            else:
                todo.append(name)
        if not todo:
            return
        args = [f"{n}{self.spec[n]}" for n in todo]
        platforms = [x for p in PLATFORMS for x in ("--platform", p)]
        target = ["--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, "--only-binary=:all:"]
        with tempfile.TemporaryDirectory(dir=self.wheels) as tmp:
            cmd = [*self.pip, "download", "--no-deps", "-q", *target, "-d", tmp]
            if subprocess.run([*cmd, *args], capture_output=True, text=True).returncode != 0:
                for arg in args:  # one at a time: find the project without a wheel and build it
                    if subprocess.run([*cmd, arg], capture_output=True, text=True).returncode != 0:
                        self._build_pure(arg, Path(tmp))
            for path in Path(tmp).glob("*.whl"):
                shutil.move(str(path), self.wheels / path.name)
        for name in todo:
            cached = self._cached(name)
            if cached is None:
                raise RuntimeError(f"no wheel of {name}{self.spec[name]} for Python {TARGET_PYTHON} x86-64 Linux")
            self.got[name] = cached
            print(f"  {cached.name} ({cached.stat().st_size / MIB:.1f} MiB)", flush=True)

    def _build_pure(self, arg: str, out: Path) -> None:
        """No wheel for the target: build one here from the sdist; only a pure-Python result may travel."""
        proc = subprocess.run(
            [*self.pip, "wheel", "--no-deps", "-q", "-w", str(out), arg], capture_output=True, text=True
        )
        built = [p for p in out.glob("*.whl") if wheel_project(p.name)[0] == normalize(re.split(r"[<>=!~\[ ]", arg)[0])]
        if proc.returncode != 0 or not built:
            raise RuntimeError(
                f"{arg}: no wheel for the GPU machine and none could be built here:\n{proc.stderr[-2000:]}"
            )
        if not built[0].name.endswith("-none-any.whl"):
            raise RuntimeError(f"{arg}: built {built[0].name} here, which is not pure Python: it cannot travel")


# ----------------------------------------------------------------------------- here: pieces and manifest


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


def working_tree_bytes() -> int:
    """Bytes of what every device call sends besides its carry: tracked and untracked-not-ignored files."""
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
    print(f"expected on the GPU image (GPU_HAS), checked by `install` there: {', '.join(manifest['present'])}")
    biggest = max(info["bytes"] for info in manifest["pieces"].values())
    if biggest + tree > CARRY_LIMIT:
        print(f"WARNING: a piece ({biggest / MIB:.1f} MiB) + the working tree ({tree / MIB:.1f} MiB) exceed 64 MiB")
        return 1
    print(f"largest call: {biggest / MIB:.1f} MiB piece + {tree / MIB:.1f} MiB working tree <= 64 MiB")
    return 0


# ----------------------------------------------------------------------------- reassembly (here and there)


def load_manifest(stage: Path) -> dict:
    path = stage / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python tools/stage_gpu_wheels.py stage` here (and carry it)")
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


def cmd_verify(args) -> int:
    manifest = load_manifest(args.out)
    limit = manifest["piece_bytes"]
    problems = []
    for piece in manifest["pieces"]:
        size = sum(p.stat().st_size for p in (args.out / piece).iterdir())
        if size > limit:
            problems.append(f"{piece}: {size} bytes > {limit}")
    for entry in manifest["files"]:
        for chunk in entry["chunks"]:
            why = check_chunk(args.out / chunk["piece"] / chunk["file"], chunk)
            if why:
                problems.append(f"{chunk['piece']}/{chunk['file']}: {why}")
    if problems:
        print("\n".join(problems))
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        paths = reassemble(manifest, lambda c: args.out / c["piece"] / c["file"], Path(tmp) / "wheels")
        for path in paths:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad is not None:
                problems.append(f"{path.name}: zip member {bad} is corrupt")
        platforms = [x for p in PLATFORMS for x in ("--platform", p)]
        cross = ["--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, "--only-binary=:all:"]
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", *pip_target_args(Path(tmp) / "site"), *cross, "--dry-run"]
        proc = subprocess.run([*cmd, "-q", "--report", str(report), *map(str, paths)], capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"pip dry run failed:\n{proc.stderr[-3000:]}")
        else:
            would = len(json.loads(report.read_text())["install"])
            print(f"pip install --dry-run (Python {TARGET_PYTHON}, manylinux x86-64) would install {would} wheels")
    sizes = [info["bytes"] for info in manifest["pieces"].values()]
    print(
        f"{len(manifest['files'])} files, {sum(f['size'] for f in manifest['files']) / 1e6:.1f} MB in {len(sizes)} "
        f"pieces (largest {max(sizes) / MIB:.1f} MiB <= {limit / MIB:.0f} MiB); every chunk and every reassembled file "
        f"matches its sha256; zip test of each wheel " + ("FAILED" if problems else "passed")
    )
    print("\n".join(problems))
    return 1 if problems else 0


# ----------------------------------------------------------------------------- the device calls


def preflight_calls() -> list[str]:
    """The preflight in two calls, each finishing inside the device's 10-minute limit (--deadline-s stops a check
    still running; the first call also installs, so it keeps 2 minutes for that)."""
    run = "PYTHONPATH=$PWD/.gpu_site PYTHONUNBUFFERED=1 python3 tools/preflight.py"
    return [
        f"{run} --deadline-s 460 --only env,limits,kernel_equality,kernel_timing,train_tiny,train_0.5b,train_1.5b "
        "--json $OUT/preflight_1.json",
        f"{run} --deadline-s 560 --only determinism,bridge,sleep_wake,te --json $OUT/preflight_2.json",
    ]


def device_calls(manifest: dict, rel: str) -> list[dict]:
    """The device `run` calls, in order: one per piece (rel: the staging folder, relative to the repository),
    the last piece's call also installing and running the first half of the preflight, then the second half."""
    pieces = list(manifest["pieces"])
    calls = []
    for i, piece in enumerate(pieces):
        command = f"python3 tools/stage_gpu_wheels.py receive {rel}/{piece}"
        if i == len(pieces) - 1:
            command += f" && python3 tools/stage_gpu_wheels.py install --target .gpu_site && {preflight_calls()[0]}"
        calls.append({"command": command, "carry": [f"{rel}/{piece}", f"{rel}/manifest.json"], "timeout_s": 600})
    calls.append({"command": preflight_calls()[1], "timeout_s": 600})
    return calls


def cmd_commands(args) -> int:
    if not args.out.is_relative_to(REPO):
        raise SystemExit(f"{args.out} is outside the repository: a carried path must be inside it")
    for call in device_calls(load_manifest(args.out), str(args.out.relative_to(REPO))):
        print(json.dumps(call))
    return 0


# ----------------------------------------------------------------------------- there: receive and install


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
    have = sorted(p for p in manifest["pieces"] if not _missing_chunks(manifest, recv, p))
    missing = [p for p in manifest["pieces"] if p not in have]
    print(f"{piece}: " + ("; ".join(bad) if bad else "every chunk matches its sha256"))
    print(
        f"received {len(have)}/{len(manifest['pieces'])} pieces"
        + (f"; missing {', '.join(missing)}" if missing else "")
    )
    return 1 if bad else 0


def _missing_chunks(manifest: dict, recv: Path, piece: str) -> list[str]:
    return [
        c["file"]
        for e in manifest["files"]
        for c in e["chunks"]
        if c["piece"] == piece and not ((recv / c["file"]).is_file() and (recv / c["file"]).stat().st_size == c["size"])
    ]


def check_present(manifest: dict) -> list[str]:
    """Requirements on the packages expected on this machine that its installed versions do not meet."""
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


def cmd_install(args) -> int:
    t0 = time.perf_counter()
    stage = args.out
    manifest = load_manifest(stage)
    recv = stage / "recv"
    missing = [p for p in manifest["pieces"] if _missing_chunks(manifest, recv, p)]
    if missing:
        print(f"missing pieces {', '.join(missing)}: send them again (receive), then install")
        return 2
    paths = reassemble(manifest, lambda c: recv / c["file"], stage / "wheels_rx")
    for note in check_present(manifest):
        print(f"note: {note}")
    cmd = [sys.executable, "-m", "pip", *pip_target_args(args.target), "--no-build-isolation", "-q"]
    proc = subprocess.run([*cmd, *map(str, paths), str(REPO)])
    print(
        f"installed {len(paths)} wheels and megatron-dapo into {args.target} in {time.perf_counter() - t0:.0f} s"
        if proc.returncode == 0
        else "pip install failed"
    )
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=STAGE, help="the staging folder (ignored by git)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    stage = sub.add_parser("stage", help="here: resolve, download, split, write the manifest")
    stage.add_argument("--piece-mib", type=int, default=PIECE_MIB, help="largest piece, MiB")
    sub.add_parser("verify", help="here: reassemble and check everything, pip dry run")
    sub.add_parser("commands", help="here: print the device run calls (JSON, one per line)")
    receive = sub.add_parser("receive", help="there: check a piece and keep it")
    receive.add_argument("piece", type=Path)
    install = sub.add_parser("install", help="there: reassemble, check, install with pip --target")
    install.add_argument("--target", type=Path, default=REPO / ".gpu_site")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    run = {"stage": cmd_stage, "verify": cmd_verify, "commands": cmd_commands}
    run.update(receive=cmd_receive, install=cmd_install)
    return run[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
