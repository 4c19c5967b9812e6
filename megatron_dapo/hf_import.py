"""Convert a Hugging Face Qwen2/Qwen2.5, Qwen3 (dense or MoE) or Llama checkpoint into a Megatron-Core distributed
checkpoint.

    python tools/convert_hf_to_megatron.py --hf /models/Qwen2.5-7B --out /ckpt/qwen7b-mcore --tp 4 --dtype bf16

(the tool is this module's main; `python -m megatron_dapo.hf_import` is the same command).

The model is built at the requested tensor/pipeline-parallel layout, each rank reads only the HF
tensors of the parameters it holds (lazily, from the safetensors files) and every rank saves its
shard with megatron.core.dist_checkpointing. The checkpoint loads into any other TP/PP layout
(dist_checkpointing reshards on load). With tp x pp > 1 the command re-launches itself under
torch.distributed.run with tp x pp processes, so one command is enough; it also runs directly under
torchrun/srun. With fewer GPUs than tp x pp (or none) it runs on CPU with gloo: converting needs no GPU.
Everything that can be checked (files, config.json, layout, tensor names and shapes, the output
directory) is checked before a model is built; a failure exits non-zero with one 'error: ...' line
that names the file, field or tensor.

Output directory:
    OUT/model/                Megatron distributed checkpoint of the GPTModel
    OUT/megatron_dapo.json    family, tp, pp, dtype, source, format version
    OUT/config.json, generation_config.json, tokenizer files ...   copied from --hf (everything but weights)
tools/convert_megatron_to_hf.py turns OUT back into a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_dapo.cli import argument_parser, quiet_libraries, run_cli, tool_log
from megatron_dapo.config import DTYPES
from megatron_dapo.convert.common import ConvertError
from megatron_dapo.launch import torchrun

_CHECKED_ENV = "MEGATRON_DAPO_CONVERT_RELAUNCHED"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argument_parser(__doc__)
    ap.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="Hugging Face model directory: config.json and "
        "*.safetensors (one file, or shards with model.safetensors.index.json), plus tokenizer files",
    )
    ap.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output checkpoint directory (created; must be empty unless --force)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size to save from; must divide "
        "the number of attention heads and of query groups (KV heads) (default: 1)",
    )
    ap.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="N",
        help="pipeline-parallel size to save from; must divide the number of layers (default: 1)",
    )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="parameter dtype of the Megatron model (default: the dtype config.json declares, else bf16)",
    )
    ap.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    ap.add_argument("--debug", action="store_true", help="tracebacks for user errors, and every library's log")
    args = ap.parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        ap.error(f"--tp and --pp must be >= 1 (got --tp {args.tp} --pp {args.pp})")
    return args


log = tool_log("convert_hf_to_megatron", rank0_only=True)


def _config(args: argparse.Namespace):
    from megatron_dapo.config import load_config

    return load_config(overrides=[f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"model.dtype={args.dtype}"])


def validate(args: argparse.Namespace):
    """Every check that needs no model: paths, config.json, layout, output dir, tensor names and shapes.

    Returns (arch, reader). Raises ConvertError, ArchError or LayoutError with a message naming the culprit.
    """
    from megatron_dapo.convert.common import prepare_output_dir
    from megatron_dapo.convert.safetensors_io import hf_config_dtype
    from megatron_dapo.model.arch import ModelArch

    hf = Path(args.hf)
    if not hf.is_dir():
        raise ConvertError(f"--hf {hf}: no such directory")
    arch = ModelArch.from_hf_dir(hf)  # ArchError names config.json and the field
    args.dtype = args.dtype or hf_config_dtype(hf)
    prepare_output_dir(args.out, args.force, keep=(hf,))

    # the checks below import torch: a few seconds, so the ones above go first
    from megatron_dapo.convert.common import format_bytes
    from megatron_dapo.convert.safetensors_io import SafetensorsReader, check_hf_tensors
    from megatron_dapo.model.parallel import check_layout

    cfg = _config(args)
    world = int(os.environ.get("WORLD_SIZE", str(args.tp * args.pp)))
    check_layout(arch, cfg.parallel, cfg.model, world)  # e.g. tp not dividing the query groups
    reader = SafetensorsReader(hf)
    unused = check_hf_tensors(reader, arch)
    if _CHECKED_ENV not in os.environ:  # a relaunched child does not repeat the parent's report
        log(
            f"checked {hf}: {arch.family}, {arch.num_layers} layers, {len(reader)} tensors in {len(reader.files)} "
            f"safetensors file(s), {format_bytes(reader.total_bytes())}; names and shapes match config.json"
        )
        if unused:
            log(f"note: {len(unused)} tensor(s) are not used: {', '.join(unused[:5])}")
    return arch, reader


def relaunch(argv: list[str], nproc: int) -> int:
    """Run this module again under torchrun with nproc processes; returns its exit code."""
    import torch

    cmd = [*torchrun.command(nproc), "-m", "megatron_dapo.hf_import", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), _CHECKED_ENV: "1"}
    where = "CPU (gloo)"
    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc:
        where = f"{nproc} GPUs"
    elif torch.cuda.is_available():  # the conversion needs no GPU: one process per GPU would not fit
        env["CUDA_VISIBLE_DEVICES"] = ""
        where = f"CPU (gloo; {torch.cuda.device_count()} GPUs < {nproc} processes)"
    log(f"launching {nproc} processes on {where}: torch.distributed.run --nproc-per-node={nproc}")
    return subprocess.run(cmd, env=env).returncode


def convert(args: argparse.Namespace, arch, reader) -> None:
    """Build the model at the layout, load this rank's slices of the HF tensors, save the dist checkpoint."""

    import megatron_dapo
    from megatron_dapo.convert.common import format_bytes, prepare_output_dir
    from megatron_dapo.convert.megatron_io import (
        MODEL_SUBDIR,
        CheckpointMeta,
        save_megatron_checkpoint,
        write_metadata,
    )
    from megatron_dapo.convert.safetensors_io import LazyMegatronWeights, copy_non_weight_files
    from megatron_dapo.model.comm import Comm
    from megatron_dapo.model.parallel import destroy_parallel, init_parallel
    from megatron_dapo.model.provider import build_model_chunks, load_full_weights

    t_start = t0 = time.perf_counter()
    cfg = _config(args)
    layout = init_parallel(arch, cfg.parallel, cfg.model, seed=0)
    comm = Comm(layout)
    chunks = build_model_chunks(arch, cfg.model, layout)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    log(
        f"built {arch.family} model ({arch.num_layers} layers) at tp={layout.tp} pp={layout.pp} {args.dtype}: "
        f"{n_params / 1e6:.2f}M parameters on rank 0 ({time.perf_counter() - t0:.1f} s)"
    )

    t0 = time.perf_counter()
    weights = LazyMegatronWeights(reader, arch)
    load_full_weights(chunks, weights, arch, layout)
    log(
        f"read the HF tensors of rank 0's parameters: {format_bytes(weights.bytes_read)} of "
        f"{format_bytes(reader.total_bytes())} ({time.perf_counter() - t0:.1f} s)"
    )
    del weights

    t0 = time.perf_counter()
    out = Path(args.out).absolute()
    if layout.rank == 0:
        prepare_output_dir(out, args.force, keep=(Path(args.hf),), clear=True)
    comm.barrier("the output directory, made by rank 0")
    save_megatron_checkpoint(chunks, out / MODEL_SUBDIR, comm)
    if layout.rank == 0:
        copied = copy_non_weight_files(args.hf, out)
        import megatron.core

        meta = CheckpointMeta(
            family=arch.family,
            tp=layout.tp,
            pp=layout.pp,
            dtype=args.dtype,
            source=str(Path(args.hf).absolute()),
            extra={
                "megatron_core": megatron.core.__version__,
                "megatron_dapo": megatron_dapo.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
        write_metadata(out, meta)
        size = sum(f.stat().st_size for f in (out / MODEL_SUBDIR).rglob("*") if f.is_file())
        log(
            f"saved dist checkpoint {out / MODEL_SUBDIR} ({format_bytes(size)}) and {len(copied)} HF file(s): "
            f"{', '.join(copied)} ({time.perf_counter() - t0:.1f} s)"
        )
    comm.barrier("the metadata, written by rank 0")
    destroy_parallel()
    log(f"done in {time.perf_counter() - t_start:.1f} s: {out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    quiet_libraries(args.debug)

    def body() -> int:
        arch, reader = validate(args)
        if args.tp * args.pp > 1 and "WORLD_SIZE" not in os.environ:
            return relaunch(argv, args.tp * args.pp)
        convert(args, arch, reader)
        return 0

    return run_cli(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
