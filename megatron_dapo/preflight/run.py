"""GPU preflight: every check this machine can run, in one command; the others are skipped with the reason.

    python tools/preflight.py                               # all checks this machine allows (CPU here: < 3 min)
    python tools/preflight.py --fast --json runs/pf.json    # tiny sizes (what the test runs)
    python tools/preflight.py --only env,kernel_equality,bridge
    PYTHONPATH=$PWD/.gpu_site python3 tools/preflight.py --deadline-s 560 --json $OUT/preflight.json   # GPU machine

Checks, in order (CUDA: needs a GPU; vLLM / TE: needs the package):
  env              versions of torch, CUDA, triton, megatron-core, vLLM (in SUPPORTED_VLLM?), TE, transformers; GPU
  limits           CUDA: device-to-device copy GB/s and bf16 matmul TFLOP/s, the denominators of the rows below
  kernel_equality  the fused Triton loss against the PyTorch reference (fp32 and bf16, loss, statistics, both
                   gradient paths): compiled on a GPU (never the interpreter there), in Triton's interpreter on CPU
  kernel_timing    CUDA: fused loss vs eager PyTorch vs torch.compile at 1M-64M tokens, bytes moved as a fraction
                   of the copy bandwidth
  train_tiny       the DAPO train step (old-logprob forward, forward + backward + AdamW) of a tiny shape: tokens/s
                   and MFU, activation recompute off and on (CPU: fp32, MFU against this CPU's own matmul rate)
  train_0.5b/1.5b  CUDA: the same, bf16, Qwen2.5-0.5B and 1.5B shapes at sequence 4096, with peak GPU memory:
                   SDPA attention (the default), Megatron's unfused attention without and with selective
                   recompute, SDPA with full recompute; MFU against the measured matmul rate and the card's spec
  profile          CUDA: one profiled 1.5B train step: the share of device time in attention, GEMMs, the vocabulary
                   path and the optimizer, and the top kernels (JSON)
  determinism      the same two train steps twice from the same weights and batch: loss, gradient norm and old
                   logprobs bit-identical
  bridge           vLLM: Megatron -> vLLM weight sync into an engine started from dummy weights (GPU: the 1.5B
                   shape; GB/s against the copy bandwidth), then the engine's sampling logprobs for fixed prompts
                   against the Megatron policy's for the same tokens, after a sync, with stale weights (perturbed
                   policy, no sync: must differ) and after the next sync
  bridge_fp8       vLLM: the same with rollout.quantization=fp8 (GPU: a block-FP8 engine, weights quantized at each
                   sync; CPU: FP8-rounded weights): the mismatch it adds, the quantization seconds, and generated
                   tokens/s against bridge's
  moe              CUDA + vLLM: a small Qwen3-MoE (random weights, EP 1, TE's grouped GEMM where present) synced into a
                   bf16 engine that returns its routes; samples streamed with their routes, the trainer's logprobs of
                   them routing by itself and replaying the engine's routes (R3): routes flipped, router agreement,
                   rollout/kl both ways; then one R3 train step (forward, backward, AdamW)
  sleep_wake       CUDA + vLLM: GPU memory freed by sleep() and given back by wake(); greedy generation unchanged
                   after wake and after a weight update made while asleep (the trainer's cycle)
  inflight_update  CUDA + vLLM: asynchronous DAPO's weight update between two engine steps with groups in flight
                   (recompute_kv and keep_kv): none lost, each token tagged and sampled by its policy, the pause
  train_e2e        CUDA + vLLM: the trainer end to end under torchrun (Megatron policy and vLLM engine in one
                   process, streamed rollouts, syncs, checkpoints), two steps of a random tiny model; then the
                   same split in two processes (pipeline.mode=async at eta 0, weights over gloo on the one GPU)
  te               CUDA + TE: the train step with Transformer Engine layers (packed THD sequences) at the 0.5B
                   and 1.5B shapes, bf16 and FP8 (current scaling, compute capability 8.9+); TE's logprobs against
                   the local layers' on the same weights, packed against padded, and determinism

Each check runs in its own process (python -m megatron_dapo.preflight --child NAME), so a crash, a CUDA error or
a hang is that check's failure and the others still run; the parent prints one table row per check as it finishes
and rewrites the --json file after each, so a run stopped early keeps what it measured. Results: pass, fail (with
the error and the end of the check's log in the JSON) or skip (with the reason). A timing row passes when it ran
and its numbers are finite: its reference column says what to compare them with (no GPU number in it has been
measured here). Exit status 1 if any check failed; skips are fine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.cli import argument_parser
from megatron_dapo.preflight.checks import Check, check_env, check_limits
from megatron_dapo.preflight.engine_checks import (
    check_bridge,
    check_bridge_fp8,
    check_inflight_update,
    check_sleep_wake,
    check_train_e2e,
)
from megatron_dapo.preflight.kernel_checks import check_kernel_equality, check_kernel_timing
from megatron_dapo.preflight.moe_checks import check_moe
from megatron_dapo.preflight.train_checks import check_determinism, check_profile, check_te, train_check

MIN_CHECK_S = 30
"""Under --deadline-s, a check with less time than this left is not started (skipped, with the reason)."""

CHILD = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "megatron_dapo.preflight"]
"""How a check's process starts: this package as a module, without the working directory on sys.path (-P), so
the installed megatron_dapo (with its kernels) is the one imported, as in the parent."""


@dataclass
class Row:
    """One check's result: what the table prints and the JSON keeps."""

    name: str
    status: str  # "pass" | "fail" | "skip"
    numbers: dict[str, Any] = field(default_factory=dict)
    reference: str = ""
    reason: str = ""  # why it failed or was skipped
    seconds: float = 0.0
    details: Any = None  # long results (per-size timings, the equality lines): JSON only
    log_tail: str = ""  # the end of a failed check's output


