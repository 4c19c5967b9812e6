"""Megatron distributed checkpoints of the model (megatron.core.dist_checkpointing): save, load, and the small
metadata file that makes a converted checkpoint directory self-describing.

A converted checkpoint directory (tools/convert_hf_to_megatron.py) looks like this:

    DIR/megatron_dapo.json        CheckpointMeta: family, tp, pp, dtype, source, format version
    DIR/config.json               the Hugging Face files that are not weights, copied verbatim
    DIR/tokenizer*.json, ...      (so DIR alone is enough to go back to Hugging Face)
    DIR/model/                    megatron.core.dist_checkpointing checkpoint of the GPTModel

The trainer's checkpoints (megatron_dapo.checkpoint) save their model part with model_sharded_state_dict too.
Torch is imported lazily (inside the functions that need it) so the tools answer --help and refuse bad
arguments in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.config import DTYPES
from megatron_dapo.convert.common import ConvertError
from megatron_dapo.model.dtypes import DTYPE_OF_HF_NAME

if TYPE_CHECKING:
    from megatron_dapo.model.comm import Comm

FORMAT_NAME = "megatron_dapo.dist_checkpoint"
FORMAT_VERSION = 1
META_FILE = "megatron_dapo.json"
MODEL_SUBDIR = "model"


@dataclass
class CheckpointMeta:
    """What megatron_dapo.json says about a Megatron checkpoint directory."""

    family: str
    """Model family, 'qwen2', 'qwen3' or 'llama' (ModelArch.family)."""
    tp: int
    """Tensor-parallel size it was saved from (any other loads it: dist_checkpointing reshards)."""
    pp: int
    """Pipeline-parallel size it was saved from."""
    dtype: str
    """Parameter dtype of the saved model: 'bf16', 'fp16' or 'fp32'."""
    source: str = ""
    """Where the weights came from (the Hugging Face directory, or a training run)."""
    model_dir: str = MODEL_SUBDIR
    """The dist checkpoint's directory, relative to the checkpoint directory."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form additions (megatron-core version, creation time, training step...)."""


def write_metadata(ckpt_dir: str | Path, meta: CheckpointMeta) -> Path:
    """Write ckpt_dir/megatron_dapo.json."""
    path = Path(ckpt_dir) / META_FILE
    path.write_text(json.dumps(asdict(meta), indent=2) + "\n")
    return path


def hf_model_hint(path: Path) -> str:
    """For an error about a directory that is no Megatron checkpoint: the other tool, when it holds HF weights."""
    return (
        " (it looks like a Hugging Face model: use convert_hf_to_megatron.py)"
        if any(path.glob("*.safetensors"))
        else ""
    )


