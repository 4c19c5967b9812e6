"""python -m megatron_dapo.preflight: the same as tools/preflight.py (how each check's own process starts)."""

import sys

from megatron_dapo.preflight.run import main

if __name__ == "__main__":
    sys.exit(main())