CHECKS = [
    Check("env", check_env, (), "vLLM in megatron_dapo.rollout.vllm_env.SUPPORTED_VLLM", 120),
    Check(
        "limits",
        check_limits,
        ("cuda",),
        "KINDS.md: H100 ~3000 GB/s copy, ~800 TFLOP/s (8192^3); H200 ~4300 GB/s, ~790 (this times 4096^3)",
        180,
    ),
    Check("kernel_equality", check_kernel_equality, (), "loss/stats 2e-6 relative; grad 1e-6 (fp32), 2^-7 (bf16)", 300),
    Check(
        "kernel_timing",
        check_kernel_timing,
        ("cuda",),
        "fused fwd+bwd: x eager and x compiled > 1; bytes moved / copy bandwidth -> 1 at large sizes",
        480,
    ),
    Check("train_tiny", train_check("tiny"), (), "MFU vs this device's own matmul rate; recompute costs ~1/3", 300),
    Check("train_0.5b", train_check("qwen2.5-0.5b"), ("cuda",), "bf16 MFU; compare with 1.5b and recompute", 420),
    Check("train_1.5b", train_check("qwen2.5-1.5b"), ("cuda",), "bf16 MFU, peak GiB at seq 4096", 480),
    Check(
        "profile",
        check_profile,
        ("cuda",),
        "one 1.5B step's device time: attention <= 0.15, vocabulary (range) <= 0.08",
        300,
    ),
    Check("determinism", check_determinism, (), "bit-identical loss, grad norm and logprobs, two steps", 420),
    Check(
        "bridge",
        check_bridge,
        ("vllm",),
        "|vLLM - Megatron| logprob: fp32 1e-4 mean / 1e-3 max; bf16 0.05 / 0.5; stale > 10x tolerance",
        480,
    ),
    Check(
        "bridge_fp8",
        check_bridge_fp8,
        ("vllm",),
        "FP8 engine vs bf16 Megatron: 0.5 mean / 3.0 max (H200: 0.22-0.33 / 0.86-1.14); stale > 2x; tokens/s vs bridge's",
        420,
    ),
    Check(
        "moe",
        check_moe,
        ("cuda", "vllm"),
        "routes for every position; rollout/kl with R3 <= routing by itself (lower where routes flipped); "
        "R3 train step applied, finite",
        480,
    ),
    Check("sleep_wake", check_sleep_wake, ("cuda", "vllm"), "freed > 1 GiB, restored within 1 GiB, same tokens", 420),
    Check(
        "inflight_update",
        check_inflight_update,
        ("cuda", "vllm"),
        "tokens tagged v sit < 0.2x as far from policy v's logprob as from the other's (recompute_kv)",
        300,
    ),
    Check(
        "train_e2e",
        check_train_e2e,
        ("cuda", "vllm"),
        "colocated, then split (async, eta 0): 2 steps each exit 0, finite metrics, engine vs Megatron logprob "
        "< 0.05 mean, 2 checkpoints",
        420,
    ),
    Check(
        "te",
        check_te,
        ("cuda", "te"),
        "TE >= 1.15x train_*'s SDPA tokens/s; FP8 ~1.1-1.2x TE bf16; logp vs local < 0.05 mean, packed vs padded "
        "< 0.05 max; 2/2 identical",
        540,
    ),
]
BY_NAME = {c.name: c for c in CHECKS}


# ----------------------------------------------------------------------------- the child: one check


