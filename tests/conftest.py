"""Test-session setup that must happen before any test module imports triton or torch, and the `seed` fixture."""

import os

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


# The longest files, longest first (benchmarks/RESULTS.md, "Where the suite's time goes"): `--dist loadfile` hands
# whole files to whichever worker is free in collection order, so a long file collected last sets the floor.
LONGEST_FILES = (
    "test_trainer.py",
    "test_slurm_cluster.py",
    "test_preflight.py",
    "test_convert.py",
    "test_rollout_sync.py",
    "test_fp8.py",
    "test_tools_bench.py",
    "test_reward_fuzz.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
