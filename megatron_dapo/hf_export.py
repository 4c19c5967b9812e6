"""Convert a megatron-dapo Megatron-Core checkpoint back into a Hugging Face model directory.

    python tools/convert_megatron_to_hf.py --megatron /ckpt/qwen7b-mcore --out /models/qwen7b-dapo --dtype bf16
    python tools/convert_megatron_to_hf.py --megatron runs/dapo --out /models/qwen7b-dapo-step500

Reads a directory written by tools/convert_hf_to_megatron.py (megatron_dapo.json, config.json and the
tokenizer files, and the distributed checkpoint in model/), or a training checkpoint written by
megatron_dapo.train: a run directory, its checkpoints/ or one step_N directory (of a run, the step its
'latest' file names, else the newest complete one; an incomplete step is refused). A training checkpoint
holds no config.json or tokenizer: they come from --hf-config DIR, else from the Hugging Face directory
model.hf_path names in the run's config.yaml. Either kind may be saved from any TP/PP layout. The model is
built at TP=1, PP=1 in this one process (dist_checkpointing reshards on load; do not launch it under
torchrun), streamed through the weight bridge as Hugging Face tensors and written as safetensors shards of
at most --max-shard-size each (plus model.safetensors.index.json when there is more than one). A model
with tied embeddings gets no lm_head tensor. config.json (its dtype set to --dtype), generation_config.json
and the tokenizer files are copied from the checkpoint (a training checkpoint's from that Hugging Face
directory). The result loads with transformers.AutoModelForCausalLM.from_pretrained (the same layout vLLM
reads).

Memory: the whole model once (at the checkpoint's dtype), plus one shard. A failure exits non-zero with
one 'error: ...' line that names the file or field.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from megatron_dapo.cli import argument_parser, quiet_libraries, run_cli, tool_log
from megatron_dapo.config import DTYPES
from megatron_dapo.convert.common import ConvertError
from megatron_dapo.convert.resolve import RUN_CONFIG


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argument_parser(__doc__)
    ap.add_argument(
        "--megatron",
        required=True,
        metavar="DIR",
        help="checkpoint directory made by convert_hf_to_megatron.py (holds megatron_dapo.json and model/), or a "
        "training checkpoint: a run directory, its checkpoints/ or one step_N directory",
    )
    ap.add_argument(
        "--hf-config",
        metavar="DIR",
        help="for a training checkpoint: the Hugging Face directory whose config.json and tokenizer files go with "
        f"it (default: model.hf_path in the run's {RUN_CONFIG})",
    )
    ap.add_argument(
        "--out", required=True, metavar="DIR", help="output Hugging Face directory (created; empty unless --force)"
    )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the written tensors (default: the checkpoint's parameter dtype)",
    )
    ap.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB; a single larger tensor gets a file of its own "
        "(default: 5GB)",
    )
    ap.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    ap.add_argument("--debug", action="store_true", help="tracebacks for user errors, and every library's log")
    return ap.parse_args(argv)


log = tool_log("convert_megatron_to_hf")


def validate(args: argparse.Namespace):
    """Checks that need no model: which checkpoint, its config.json (and metadata), the output dir, the shard size.

    Returns (source, max_shard_bytes), source a convert.resolve.MegatronSource; raises ConvertError or ArchError
    naming the file and field.
    """
    from megatron_dapo.convert.common import parse_size, prepare_output_dir
    from megatron_dapo.convert.resolve import resolve_megatron_checkpoint

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConvertError("this tool runs in one process (it reshards to TP=1, PP=1 on load): run it without torchrun")
    source = resolve_megatron_checkpoint(args.megatron, args.hf_config)
    max_shard = parse_size(args.max_shard_size)
    args.dtype = args.dtype or source.dtype
    prepare_output_dir(args.out, args.force, keep=_inputs(args, source))
    return source, max_shard


def _inputs(args: argparse.Namespace, source) -> tuple[Path, ...]:
    """The directories --force must never delete."""
    return (Path(args.megatron), source.dist_dir, source.hf_dir)


def _largest_tensor_bytes(arch, dtype) -> int:
    """Bytes of the largest full Megatron tensor (the embedding or fc1): a weight-bridge bucket must hold it."""
    import math

    from megatron_dapo.convert.layouts import megatron_names, megatron_shape

    item = dtype.itemsize
    return max(math.prod(megatron_shape(n, arch)) * item for n in megatron_names(arch))


def convert(args: argparse.Namespace, source, max_shard: int) -> None:
    """Build at TP=1/PP=1, load the dist checkpoint (resharding), stream HF tensors into safetensors shards."""

    from megatron_dapo.config import load_config
    from megatron_dapo.convert.common import format_bytes, prepare_output_dir
    from megatron_dapo.convert.megatron_io import META_FILE, load_megatron_checkpoint
    from megatron_dapo.convert.safetensors_io import ShardWriter, copy_non_weight_files, set_config_dtype
    from megatron_dapo.model.dtypes import torch_dtype
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.provider import build_model_chunks
    from megatron_dapo.rollout.weight_bridge import WeightBridge

    t_start = t0 = time.perf_counter()
    arch = source.arch
    cfg = load_config(overrides=["parallel.tp=1", "parallel.pp=1", f"model.dtype={source.dtype}"])
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    chunks = build_model_chunks(arch, cfg.model, layout)
    log(
        f"built {arch.family} model ({arch.num_layers} layers) at tp=1 pp=1 {source.dtype} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    t0 = time.perf_counter()
    load_megatron_checkpoint(chunks, source.dist_dir)
    log(f"loaded {source.dist_dir} ({source.saved}) ({time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    out = prepare_output_dir(args.out, args.force, keep=_inputs(args, source), clear=True)
    dtype = torch_dtype(args.dtype)
    writer = ShardWriter(out, max_shard, dtype)
    # buckets of about one tensor: the writer, not the bridge, gathers a shard's worth of memory
    bucket_bytes = _largest_tensor_bytes(arch, chunks[0].config.params_dtype)
    n = 0
    for bucket in WeightBridge(chunks, arch, layout, bucket_bytes=bucket_bytes).buckets():
        for name, tensor in bucket:
            writer.add(name, tensor)
            n += 1
    files = writer.close()
    copied = copy_non_weight_files(source.hf_dir, out, skip=(META_FILE,))
    if "config.json" in copied:
        set_config_dtype(out / "config.json", args.dtype)
    log(
        f"wrote {n} tensors, {format_bytes(writer.total_bytes)} {args.dtype} in {len(files)} file(s) and "
        f"{len(copied)} HF file(s): {', '.join(copied)} ({time.perf_counter() - t0:.1f} s)"
    )
    destroy_parallel()
    log(f"done in {time.perf_counter() - t_start:.1f} s: {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries(args.debug)
    return run_cli(lambda: convert(args, *validate(args)), args.debug)


if __name__ == "__main__":
    sys.exit(main())
