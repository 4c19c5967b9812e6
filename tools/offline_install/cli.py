"""Stage wheels for GPU nodes without internet: resolved and downloaded (or built) on a login node, cut into pieces
of at most 60 MiB with a sha256 manifest, checked and installed on a GPU node with its bare python3.

    python tools/offline_install wheels {stage,verify,commands,receive,install} ...
        vLLM, megatron-core and every requirement the GPU nodes' image lacks (staging.py)
    python tools/offline_install te {build,split,verify,commands,install} ...
        Transformer Engine, its PyTorch extension compiled on the login node (te.py)

`python tools/offline_install wheels --help` (or `te --help`) says more; docs/slurm.md walks through both.
"""

from __future__ import annotations

import sys

from megatron_dapo.cli import argument_parser

from . import staging, te

PROG = "python tools/offline_install"
SETS = {"wheels": staging.main, "te": te.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SETS:
        return SETS[argv[0]](argv[1:], prog=f"{PROG} {argv[0]}")
    ap = argument_parser(__doc__, PROG)
    ap.usage = f"{PROG} {{{','.join(SETS)}}} COMMAND [OPTIONS]"
    ap.add_argument(
        "set", choices=list(SETS), help="what to stage: vLLM and the rest (wheels), Transformer Engine (te)"
    )
    ap.parse_args(argv[:1])  # --help, or the error naming the two sets
    return 2
