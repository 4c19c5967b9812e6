"""What every command-line entry point shares: a user's mistake is one `error:` line, library chatter is off,
progress lines say which tool wrote them, and token counts are read the same way.

def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries(args.debug)
    return run_cli(lambda: run(args), args.debug)

log = tool_log("eval")   # log("vLLM engine up") prints "[eval] vLLM engine up"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Callable


class UserError(Exception):
    """An error the user fixes, not us (no usable checkpoint, a batch the sampler cannot fill): one line, no traceback.
    The config's and the data's own errors (ConfigError, DatasetError, ArchError, ConvertError, EvalError) are
    ValueErrors, which count too."""


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, UserError)


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
    except USER_ERRORS as e:
        if debug:
            raise
        print(error_line(e), file=sys.stderr, flush=True)
        return 1


def argument_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """Every entry point's parser, whose --help is its module docstring: first paragraph above the options, the rest
    below. prog: the command as typed, where it is not the script's name (`python -m ...`)."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        prog=prog, description=head, epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def tool_log(tool: str, rank0_only: bool = False) -> Callable[[str], None]:
    """A tool's log(msg): one progress line `[tool] msg` on stdout, flushed; with rank0_only, from rank 0 only
    (RANK, as torchrun sets it; a process without it is rank 0)."""

    def log(msg: str) -> None:
        if not rank0_only or int(os.environ.get("RANK", "0")) == 0:
            print(f"[{tool}] {msg}", flush=True)

    return log


def parse_tokens(text: str) -> int:
    """'4M' -> 4 * 2**20 tokens; also K, G and plain integers.

    Token counts are binary (K = 2**10); byte sizes are not (convert.common.parse_size: 5GB = 5e9, as Hugging Face).
    """
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)
