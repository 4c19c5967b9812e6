"""Objects read from elsewhere never run as code: the one allowlist of what may be unpickled, and the restricted
unpickler that enforces it.

A pickle names the functions and classes that rebuild it, and a plain `pickle.loads` imports and calls whatever it
names: bytes from another process (a batch of responses, a loader state, an exchange between ranks) or a checkpoint
from elsewhere could run any code. Everything this project reads goes through ALLOWED instead: plain containers,
numpy arrays and scalars, torch tensors (their storage read with torch.load(weights_only=True)) and the project's
own records. `loads` is the unpickler for bytes that cross between processes; checkpoints, which torch.save writes,
are read by torch's own weights-only unpickler given the same list (`allowed_objects`, checkpoint.py).

Standard library only: the allowed modules are imported the first time a pickle names them, so importing this
module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import warnings
from typing import Any

ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", name)
        for name in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray", "int", "float", "bool")
    }
    | {("builtins", "complex"), ("collections", "OrderedDict")}
    # numpy arrays and scalars (the prompt memory's record, the RNG states): numpy 2 names, then numpy 1's
    | {(m, n) for m in ("numpy._core.multiarray", "numpy.core.multiarray") for n in ("_reconstruct", "scalar")}
    | {(m, "_frombuffer") for m in ("numpy._core.numeric", "numpy.core.numeric")}  # pickle protocol 5's arrays
    | {("numpy", "ndarray"), ("numpy", "dtype")}
    # torch tensors: the storage's bytes are read by torch's weights-only loader (_storage_from_bytes)
    | {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")}
    # the project's records
    | {("megatron_dapo.types", n) for n in ("Prompt", "Response", "Group", "EvalRequest")}
    | {("megatron_dapo.sampling.records", n) for n in ("GroupMeta", "Paused", "Stopped", "Submission")}
    | {("megatron_dapo.reward.tickets", "RewardBatch")}
)
"""(module, name) of everything a pickle read by this project may name."""


class RefusedPickle(pickle.UnpicklingError):
    """A pickle named something outside ALLOWED: nothing of it was run."""


def _storage_from_bytes(data: bytes) -> Any:
    """torch.storage._load_from_bytes, which torch.load()s the bytes unrestricted, weights-only."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _resolve(module: str, name: str) -> Any:
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _storage_from_bytes
    return getattr(importlib.import_module(module), name)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, what: str) -> None:
        super().__init__(io.BytesIO(data))
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise RefusedPickle(
                f"{self.what}: refused to unpickle {module}.{name}: only plain containers, numpy arrays, tensors and "
                "megatron-dapo's own records are read (megatron_dapo/safe_pickle.py ALLOWED); nothing was run"
            )
        return _resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle(f"{self.what}: refused a pickle with persistent ids (a torch.save file?): nothing was run")


def dumps(obj: Any) -> bytes:
    """obj as bytes that `loads` reads back (what it holds must be in ALLOWED)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, what: str) -> Any:
    """The object pickled in data, refusing (RefusedPickle, naming `what` it was and the global it named) any pickle
    that names a function or class outside ALLOWED."""
    return _Unpickler(data, what).load()


def allowed_objects() -> list[Any]:
    """ALLOWED's functions and classes themselves (torch.serialization.safe_globals takes objects), those of modules
    this process can import, and numpy's dtype classes (torch's unpickler also checks the class of each object it
    builds: an array's dtype is a numpy.dtypes.Int64DType); torch's tensor rebuilding is torch's own business."""
    out = []
    for module, name in sorted(ALLOWED):
        if module.startswith("torch"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core's names, under numpy 2
                out.append(_resolve(module, name))
        except (ImportError, AttributeError):  # numpy 1's names under numpy 2, and the reverse
            continue
    with contextlib.suppress(ImportError):
        import numpy.dtypes

        out += [cls for name, cls in vars(numpy.dtypes).items() if name.endswith("DType") and isinstance(cls, type)]
    return out
