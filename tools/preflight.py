"""GPU preflight: every check this machine can run, in one command (python tools/preflight.py --help).

The checks and how they run: megatron_dapo/preflight/ (checks.py, kernel_checks.py, train_checks.py,
engine_checks.py, run.py).
"""

from __future__ import annotations

import sys

from megatron_dapo.preflight.run import main

if __name__ == "__main__":
    sys.exit(main())