def run_child(name: str, ctx: dict, out: Path) -> None:
    """Run one check in this process and write its Row as JSON to out; an exception is a failed row."""
    check = BY_NAME[name]
    t0 = time.perf_counter()
    try:
        res = check.run(ctx)
        row = Row(name, "pass" if res.ok else "fail", res.numbers, check.reference, res.reason, details=res.details)
    except Exception as e:
        traceback.print_exc()
        row = Row(name, "fail", reference=check.reference, reason=f"{type(e).__name__}: {e}"[:1000])
    row.seconds = round(time.perf_counter() - t0, 2)
    out.write_text(json.dumps(asdict(row), default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM and torch.distributed can leave threads that block a normal exit; the row is written
    os._exit(0)


# ----------------------------------------------------------------------------- the parent: orchestration


def child_env(name: str, cuda: bool) -> dict[str, str]:
    """The check's environment: rank 0 of a one-process torchrun-style world (so a GPU engine uses the trainer's
    external_launcher path), and Triton's interpreter for the CPU kernel check only."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    # port 0: the world of one's store binds a port of its own choosing (one picked here could be taken first)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if name == "te":  # TE's fused attention backward is deterministic only when told (read at its import)
        env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    if name == "kernel_equality" and not cuda:
        env["TRITON_INTERPRET"] = "1"  # read when the kernel is first compiled: set before the child starts
    return env


def spawn(check: Check, ctx: dict, timeout: float, cuda: bool) -> Row:
    """Run a check in a fresh process group; a crash, a hang past timeout or a missing row is a failed row."""
    with tempfile.TemporaryDirectory(prefix="preflight_") as tmp:
        row_file, log_file = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [*CHILD, "--child", check.name, "--ctx", json.dumps(ctx)]
        t0 = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.Popen(
                [*cmd, "--row", str(row_file)],
                env=child_env(check.name, cuda),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: whatever it started goes with it below
            )
            try:
                proc.wait(timeout=timeout)
                why = None if row_file.is_file() else f"the check's process exited with status {proc.returncode}"
            except subprocess.TimeoutExpired:
                why = f"timed out after {timeout:.0f} s"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # leftovers would hold GPU memory the next check needs
                proc.wait()
        seconds = round(time.perf_counter() - t0, 1)
        log_tail = log_file.read_text(errors="replace")[-4000:]
        if why is not None:
            return Row(check.name, "fail", reference=check.reference, reason=why, seconds=seconds, log_tail=log_tail)
        row = Row(**json.loads(row_file.read_text()))
        if row.status == "fail":
            row.log_tail = log_tail
        return row


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_row(row: Row) -> None:
    """One check: name, result, seconds, then its numbers (or reason) and reference, wrapped under it."""
    import textwrap

    head = f"{row.name:<16} {row.status:<5} {row.seconds:7.1f}s  "
    body = ", ".join(f"{k} {_fmt(v)}" for k, v in row.numbers.items() if not isinstance(v, (list, dict)))
    if row.reason:
        body = (body + " | " if body else "") + row.reason
    lines = textwrap.wrap(body or "-", 100) or ["-"]
    print(head + lines[0])
    indent = " " * len(head)
    for line in lines[1:]:
        print(indent + line)
    if row.reference and row.status != "skip":
        for line in textwrap.wrap("ref: " + row.reference, 100):
            print(indent + line)
    sys.stdout.flush()


def parse_only(text: str | None) -> list[Check]:
    if not text:
        return list(CHECKS)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in BY_NAME]
    if unknown:
        raise SystemExit(f"--only: unknown checks {unknown}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[x] for x in dict.fromkeys(names)]  # the order given: a device call puts what matters first


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--fast", action="store_true", help="tiny sizes everywhere (the test's mode)")
    ap.add_argument("--only", default=None, help=f"comma-separated checks, run in the order given: {','.join(BY_NAME)}")
    ap.add_argument("--json", default=None, help="write every row here (rewritten after each check)")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="finish within this many seconds: a check still running is stopped",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args.child, json.loads(args.ctx), Path(args.row))

    import torch

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    have = {"cuda": cuda, "vllm": importlib.util.find_spec("vllm") is not None}
    # TE's mere presence breaks `import megatron.core` without CUDA: only looked for on a GPU machine
    have["te"] = cuda and importlib.util.find_spec("transformer_engine") is not None
    why_not = {
        "cuda": f"needs CUDA: torch {torch.__version__} sees no GPU here",
        "vllm": "needs vLLM: not installed",
        "te": "needs Transformer Engine: not installed (`python tools/offline_install te` builds and stages it for GPU nodes)",
    }
    ctx: dict[str, Any] = {"fast": args.fast}
    rows: list[Row] = []
    report = {"argv": sys.argv[1:], "fast": args.fast, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{'check':<16} {'result':<5} {'time':>8}  numbers")
    for check in parse_only(args.only):
        missing = [need for need in check.needs if not have[need]]
        elapsed = time.perf_counter() - t0
        if missing:
            row = Row(check.name, "skip", reference=check.reference, reason=why_not[missing[0]])
        elif args.deadline_s is not None and args.deadline_s - elapsed < MIN_CHECK_S:
            reason = (
                f"not started: {max(0.0, args.deadline_s - elapsed):.0f} s left of --deadline-s {args.deadline_s:g}"
            )
            row = Row(check.name, "skip", reference=check.reference, reason=reason)
        else:
            left = check.timeout_s if args.deadline_s is None else min(check.timeout_s, args.deadline_s - elapsed)
            row = spawn(check, ctx, left, cuda)
        if check.name == "limits" and row.status == "pass":  # the denominators of the later rows
            ctx.update(copy_gbs=row.numbers["copy_gbs"], peak_tflops=row.numbers["bf16_tflops"])
        rows.append(row)
        print_row(row)
        if args.json:
            report["seconds"] = round(time.perf_counter() - t0, 1)
            report["summary"] = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**report, "rows": [asdict(r) for r in rows]}, indent=1, default=str))
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
    print(f"\n{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip in {time.perf_counter() - t0:.0f} s")
    return 1 if counts["fail"] else 0
