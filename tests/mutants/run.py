"""make mutants: plausible one-line bugs, each applied to a scratch copy of the project, must fail the tests named for it.

Each mutant in the *.toml files beside this script (one file per layer) names a file, an exact snippet of it (found exactly once), the
snippet's replacement, the bug that stands for, and the tests that must catch it. The scratch copy holds the whole
work tree (package, tests, tools, scripts); pytest runs from it, and PYTHONPATH puts it first for every subprocess the tests start
(torchrun workers, the trainer, tools), so the mutated package is the one every process imports.

First the named tests run on the unmutated copy: they must pass, or a "killed" would mean nothing. Then, for each
mutant: patch, run its tests (stopping at the first failure), restore. A table follows (mutant, tests, killed or
survived); the exit status is 1 if any mutant survived or could not be run.

    python tests/mutants/run.py                     # every mutant
    python tests/mutants/run.py --only NAME ...     # some of them
    python tests/mutants/run.py --list              # the mutants and their tests, nothing run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tomllib  # Python 3.11+: make mutants runs in the project's virtualenv

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    bug: str
    tests: tuple[str, ...]


def load_mutants(folder: Path = HERE) -> list[Mutant]:
    """The mutants of every *.toml in folder, each checked against the work tree: a snippet found exactly once, a
    real change, tests named."""
    rows = []
    for path in sorted(folder.glob("*.toml")):
        with open(path, "rb") as f:
            rows += [(path.name, i, row) for i, row in enumerate(tomllib.load(f).get("mutant", []))]
    mutants, names = [], set()
    for file_name, i, row in rows:
        where = f"tests/mutants/{file_name}: mutant {i} ({row.get('name', '?')})"
        missing = [k for k in ("name", "file", "find", "replace", "bug", "tests") if k not in row]
        if missing:
            raise SystemExit(f"{where}: field(s) {missing} missing")
        m = Mutant(row["name"], row["file"], row["find"], row["replace"], row["bug"], tuple(row["tests"]))
        if m.name in names:
            raise SystemExit(f"{where}: the name {m.name!r} is used twice")
        names.add(m.name)
        source = REPO / m.file
        if not source.is_file():
            raise SystemExit(f"{where}: file {m.file!r} does not exist")
        count = source.read_text().count(m.find)
        if count != 1:
            raise SystemExit(f"{where}: field 'find' occurs {count} times in {m.file}, expected exactly once")
        if m.find == m.replace or not m.tests:
            raise SystemExit(f"{where}: expected a replacement that differs and at least one test")
        mutants.append(m)
    return mutants


def scratch_copy(dest: Path) -> Path:
    """The work tree (tracked and untracked files git does not ignore) under dest."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def environment(copy: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(copy), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_from(copy: Path) -> None:
    """The copy, not the installed work tree, is what a subprocess imports (the editable install maps it too)."""
    probe = "import megatron_dapo, megatron_dapo.kernels as k; print(megatron_dapo.__file__); print(k.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tempfile.gettempdir(), env=environment(copy), capture_output=True, text=True
    )
    paths = out.stdout.split()
    if out.returncode or len(paths) != 2 or not all(Path(p).is_relative_to(copy) for p in paths):
        raise SystemExit(f"the scratch copy is not what subprocesses import: {out.stdout}{out.stderr}")


def pytest(copy: Path, tests: list[str], stop_first: bool, extra: list[str] = ()) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rf", *extra]
    cmd += ["-x"] if stop_first else []
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, *tests], cwd=copy, env=environment(copy), capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def run_mutant(copy: Path, m: Mutant) -> tuple[str, float, str]:
    """'killed' (a named test failed), 'survived' (all passed) or 'error' (pytest could not run them)."""
    target = copy / m.file
    original = target.read_text()
    target.write_text(original.replace(m.find, m.replace))
    try:
        rc, out, seconds = pytest(copy, list(m.tests), stop_first=True)
    finally:
        target.write_text(original)
    verdict = {0: "survived", 1: "killed"}.get(rc, "error")
    return verdict, seconds, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run side by side, each in its own copy (default 2)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (their paths are printed)")
    args = ap.parse_args()

    mutants = load_mutants()
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            raise SystemExit(f"--only: no mutant named {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}  ({m.file})\n    bug:   {m.bug}\n    tests: {' '.join(m.tests)}")
        return 0

    root = Path(tempfile.mkdtemp(prefix="mutants-"))
    jobs = max(1, min(args.jobs, len(mutants)))
    copies = [scratch_copy(root / f"copy{j}") for j in range(jobs)]
    check_imports_from(copies[0])
    if not args.no_baseline:
        union = sorted({t for m in mutants for t in m.tests})
        rc, out, seconds = pytest(copies[0], union, stop_first=False, extra=["-n", str(jobs), "--dist", "loadfile"])
        print(f"unmutated: {len(union)} tests in {seconds:.0f} s: {'pass' if rc == 0 else 'FAIL'}", flush=True)
        if rc != 0:
            print(out[-6000:])
            raise SystemExit("the named tests fail without a mutant: fix them first (a kill would mean nothing)")

    results: dict[str, tuple[str, float, str]] = {}

    def worker(j: int) -> None:
        for m in mutants[j::jobs]:
            results[m.name] = run_mutant(copies[j], m)
            verdict, seconds, out = results[m.name]
            print(f"{m.name}: {verdict} ({seconds:.0f} s)", flush=True)
            if verdict != "killed":
                print(out[-3000:], flush=True)

    t0 = time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(worker, range(jobs)))

    width = max(len(m.name) for m in mutants)
    print(f"\n| {'mutant':<{width}} | tests | result | seconds |\n| {'-' * width} | --- | --- | --- |")
    for m in mutants:
        verdict, seconds, _ = results[m.name]
        tests = ", ".join(t.replace("tests/", "") for t in m.tests)
        print(f"| {m.name:<{width}} | {tests} | {verdict} | {seconds:.0f} |")
    bad = [m.name for m in mutants if results[m.name][0] != "killed"]
    print(f"\n{len(mutants) - len(bad)} of {len(mutants)} mutants killed in {time.monotonic() - t0:.0f} s", end="")
    print(f"; not killed: {', '.join(bad)}" if bad else "")
    if args.keep:
        print(f"scratch copies: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
