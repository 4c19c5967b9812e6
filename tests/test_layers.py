"""The import rules of docs/architecture.md: no module imports from a layer above its own, and no circle of imports
(which the layer rule leaves possible only inside one layer); and torch.distributed only behind the one communication
object (model/comm.py), where the groups are made (model/parallel.py) and in the weight transport.

Every import counts, the ones inside functions too (a lazy import is still a dependency). The layers,
lowest first; a module's layer is that of its first name under megatron_dapo.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = (
    # leaves: the config tree, records, the policy loss's result type, the command line; and algorithm/'s torch-free
    # records of objectives and rollout corrections with the modules that fill them, whose names the config allows
    (
        "base",
        {"choices", "cli", "config", "types", "timing", "loss_result", "progress", "safe_pickle", "gc_tuning"}
        | {"algorithm.registry", "algorithm.objectives", "algorithm.rollout_correction"},
    ),
    ("kernels", {"kernels"}),  # the fused Triton loss: below algorithm/, whose loss registry picks it
    ("algorithm", {"algorithm"}),  # pure tensor math
    ("reward", {"reward"}),
    ("model", {"model"}),
    ("convert", {"convert"}),
    ("rollout", {"rollout"}),
    ("data", {"data"}),
    ("sampling", {"sampling"}),  # dynamic sampling: drives engines (rollout) and the reward pool over datasets (data)
    ("placement", {"placement"}),  # where the rollout side runs (colocated or async), as the trainer sees it
    # wiring
    ("entry", {"checkpoint", "trainer", "train", "launch", "demo", "evaluate", "hf_export", "hf_import", "preflight"}),
)
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def package_sources() -> dict[str, tuple[str, bool]]:
    """{module name: (source, is a package)}."""
    sources = {}
    root = REPO / "megatron_dapo"
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        sources[".".join(("megatron_dapo", *parts[: len(parts) - is_package]))] = (path.read_text(), is_package)
    return sources


def imported_modules(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """megatron_dapo modules that source imports anywhere (function bodies included), relative imports resolved.

    `from a.b import c` imports a.b, and a.b.c too when that is a module of `known`.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names} & known
    return {m for m in out if m.startswith("megatron_dapo.")}


def layer(module: str) -> int:
    """The layer of a megatron_dapo module: that of its first name under the package, or of its first two where
    LAYERS names them (algorithm.registry)."""
    name = ".".join(module.split(".")[1:3])
    name = name if name in LAYER_OF else module.split(".")[1]
    if name not in LAYER_OF:
        raise KeyError(f"{module}: its first name {name!r} is in no layer (add it to LAYERS and the docs)")
    return LAYER_OF[name]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'importer -> imported (layer imports higher layer)' for every upward import, sorted."""
    found = []
    for module, (source, is_package) in sources.items():
        if module == "megatron_dapo":  # the root's __init__ belongs to no layer
            continue
        mine = layer(module)
        for target in sorted(imported_modules(module, source, is_package, set(sources))):
            if (theirs := layer(target)) > mine:
                found.append(f"{module} -> {target} ({LAYERS[mine][0]} imports {LAYERS[theirs][0]})")
    return found


def import_circles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Every circle of imports among the modules (strongly connected components of two or more, or a module that
    imports itself), each sorted, the list sorted. A package importing its own submodules is not a circle."""
    graph = {m: imported_modules(m, src, pkg, set(sources)) & set(sources) for m, (src, pkg) in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[str, bool]]:
    return package_sources()


def test_every_module_has_a_layer(sources):
    assert len(sources) > 30
    for module in sources:
        if module != "megatron_dapo":
            layer(module)


def test_no_module_imports_from_a_layer_above_it(sources):
    assert violations(sources) == []


