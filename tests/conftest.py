"""Test-session setup that must happen before any test module imports triton or torch, the `seed` fixture, and what
every test run builds once for all its workers: the tiny model and the 2-step run the end-to-end tests compare with."""

import fcntl
import inspect
import os
import shutil
from pathlib import Path

import pytest

# Triton kernels run here only in the interpreter, and the variable must be set before the
# module defining a kernel is imported. Set for the whole session (and the torchrun workers
# it starts), so `algorithm.loss_impl=auto` exercises the fused kernel on CPU too.
os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ["rollout_helpers"]  # the engine test files' module fixtures (imported after the line above)


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


@pytest.fixture
def run_main(capsys):
    """run_main(main, argv) -> (exit code, stderr's lines but the INFO log lines): a command's main() in this process.

    For the error paths, which fail before anything heavy starts (a process launch costs seconds of imports). What
    main() sets for its process is put back after it: signal handlers, the root logger and the libraries' log levels
    (cli.quiet_libraries), warning filters, the environment.
    """
    import logging
    import signal
    import warnings

    from megatron_dapo.cli import LIBRARIES

    def run(main, argv: list[str]) -> tuple[int, list[str]]:
        signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
        loggers = [logging.getLogger(name) for name in ("", *LIBRARIES)]
        levels, handlers, env = [x.level for x in loggers], list(loggers[0].handlers), dict(os.environ)
        try:
            with warnings.catch_warnings():
                code = main(list(argv))
        finally:
            for sig, handler in signals.items():
                signal.signal(sig, handler)
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
            loggers[0].handlers[:] = handlers
            os.environ.clear()
            os.environ.update(env)
        return code, [x for x in capsys.readouterr().err.splitlines() if x.strip() and " INFO " not in x]

    return run


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


# The files whose megatron_worker.py jobs share the test run's torchrun launches (megatron_runs, below): xdist hands
# them out as one unit, so they run on one worker, one after another. Their jobs run in this order: the ones that
# start a vLLM engine last, since each rank keeps its engine until the launch ends (megatron_worker._ENGINES).
MEGATRON_JOB_FILES = (
    "test_checkpoint.py",
    "test_model.py",
    "test_model_parallel.py",
    "test_moe.py",
    "test_weight_bridge.py",
    "test_fp8.py",
    "test_rollout_sync.py",
    "test_smollm2.py",
)

