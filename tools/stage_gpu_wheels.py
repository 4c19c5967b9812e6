"""Bring vLLM, megatron-core and what they need to the GPU machine in pieces (python tools/stage_gpu_wheels.py --help).

The code: megatron_dapo/preflight/staging.py (the commands), wheels.py (what travels), pieces.py (split, manifest,
reassembly).
"""

from __future__ import annotations

import sys
from pathlib import Path

# On the GPU image this runs before anything is installed (`receive`, `install`): the package comes from this
# checkout, and the staging modules need only the standard library and `packaging`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.preflight.staging import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
