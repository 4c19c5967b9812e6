"""What travels to GPU nodes without internet: vLLM and this package's requirements, resolved for their Python and
platform.

The roots (vllm==0.25.0 and setup.py's install_requires) and, recursively, every Requires-Dist of each downloaded
wheel's METADATA for Python 3.12 on x86-64 Linux, except the packages in GPU_HAS (already on the GPU nodes' image)
and in EXCLUDE (deliberately left behind, each with its reason). Both lists are plain constants, meant to be edited
for another image. Standard library and `packaging` only: `python3 tools/offline_install wheels` runs on a GPU node
before anything is installed.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from .pieces import MIB

REPO = Path(__file__).resolve().parents[2]
"""The checkout (tools/offline_install/ is two levels down): setup.py, gpu_stage/, .gpu_site/."""

VLLM = "vllm==0.25.0"
TARGET_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
"""Every manylinux tag the GPU nodes' image (Ubuntu 24.04, glibc 2.39) can load: pip matches each listed tag
exactly."""
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
"""Marker environment of the GPU nodes' python3, for Requires-Dist markers."""

GPU_HAS = frozenset(
    # the Python packages of the GPU nodes' image this was written for (a CUDA 13 image with torch 2.11.0 and a
    # scientific stack): never staged. Edit it to what `pip list` prints on your GPU nodes
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
    """Follows Requires-Dist from the roots, downloading one wheel per project for the GPU nodes."""

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
        """Requirements of a staged project on the GPU nodes, with the extras asked of it."""
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
        """No wheel for the target: build one on the login node from the sdist; only a pure-Python result may travel."""
        proc = subprocess.run(
            [*self.pip, "wheel", "--no-deps", "-q", "-w", str(out), arg], capture_output=True, text=True
        )
        built = [p for p in out.glob("*.whl") if wheel_project(p.name)[0] == normalize(re.split(r"[<>=!~\[ ]", arg)[0])]
        if proc.returncode != 0 or not built:
            raise RuntimeError(
                f"{arg}: no wheel for the GPU nodes and none could be built here:\n{proc.stderr[-2000:]}"
            )
        if not built[0].name.endswith("-none-any.whl"):
            raise RuntimeError(f"{arg}: built {built[0].name} here, which is not pure Python: it cannot travel")
