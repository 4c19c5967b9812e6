"""The README and docs/ as a new user meets them: every relative link and anchor resolves, the README stays short and
free of history (commit hashes, dates: benchmarks/RESULTS.md keeps those), and its commands work from a fresh clone:
the two make targets' set-up (`make -n`: torch's CPU pin installed first and alone), the demo's entry point, and the
32B job rendered by `launch slurm --print-only` and the batch script's dry run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
ISSUE = re.compile(
    r"\b[Ii]ssue \d+|\blent\b|\bleases?\b"
)  # the work items that built the code are the project's history, not the user's


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces to hyphens, repeats -N."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_finds_a_broken_link_and_anchor(tmp_path):
    """The check itself: a missing file, a missing anchor and a repeated heading's anchor."""
    (tmp_path / "a.md").write_text("# Top\n\n## Set-up: `make` it\n\n## Set-up: `make` it\n")
    page = tmp_path / "b.md"
    page.write_text("[x](a.md#set-up-make-it-1) ![y](missing.png) [z](a.md#nowhere) [w](https://e.org/#q)\n")
    assert _links(page) == ["a.md#set-up-make-it-1", "missing.png", "a.md#nowhere"]
    assert _anchors(tmp_path / "a.md") == {"top", "set-up-make-it", "set-up-make-it-1"}


def test_readme_is_short_and_readme_and_docs_hold_no_history():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    found = [
        f"{page.relative_to(REPO)}:{n}: {m.group()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in (*HASH.finditer(line), *DATE.finditer(line), *ISSUE.finditer(re.sub(r"\]\([^)]*\)", "]", line)))
    ]
    assert not found, "commit hashes and dates belong in benchmarks/RESULTS.md: " + "; ".join(found)
    assert HASH.search("at a36e717 and") and DATE.search("on 2026-11-28,") and not HASH.search("deadline 1234567")
    assert (
        ISSUE.search("Issue 27 asks")
        and ISSUE.search("the one GPU lease so far")
        and not ISSUE.search(re.sub(r"\]\([^)]*\)", "]", "[x](R.md#y-issue-16)"))
    )


def _fresh_clone(dest: Path) -> Path:
    """What `git clone` of this work tree gives: its tracked files (a copy without .git: every file but outputs)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode == 0:
        for rel in filter(None, listed.stdout.decode().split("\0")):
            if (REPO / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, dest / rel)
    else:
        skip = shutil.ignore_patterns(".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
        shutil.copytree(REPO, dest, ignore=skip, dirs_exist_ok=True)
    return dest


def _readme_blocks() -> list[list[str]]:
    """The README's indented command blocks: each a list of commands (continuation lines joined, comments dropped)."""
    blocks, block = [], []
    for line in (REPO / "README.md").read_text().splitlines() + [""]:
        stripped = line.strip()
        if re.match(r"^ {4,}\S", line) and not line.lstrip().startswith(("|", "!", "[")):
            block.append(stripped)
        elif block:
            joined = "\n".join(block).replace("\\\n", " ")
            blocks.append([re.sub(r"\s+#.*$", "", c).strip() for c in joined.splitlines()])
            block = []
    return blocks


def test_readme_set_up_and_the_32b_job_from_a_fresh_clone(tmp_path):
    clone = _fresh_clone(tmp_path / "clone")
    first = _readme_blocks()[0]
    assert first == ["make demo", "make test"]  # the README's first lines: the two commands
    venv = tmp_path / "fresh-venv"  # a machine with nothing installed yet
    for target in ("demo", "test"):
        plan = subprocess.run(
            ["make", "-n", target, f"VENV={venv}", "PYTHON=python3"], cwd=clone, capture_output=True, text=True
        )
        assert plan.returncode == 0, plan.stderr
        lines = plan.stdout.splitlines()
        torch = next(i for i, c in enumerate(lines) if "pip install" in c and "torch==" in c)
        package = next(i for i, c in enumerate(lines) if "pip install" in c and "-e " in c)
        assert torch < package and lines[torch].split()[-1] == "torch==2.13.0", lines  # alone, the CPU build first
        assert "[dev,cpu,demo,ray]" in lines[package]
        assert any(re.search(r"python -m (megatron_dapo\.demo|pytest)", c) for c in lines[package:])
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1"}
    demo = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.demo", "--help"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert demo.returncode == 0 and "--seed" in demo.stdout, demo.stderr

    # the 32B job: the README's `launch slurm --print-only`, then the batch script's dry run with what it printed
    render = next(c for b in _readme_blocks() for c in b if "launch slurm --config examples/" in c)
    words = [w.replace("/models", str(tmp_path / "models")) for w in shlex.split(render)]
    words = [w.replace("/data/", f"{tmp_path}/data/").replace("/scratch", str(tmp_path)) for w in words]
    shown = subprocess.run([sys.executable, *words[1:]], cwd=clone, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    variables, sbatch = shown.stdout.strip().split(" sbatch ", 1)
    settings = dict(v.split("=", 1) for v in shlex.split(variables))
    assert settings["CONFIG"] == "examples/dapo_math_qwen2.5_32b.yaml" and "--nodes=16" in sbatch
    model = Path(settings["MODEL_PATH"])
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    for name in ("DATA_PATH", "VAL_PATH"):
        Path(settings[name]).parent.mkdir(parents=True, exist_ok=True)
        Path(settings[name]).write_bytes(b"")
    from test_slurm import FAKE_SCONTROL

    fake = tmp_path / "fake" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(FAKE_SCONTROL)
    fake.chmod(0o755)
    venv = tmp_path / "cluster-venv"  # the cluster's virtualenv: a dry run never runs its programs
    for name in ("python", "torchrun"):
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / name).write_text("#!/bin/sh\nexit 99\n")
        (venv / "bin" / name).chmod(0o755)
    job = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    job.update(settings, VENV=str(venv), PATH=f"{fake.parent}:{env['PATH']}", FAKE_DIR=str(fake.parent), SLURM_JOB_ID="7",
               SLURM_JOB_NODELIST="gpu[001-016]", SLURM_NNODES="16", SLURM_SUBMIT_DIR=str(clone))  # fmt: skip
    script_args = shlex.split(sbatch)[3:]  # after `--nodes=16 --gpus-per-node=8 slurm/train_qwen32b.sh`
    dry = subprocess.run(
        ["bash", "slurm/train_qwen32b.sh", "--dry-run", *script_args],
        cwd=clone,
        env=job,
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("torchrun") >= 16 and "trainer.total_steps=400" in dry.stdout
    assert f"model.hf_path={model}" in dry.stdout
