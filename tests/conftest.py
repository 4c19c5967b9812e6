"""Test-session setup that must happen before any test module imports triton or torch, the `seed` fixture, and the
tiny model every test run builds once."""

import fcntl
import os
import shutil
from pathlib import Path

import pytest

# Triton kernels run here only in the interpreter, and the variable must be set before the
# module defining a kernel is imported. Set for the whole session (and the torchrun workers
# it starts), so `algorithm.loss_impl=auto` exercises the fused kernel on CPU too.
os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    group = parser.getgroup("megatron-dapo")
    group.addoption(
        "--seed",
        type=int,
        default=None,
        help="the value of every test's `seed` fixture (default: a fresh random seed per test, printed if it fails)",
    )
    group.addoption(
        "--seed-sweep",
        type=int,
        default=0,
        metavar="N",
        help="run every test that takes `seed` once per seed (--seed or 0, then the next N-1): how often a "
        "statistical test fails at random seeds",
    )


def pytest_generate_tests(metafunc):
    sweep = metafunc.config.getoption("seed_sweep")
    if sweep and "seed" in metafunc.fixturenames:
        first = metafunc.config.getoption("seed") or 0
        metafunc.parametrize("seed", range(first, first + sweep), ids=lambda s: f"seed{s}")


@pytest.fixture
def seed(request) -> int:
    """This test's seed: every random input of the test is drawn from it (no global generator is touched).

    Fresh on every run unless --seed is given; a failing test prints it with the command that replays it.
    """
    value = request.config.getoption("seed")
    if value is None:
        value = int.from_bytes(os.urandom(4), "little") >> 1
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(
                    ("seed", f"this test's seed: {value}; replay: pytest '{item.nodeid}' --seed {value}")
                )


# The longest files, longest first (benchmarks/RESULTS.md, the suite's durations): `--dist loadfile
# --no-loadscope-reorder` (the Makefile) hands whole files to whichever worker is free in collection order, so a long
# file collected last would set the floor.
LONGEST_FILES = (
    "test_trainer.py",
    "test_slurm_cluster.py",
    "test_convert.py",
    "test_preflight.py",
    "test_rollout_sync.py",
    "test_fp8.py",
    "test_smollm2.py",
    "test_tools_bench.py",
    "test_demo.py",
    "test_reward_fuzz.py",
    "test_eval.py",
    "test_model_parallel.py",  # the longest of make test-fast from here on
    "test_rollout.py",
    "test_kernel.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """tiny_qwen2(seed=0, copy_to=None) -> the directory of megatron_dapo.model.tiny's Qwen2 with that seed.

    Built once per test run and shared by the xdist workers (a file-locked cache under the run's temp root); read
    it only, or pass copy_to for a copy of one's own to change.
    """
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny_models"
    root.mkdir(exist_ok=True)

    def get(seed: int = 0, copy_to: Path | None = None) -> Path:
        from megatron_dapo.model.tiny import build_tiny_qwen2

        out, done = root / f"qwen2_seed{seed}", root / f"qwen2_seed{seed}.done"
        with open(root / f"qwen2_seed{seed}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the build, then reads it
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)  # a build that died half way
                build_tiny_qwen2(out, seed=seed)
                done.touch()
        if copy_to is None:
            return out
        shutil.copytree(out, copy_to)
        return Path(copy_to)

    return get