def test_the_rule_catches_an_upward_import_even_inside_a_function():
    old_config = (
        "from megatron_dapo.choices import DTYPES\n"
        "def validate():\n"
        "    from megatron_dapo.kernels import LOSS_IMPLS\n"
        "    from megatron_dapo.data.datasets import DATASET_FORMATS\n"
    )
    assert violations({"megatron_dapo.config": (old_config, False)}) == [
        "megatron_dapo.config -> megatron_dapo.data.datasets (base imports data)",
        "megatron_dapo.config -> megatron_dapo.kernels (base imports kernels)",
    ]
    # the kernels are below the algorithm: the registry in algorithm/ may pick them, they take nothing from it
    kernel = "from megatron_dapo.algorithm.policy_loss import STAT_KEYS\n"
    assert violations({"megatron_dapo.kernels.fused_loss": (kernel, False)}) == [
        "megatron_dapo.kernels.fused_loss -> megatron_dapo.algorithm.policy_loss (kernels imports algorithm)"
    ]
    assert (
        violations({"megatron_dapo.algorithm.losses": ("from megatron_dapo.kernels import fused_policy_loss\n", False)})
        == []
    )
    assert (
        violations({"megatron_dapo.trainer": ("import megatron_dapo.model.policy\n", False)}) == []
    )  # downward is fine
    with pytest.raises(KeyError, match="'newfolder' is in no layer"):
        violations({"megatron_dapo.newfolder.x": ("import os\n", False)})


def test_no_circle_of_imports(sources):
    assert import_circles(sources) == []


def test_the_circle_rule_catches_a_lazy_import_back():
    """The shape reward/ had: the verifiers imported hybrid inside a function, hybrid imported private names back."""
    verifiers = "def select():\n    from megatron_dapo.reward.hybrid import hybrid_verify\n"
    hybrid = "from megatron_dapo.reward.verifiers import _result\n"
    package = "from megatron_dapo.reward.verifiers import select\n"  # a package importing its own modules: no circle
    found = import_circles(
        {
            "megatron_dapo.reward": (package, True),
            "megatron_dapo.reward.verifiers": (verifiers, False),
            "megatron_dapo.reward.hybrid": (hybrid, False),
        }
    )
    assert found == [["megatron_dapo.reward.hybrid", "megatron_dapo.reward.verifiers"]]


def test_the_repository_root_holds_no_package_but_ours():
    # Any process started in the repository root (python -m, python -c, vLLM's model-inspection subprocess)
    # has the root on sys.path, where a regular package shadows an installed one of the same name: a
    # top-level kernels/ hid Hugging Face's `kernels`, which transformers imports, and vLLM failed to start.
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
    assert packages == ["megatron_dapo"], f"packages at the repository root besides megatron_dapo: {packages}"


# ------------------------------------------------------------------ torch.distributed behind the Comm

DISTRIBUTED_ALLOWED = {
    "megatron_dapo.model.comm",  # the one communication object
    "megatron_dapo.model.parallel",  # the process groups' setup
    "megatron_dapo.rollout.weight_transport",  # the weight transport's own groups
}
DISTRIBUTED_KEPT = {"checkpoint", "run"}
"""torch.distributed's submodules any module may use: torch DCP (Megatron's checkpoints) and the launchers' run."""


def distributed_uses(source: str) -> list[str]:
    """'line N: what' for each use of torch.distributed (its checkpoint and run submodules aside) or of Megatron's
    parallel_state (its groups and ranks) in source: collectives and group queries belong to the Comm."""
    found = []

    def kept(module: str) -> bool:  # torch.distributed.checkpoint..., torch.distributed.run
        parts = module.split(".")
        return len(parts) > 2 and parts[2] in DISTRIBUTED_KEPT

    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value
            if isinstance(inner.value, ast.Name) and (inner.value.id, inner.attr) == ("torch", "distributed"):
                names = [f"torch.distributed.{node.attr}"]
        for name in names:
            torch_dist = name == "torch.distributed" or name.startswith("torch.distributed.")
            if (torch_dist and not kept(name)) or "parallel_state" in name.split("."):
                found.append(f"line {node.lineno}: {name}")
                break
    return sorted(set(found), key=lambda x: int(x.split(":")[0].split()[1]))