# The longest files, longest first (benchmarks/RESULTS.md, the suite's durations): `--dist loadfile
# --no-loadscope-reorder` (the Makefile) hands whole files to whichever worker is free in collection order, so a long
# file collected last would set the floor.
LONGEST_FILES = (
    "test_slurm_cluster.py",
    "test_launch.py",  # the first to ask for two_steps (built once, below); the files after it find it built
    "test_sampler_runs.py",
    "test_trainer.py",
    MEGATRON_JOB_FILES,  # the longest of make test-fast
    "test_convert.py",
    "test_preflight.py",
    "test_tools_bench.py",
    "test_demo.py",
    "test_reward_fuzz.py",
    "test_eval.py",
    "test_rollout.py",
    "test_kernel.py",
    # the next tier, so that what ends the run on each worker is a file of a few seconds
    "test_sampler_sim.py",
    "test_weight_transport.py",
    "test_sim_pipeline.py",
    "test_dynamic_sampling.py",
    "test_watchdog.py",  # mostly waits on processes it stopped: best beside the other worker's computing, not last
    "test_reward.py",
    "test_rollout_stream.py",
    "test_trainer_loop.py",
    "test_exchange.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, names in enumerate(LONGEST_FILES) for name in ([names] if isinstance(names, str) else names)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with MEGATRON_JOB_FILES as one unit of work (one scope), every other file its own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileMegatronJobsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "megatron jobs" if Path(path).name in MEGATRON_JOB_FILES else path

    return LoadFileMegatronJobsTogether(config, log)


@pytest.fixture(scope="session")
def megatron_runs(request, tmp_path_factory) -> dict[str, dict]:
    """{test module: {job: the worker's merged result, or its failure}} for every collected test file that defines
    `megatron_jobs(root, *session_fixtures) -> {job: Job}`: all their jobs in one torchrun launch per world size, so
    torch and Megatron are imported once for the files, not once per file, in MEGATRON_JOB_FILES' order. A file's
    jobs marked slow run only where one of its slow tests is collected."""
    from megatron_helpers import run_jobs

    items = [item for item in request.session.items if hasattr(getattr(item, "module", None), "megatron_jobs")]
    modules = {item.module.__name__: item.module for item in items}
    stray = sorted(m.__file__ for m in modules.values() if Path(m.__file__).name not in MEGATRON_JOB_FILES)
    assert not stray, f"{stray} define megatron_jobs: add them to tests/conftest.py MEGATRON_JOB_FILES"
    order = {name: i for i, name in enumerate(MEGATRON_JOB_FILES)}
    modules = dict(sorted(modules.items(), key=lambda kv: order[Path(kv[1].__file__).name]))
    root = tmp_path_factory.mktemp("megatron_jobs")
    jobs = {}
    for name, m in modules.items():  # megatron_jobs(root, *fixtures): the session fixtures it names, as a test's
        fixtures = {f: request.getfixturevalue(f) for f in list(inspect.signature(m.megatron_jobs).parameters)[1:]}
        slow = any(i.get_closest_marker("slow") for i in items if i.module is m)  # a slow test of m is collected
        listed = m.megatron_jobs(root / name, **fixtures).items()
        jobs.update({f"{name}/{job}": spec for job, spec in listed if slow or not spec.slow})
    ran = run_jobs(jobs, root)
    return {name: {job.split("/")[1]: got for job, got in ran.items() if job.split("/")[0] == name} for name in modules}


@pytest.fixture(scope="module")
def ran(request, megatron_runs) -> dict:
    """This module's share of megatron_runs: {job: the worker's merged result, or its failure}."""
    return megatron_runs[request.module.__name__]


def _built_once(tmp_path_factory, name: str, build) -> Path:
    """build(directory) once per test run, shared by the xdist workers: a file-locked folder under the run's temp
    root (the other worker waits for the build, then reads it; a build that died half way is built again)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_once"
    root.mkdir(exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


def _tiny_model(tmp_path_factory, family: str):
    """get(seed=0, copy_to=None) -> the directory of megatron_dapo.model.tiny's build_tiny_{family} with that seed."""

    def get(seed: int = 0, copy_to: Path | None = None) -> Path:
        from megatron_dapo.model import tiny

        build = getattr(tiny, f"build_tiny_{family}")
        out = _built_once(tmp_path_factory, f"{family}_seed{seed}", lambda d: build(d, seed=seed))
        if copy_to is None:
            return out
        shutil.copytree(out, copy_to)
        return Path(copy_to)

    return get


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """tiny_qwen2(seed=0, copy_to=None) -> the directory of megatron_dapo.model.tiny's Qwen2 with that seed.

    Built once per test run (_built_once); read it only, or pass copy_to for a copy of one's own to change.
    """
    return _tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """tiny_qwen3(seed=0, copy_to=None): tiny_qwen2's Qwen3 (head_dim 64, not hidden/heads; q_norm and k_norm
    random and different from each other)."""
    return _tiny_model(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """tiny_qwen3_moe(seed=0, copy_to=None): model/tiny.py's Qwen3-MoE (3 layers, the middle one dense, 8 experts
    top 2, near-tied router rows)."""
    return _tiny_model(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def two_steps(tmp_path_factory, tiny_qwen2):
    """A 2-step run in one process, built once per test run (_built_once) for the trainer's and the launchers' tests:
    the tiny model, 64 addition problems, evaluation on 5 more after step 2 (at temperature 0.6, not the rollouts'
    1.0: logprobs the trainer took at it would show in rollout/logp_mismatch_mean), KL to the starting weights in the
    reward (k1, GRPO-with-KL as PPO puts it; the loss term is tests/test_sampler_runs.py's).

    Logs to Weights & Biases too, offline (wandb's files under the run directory and the fixture's folder, see
    run_helpers.wandb_env). Returns its overrides (without trainer.run_dir or the W&B project), its run directory and
    its stdout.
    """
    from run_helpers import run_train, wandb_env

    from megatron_dapo.data.generator import generate_rows, write_jsonl

    model = tiny_qwen2()

    def overrides(root: Path) -> list[str]:
        return [
            f"model.hf_path={model}",
            "model.dtype=fp32",
            f"data.train_files=[{root / 'train.jsonl'}]",
            "data.max_prompt_length=480",  # + 24 response tokens within the tiny model's 512 positions
            "rollout.max_response_length=24",
            "algorithm.overlong_buffer_len=8",
            "algorithm.group_size=4",
            "algorithm.dynamic_sampling=false",  # a random model is never right: no group would be informative
            "algorithm.kl_coef=0.05",
            "algorithm.kl_estimator=k1",
            "algorithm.kl_in_reward=true",
            "sampler.train_batch_size=4",
            "sampler.gen_batch_size=4",
            "optim.mini_batch_size=8",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            "reward.num_workers=1",
            "trainer.total_steps=2",
            "trainer.save_every=1",
            f"data.val_files=[{root / 'val.jsonl'}]",
            "eval.every=2",
            "eval.k=3",
            "eval.temperature=0.6",  # not the rollout's 1.0: logprobs taken at it would show in the mismatch
        ]

    def build(root: Path) -> None:
        write_jsonl(root / "train.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=64, seed=0))
        write_jsonl(root / "val.jsonl", generate_rows(kind="arithmetic", schema="dapo", n=5, seed=1))
        run = [*overrides(root), "trainer.wandb_project=tiny", f"trainer.run_dir={root / 'run'}"]
        (root / "stdout.txt").write_text(run_train(run, **wandb_env(root)).stdout)

    root = _built_once(tmp_path_factory, "two_steps", build)
    return overrides(root), root / "run", (root / "stdout.txt").read_text()
