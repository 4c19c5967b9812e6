"""Benchmark the fused Triton DAPO policy loss against the PyTorch reference (eager and compiled).

    python tools/bench_kernel.py                          # 1M..128M tokens, bf16 logp
    python tools/bench_kernel.py --sizes 1M,16M --dtype fp32 --is-weight --json runs/bench_kernel.json

First checks the kernel against megatron_dapo.algorithm.policy_loss at a small size (both
gradient paths); then, per size N (rounded down to whole responses of --seq-len tokens, with
ragged padding): forward and forward+backward time (CUDA events, warm-up, median), bytes moved
against the floor (one read of each input + one write of the gradient), GB/s, and the fraction
of the device-to-device copy bandwidth measured in the same run. The fused kernel is timed
twice: skipping padding in its loads (the default) and with plain vector loads.
Without CUDA it runs the equality check in Triton's interpreter, says so, and exits 0.

The checks and timings live in megatron_dapo/preflight/kernel_bench.py, the copy bandwidth in megatron_dapo/model/perf.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import torch

from megatron_dapo.cli import argument_parser, parse_tokens
from megatron_dapo.model.dtypes import torch_dtype
from megatron_dapo.model.perf import copy_bandwidth_gbs


def print_table(rows: list[dict]) -> None:
    head = f"{'tokens':>9} {'impl':>28} {'phase':>8} {'ms':>9} {'floor MB':>9} {'moved MB':>9} {'floor GB/s':>10} {'moved GB/s':>10} {'%copy':>6} {'x eager':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>9} {r['impl']:>28} {r['phase']:>8}  error: {r['error']}")
            continue
        moved = f"{r['moved_bytes'] / 1e6:9.1f}" if r["moved_bytes"] is not None else f"{'-':>9}"
        mgbs = f"{r['moved_gbs']:10.0f}" if "moved_gbs" in r else f"{'-':>10}"
        frac = f"{100 * r['frac_copy_bw']:5.0f}%" if "frac_copy_bw" in r else f"{'-':>6}"
        print(
            f"{r['tokens']:>9} {r['impl']:>28} {r['phase']:>8} {r['ms']:9.3f} {r['floor_bytes'] / 1e6:9.1f} {moved} "
            f"{r['floor_gbs']:10.0f} {mgbs} {frac} {r.get('speedup_vs_eager', float('nan')):7.2f}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--sizes", default="1M,4M,16M,64M,128M", help="comma-separated token counts (K/M/G suffixes)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="logp dtype (old_logp is fp32)")
    ap.add_argument("--seq-len", type=int, default=4096, help="T: tokens per response")
    ap.add_argument("--per-token-adv", action="store_true", help="[B, T] advantages instead of [B]")
    ap.add_argument("--is-weight", action="store_true", help="with truncated-IS weights")
    ap.add_argument("--valid", type=float, default=0.8, help="mean fraction of valid (non-padding) tokens")
    ap.add_argument("--dual-clip", type=float, default=None, help="dual-clip c (default: off)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    dtype = torch_dtype(args.dtype)

    if not torch.cuda.is_available():
        print("No CUDA device: running the equality check in Triton's interpreter (TRITON_INTERPRET=1) only.")
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels JIT lazily, so this still takes effect
        from megatron_dapo.preflight.kernel_bench import equality_check

        ok = equality_check("cpu", b=4, t=1001)
        print("Equality check " + ("passed" if ok else "FAILED") + "; timings need a GPU, skipped.")
        return 0 if ok else 1

    import triton

    from megatron_dapo.preflight.kernel_bench import bench_size, equality_check

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not equality_check("cuda"):
        print("Equality check FAILED: not timing a wrong kernel.")
        return 1
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    if hasattr(torch._dynamo.config, "cache_size_limit"):  # one recompile per size and phase
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows = []
    for size in (parse_tokens(s) for s in args.sizes.split(",")):
        rows += bench_size(size, args, copy_gbs, dtype)
        torch.cuda.empty_cache()  # the reference's intermediates at this size are garbage now
    print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "args": vars(args),
                    "copy_gbs": copy_gbs,
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
