"""What every command-line entry point shares: a user's mistake is one `error:` line, library chatter is off.

def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries(args.debug)
    return run_cli(lambda: run(args), args.debug)
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Callable


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user fixes, not us: ConfigError, DatasetError, ArchError, ConvertError, EvalError are ValueErrors."""
    from megatron_dapo.checkpoint import CheckpointError  # imported late: torch reads its log level at import
    from megatron_dapo.data.scheduler import DynamicSamplingError

    return ValueError, FileNotFoundError, CheckpointError, DynamicSamplingError


LIBRARIES = ("vllm", "torch", "transformers", "megatron", "datasets", "urllib3", "filelock", "httpx", "math_verify")
"""Loggers held to WARNING (and their Python warnings hidden) unless --debug: nothing a user can act on."""


def quiet_libraries(debug: bool) -> None:
    """INFO for this package, WARNING for the libraries, their deprecation notices hidden; all of it with debug."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        force=True,
    )
    if debug:
        return
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
    # vLLM's warnings are about settings we chose for it (eager mode, no chunked prefill, CPU tuning hints);
    # it configures its own loggers at import, and torch's C++ warnings are read when torch loads.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Warnings about code we do not own (deprecations, missing Transformer Engine/Apex on CPU).
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch|vllm|transformers)(\.|$)")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope is deprecated).*")


def error_line(e: BaseException) -> str:
    """`error: <message>`, prefixed with the rank under torchrun (each rank may fail for its own reason)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '?')}] " if world > 1 else ""
    text = " ".join(str(e).split("\n")) or type(e).__name__
    return f"{prefix}error: {text}"


def run_cli(body: Callable[[], int | None], debug: bool) -> int:
    """body's exit status; a user error prints one line (the traceback with debug) and gives 1."""
    try:
        return body() or 0
    except user_errors() as e:
        if debug:
            raise
        print(error_line(e), file=sys.stderr, flush=True)
        return 1