def read_metadata(ckpt_dir: str | Path) -> CheckpointMeta:
    """Read ckpt_dir/megatron_dapo.json; a ConvertError names the file when the directory is not one of ours."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / META_FILE
    if not ckpt_dir.is_dir():
        raise ConvertError(f"checkpoint directory {ckpt_dir} does not exist")
    if not path.is_file():
        raise ConvertError(
            f"{ckpt_dir} is not a megatron-dapo checkpoint: {path.name} is missing{hf_model_hint(ckpt_dir)}; "
            "create one with tools/convert_hf_to_megatron.py"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ConvertError(
            f"{path}: field 'format' is {raw.get('format') if isinstance(raw, dict) else raw!r}, "
            f"expected '{FORMAT_NAME}'"
        )
    if raw.get("format_version") != FORMAT_VERSION:
        raise ConvertError(
            f"{path}: field 'format_version'={raw.get('format_version')!r} is not supported; expected {FORMAT_VERSION}"
        )
    try:
        meta = CheckpointMeta(**raw)
    except TypeError as e:
        raise ConvertError(f"{path}: {e}") from None
    if meta.dtype not in DTYPES:
        raise ConvertError(f"{path}: field 'dtype'={meta.dtype!r}, expected one of {DTYPES}")
    if not (ckpt_dir / meta.model_dir / "metadata.json").is_file():
        raise ConvertError(
            f"{path}: field 'model_dir' names {ckpt_dir / meta.model_dir}, which holds no Megatron distributed "
            "checkpoint (metadata.json is missing)"
        )
    return meta


def saved_dtype(dist_dir: Path) -> str:
    """The parameter dtype a model dist checkpoint stores (its embedding's), as 'bf16' | 'fp16' | 'fp32'."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (dist_dir / "metadata.json").is_file():
        raise ConvertError(f"{dist_dir} is not a Megatron distributed checkpoint: metadata.json is missing")
    key = "embedding.word_embeddings.weight"
    try:
        stored = FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata[key]
    except KeyError:
        raise ConvertError(f"{dist_dir}: the distributed checkpoint holds no '{key}': not a GPT model") from None
    except Exception as e:  # an unreadable .metadata: pickle, OS errors...
        raise ConvertError(f"{dist_dir}: cannot read the distributed checkpoint's metadata: {e}") from None
    name = str(stored.properties.dtype).removeprefix("torch.")
    if name not in DTYPE_OF_HF_NAME:
        raise ConvertError(f"{dist_dir}: '{key}' is stored as {name}, expected one of {sorted(DTYPE_OF_HF_NAME)}")
    return DTYPE_OF_HF_NAME[name]


# ---------------------------------------------------------------- Megatron dist checkpoints


def model_sharded_state_dict(chunks: list) -> dict:
    """The chunks' sharded state dict, Megatron-LM's layout: {'model': ...} or {'model0': ..., 'model1': ...}.

    Tensor keys in it are global (layer numbers across pipeline stages and virtual chunks), so a
    checkpoint loads into any TP/PP/VPP layout.
    """
    from megatron_dapo.model.provider import unwrap

    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


@contextlib.contextmanager
def in_process_write_results():
    """Let a synchronous torch_dist save hand its write results over in this process.

    Megatron's default channel is a queue in a spawned multiprocessing Manager, which must import torch
    to unpickle the results: ~4 s per process on CPU, and it re-imports __main__. A synchronous save
    puts and gets them in the calling process, so a plain queue does; the default is restored after.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:  # another megatron-core layout: keep its default
        yield
        return
    if getattr(fsa, "_results_queue", 0) is not None:  # already made (or renamed): leave it alone
        yield
        return
    fsa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fsa._results_queue = None


def save_megatron_checkpoint(chunks: list, ckpt_dir: str | Path, comm: Comm) -> float:
    """dist_checkpointing.save of the model chunks into ckpt_dir (created; collective: every rank of comm's world
    calls).

    Synchronous. Returns the seconds it took. The directory should be empty: Megatron only warns when
    it is not.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)  # every rank: exist_ok makes it safe, and no rank is asked for
    with in_process_write_results():
        dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))
    comm.barrier("a checkpoint's end")
    return time.perf_counter() - t0


def _first_failure(e: Exception) -> str:
    """The message of the first rank's failure inside torch DCP's CheckpointException (else of e itself)."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        return str(first[0] if isinstance(first, tuple) else first)
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def load_megatron_checkpoint(chunks: list, ckpt_dir: str | Path) -> float:
    """Load a model dist checkpoint into chunks of any TP/PP layout (collective: every rank calls).

    ckpt_dir is the dist checkpoint itself, or a converted checkpoint directory holding megatron_dapo.json
    (then its model/ is loaded). Vocabulary padding may differ from the saved layout's (Megatron zero-fills
    the difference); the local and Transformer Engine layer specs store the same keys. Returns seconds.
    """
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_dapo.model.provider import unwrap

    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / META_FILE).is_file():
        ckpt_dir = ckpt_dir / read_metadata(ckpt_dir).model_dir
    if not (ckpt_dir / "metadata.json").is_file():
        raise ConvertError(f"{ckpt_dir} is not a Megatron distributed checkpoint: metadata.json is missing")
    sharded = model_sharded_state_dict(chunks)
    with torch.no_grad():
        try:
            loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
        except (CheckpointingException, CheckpointException, KeyError) as e:  # e.g. a shape from another config
            raise ConvertError(f"{ckpt_dir}: the checkpoint does not fit this model: {_first_failure(e)}") from e
        for key, chunk in zip(sharded, chunks):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
    return time.perf_counter() - t0