def test_torch_distributed_is_called_only_by_the_comm_the_group_setup_and_the_transport(sources):
    uses = {m: distributed_uses(src) for m, (src, _) in sources.items() if m not in DISTRIBUTED_ALLOWED}
    for path in sorted((REPO / "tools").rglob("*.py")):
        uses[str(path.relative_to(REPO))] = distributed_uses(path.read_text())
    assert {m: u for m, u in uses.items() if u} == {}
    assert all(distributed_uses(sources[m][0]) for m in DISTRIBUTED_ALLOWED)  # the check sees what it allows


def test_the_distributed_rule_catches_every_spelling():
    direct = "import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n"
    attribute = "import torch\n\ndef f():\n    return torch.distributed.get_rank()\n"
    lazy = "def f():\n    from torch import distributed\n"
    megatron = (
        "def f():\n    from megatron.core import parallel_state\n    return parallel_state.get_data_parallel_rank()\n"
    )
    assert distributed_uses(direct) == ["line 1: torch.distributed"]
    assert distributed_uses(attribute) == ["line 4: torch.distributed.get_rank"]
    assert distributed_uses(lazy) == ["line 2: torch.distributed"]
    assert distributed_uses(megatron) == ["line 2: megatron.core.parallel_state"]
    kept = (
        "from torch.distributed.checkpoint.api import CheckpointException\n"
        "import torch.distributed.run\n"
        "cmd = ['python', '-m', 'torch.distributed.run']\n"
    )
    assert distributed_uses(kept) == []


# ------------------------------------------------------------------ sections flow whole

ROOT_CONFIG_MODULES = {"megatron_dapo.config", "megatron_dapo.config.rules"}
ROOT_CONFIG_TAKERS = {"megatron_dapo.trainer.Trainer.__init__"}
"""The constructors that may take the root Config: the trainer composes the run, so it picks the tree apart."""


def root_config_takers(module: str, source: str) -> list[str]:
    """'module.Class.method' for each __init__ or classmethod in source with a parameter annotated with the root
    Config (as imported from megatron_dapo.config or config.rules, under any name; inside Optional[...] or a string
    too). A component takes the sections it acts on and the values derived across them, never the whole tree."""
    tree = ast.parse(source)
    names = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ROOT_CONFIG_MODULES
        for a in node.names
        if a.name == "Config"
    }

    def mentions(annotation: ast.expr | None) -> bool:
        for node in ast.walk(annotation) if annotation is not None else ():
            if isinstance(node, ast.Name) and node.id in names:
                return True
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if mentions(ast.parse(node.value, mode="eval").body):
                    return True
        return False

    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            classmethod_ = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)
            if fn.name != "__init__" and not classmethod_:
                continue
            a = fn.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            if any(mentions(p.annotation) for p in params):
                found.append(f"{module}.{cls.name}.{fn.name}")
    return found


def test_no_component_takes_the_root_config(sources):
    takers = [t for m, (src, _) in sources.items() for t in root_config_takers(m, src)]
    assert sorted(set(takers) - ROOT_CONFIG_TAKERS) == []
    assert set(takers) == ROOT_CONFIG_TAKERS  # the check sees the one it allows


def test_the_root_config_rule_catches_every_spelling():
    source = (
        "from typing import Optional\n"
        "from megatron_dapo.config import Config as Root, ModelConfig\n"
        "from megatron_dapo.config.rules import Config\n"
        "class A:\n    def __init__(self, cfg: Root): ...\n"
        "class B:\n    @classmethod\n    def from_config(cls, *, cfg: Optional[Config] = None): ...\n"
        "class C:\n    def __init__(self, cfg: 'Config'): ...\n"
        "class D:\n    def __init__(self, model: ModelConfig): ...\n    def f(self, cfg: Config): ...\n"
    )
    assert root_config_takers("m", source) == ["m.A.__init__", "m.B.from_config", "m.C.__init__"]
    other = "from elsewhere import Config\nclass E:\n    def __init__(self, cfg: Config): ...\n"
    assert root_config_takers("m", other) == []
