"""Shared by the conversion tests: run the conversion tools through their real CLI, and two Megatron workers.

With in-one-process first, it runs a tool's main() on each of a JSON list of argument lists, in turn:

    python tests/convert_helpers.py in-one-process convert_megatron_to_hf '[["--megatron", ...], ...]'

As a script (Megatron runs only in subprocesses, away from pytest's process), it loads each given
converted checkpoint into a GPTModel built at TP=1, PP=1 in float32 and saves its logits for the given
tokens:

    python tests/convert_helpers.py --tokens tokens.pt --out logits.pt CKPT_DIR [CKPT_DIR ...]

tokens.pt holds a [b, s] long tensor; logits.pt a dict {CKPT_DIR: [b, s, vocab] float32 logits}.

Under torchrun, with train-checkpoint first, it writes a training run's checkpoint as the trainer does:
a MegatronPolicy built from HF_DIR's weights takes one DAPO train step and megatron_dapo.checkpoint's
CheckpointManager saves it (model and optimizer) as RUN/checkpoints/step_00000001, next to RUN/config.yaml;
OUT gets the trained policy's weights as full Hugging Face tensors (what the checkpoint holds):

    torchrun --nproc-per-node N tests/convert_helpers.py train-checkpoint HF_DIR RUN OUT [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

from megatron_dapo.launch import torchrun

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"


_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_tool(tool: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run tools/{tool}.py with args; returns the finished process (stdout and stderr as text)."""
    cmd = [sys.executable, str(TOOLS / f"{tool}.py"), *args]
    return subprocess.run(cmd, env={**os.environ, **_ENV}, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@functools.cache
def tool_module(tool: str) -> types.ModuleType:
    """tools/{tool}.py imported as a module (for its main(argv) in the test's process), once."""
    spec = importlib.util.spec_from_file_location(f"tools.{tool}", TOOLS / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all_ok(runs: list[tuple[str, list[str] | list[list[str]]]], timeout: int = 300) -> list[str]:
    """Run several (tool, args) at once (their start-up is mostly imports and waits); returns their stdouts.

    A run whose args is a list of argument lists is the tool's main() on each in turn in one process (this file's
    `in-one-process` mode: the imports paid once); its stdout is theirs, one after another. Every run must succeed;
    the assertion shows a failed run's output tails.
    """
    procs = []
    for tool, args in runs:
        if args and isinstance(args[0], list):
            cmd = [sys.executable, __file__, "in-one-process", tool, json.dumps(args)]
        else:
            cmd = [sys.executable, str(TOOLS / f"{tool}.py"), *args]
        procs.append(
            subprocess.Popen(
                cmd, env={**os.environ, **_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        )
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for (tool, args), proc, (out, err) in zip(runs, procs, outputs):
        assert proc.returncode == 0, f"{tool} {args} failed:\n{out[-3000:]}\n{err[-5000:]}"
    return [out for out, _ in outputs]


def run_ok(tool: str, *args: str) -> subprocess.CompletedProcess:
    """run_tool that must succeed; the assertion shows the tool's output tails."""
    proc = run_tool(tool, *args)
    assert proc.returncode == 0, f"{tool} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def megatron_logits(ckpts: list[Path], tokens, out: Path) -> dict:
    """Run this file as the logits worker on ckpts; returns {str(ckpt): logits [b, s, vocab]}."""
    import torch

    torch.save(tokens, out.with_suffix(".tokens.pt"))
    cmd = [sys.executable, __file__, "--tokens", str(out.with_suffix(".tokens.pt")), "--out", str(out)]
    env = {**os.environ, **_ENV}
    proc = subprocess.run([*cmd, *map(str, ckpts)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"logits worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(out)


def training_checkpoint(hf_dir: Path, run: Path, out: Path, nproc: int, *overrides: str) -> dict:
    """Run this file's train-checkpoint worker on nproc ranks; returns the checkpointed weights {HF name: tensor}."""
    import torch

    cmd = [*torchrun.command(nproc), __file__, "train-checkpoint", str(hf_dir), str(run), str(out), *overrides]
    proc = subprocess.run(cmd, env={**os.environ, **_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"train-checkpoint worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(out)


def _training_worker(argv: list[str]) -> None:
    import torch

    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.config import load_config, to_yaml
    from megatron_dapo.convert.layouts import hf_to_megatron, megatron_to_hf
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.policy import MegatronPolicy, TrainSample
    from megatron_dapo.model.provider import tp_gathered_tensors
    from megatron_dapo.trainer import policy_options

    hf_dir, run, out, *overrides = argv
    base = ["model.dtype=fp32", "optim.lr=1e-2", "optim.warmup_steps=0", f"model.hf_path={hf_dir}"]
    cfg = load_config(overrides=[*base, f"trainer.run_dir={run}", *overrides])
    arch = ModelArch.from_hf_dir(hf_dir)
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    policy = MegatronPolicy(arch, layout, hf_to_megatron(dict(SafetensorsReader(hf_dir)), arch), **policy_options(cfg))
    g = torch.Generator().manual_seed(0)
    samples = [
        TrainSample(
            prompt_ids=torch.randint(0, arch.vocab_size, (4,), generator=g).tolist(),
            response_ids=torch.randint(0, arch.vocab_size, (6,), generator=g).tolist(),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(4)
    ]
    first = policy.compute_logprobs(samples, 1.0)
    if first is not None:  # the last pipeline stage
        for s, f in zip(samples, first):
            s.old_logp = f["logp"]
    assert policy.train_step(samples, 1.0)["actor/update_applied"] == 1.0
    if layout.rank == 0:
        Path(run).mkdir(parents=True, exist_ok=True)
        (Path(run) / "config.yaml").write_text(to_yaml(cfg))  # as megatron_dapo.train does
    CheckpointManager(Path(run) / "checkpoints").save(policy, 1, {})
    weights = {}
    for name, tensor in tp_gathered_tensors(policy.model, arch, layout).items():
        weights.update(megatron_to_hf(name, tensor, arch))
    if layout.rank == 0:
        torch.save({name: t.clone() for name, t in weights.items()}, out)
    destroy_parallel()


def _worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("ckpts", nargs="+")
    args = ap.parse_args()

    import torch

    from megatron_dapo.config import load_config
    from megatron_dapo.convert.megatron_io import load_megatron_checkpoint
    from megatron_dapo.model.arch import ModelArch
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.provider import build_model_chunks

    tokens = torch.load(args.tokens)
    cfg = load_config(overrides=["model.dtype=fp32"])
    layout = init_parallel(ModelArch.from_hf_dir(args.ckpts[0]), cfg.parallel, cfg.model, seed=0)
    result = {}
    for ckpt in args.ckpts:
        arch = ModelArch.from_hf_dir(ckpt)  # the checkpoint's own copy of config.json
        (model,) = build_model_chunks(arch, cfg.model, layout)
        load_megatron_checkpoint([model], ckpt)
        model.eval()
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
        with torch.no_grad():
            logits = model(tokens, position_ids, attention_mask=None)  # [b, s, padded vocab]
        result[ckpt] = logits[..., : arch.vocab_size].float().clone()
    torch.save(result, args.out)
    destroy_parallel()


def _in_one_process(tool: str, argvs: list[list[str]]) -> None:
    """tools/{tool}.py's main(argv) for each argv in turn; stops at the first that fails."""
    for argv in argvs:
        code = tool_module(tool).main(argv)
        if code:
            sys.exit(f"{tool} {argv} exited {code}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["train-checkpoint"]:
        _training_worker(sys.argv[2:])
    elif sys.argv[1:2] == ["in-one-process"]:
        _in_one_process(sys.argv[2], json.loads(sys.argv[3]))
    else:
        _worker()
