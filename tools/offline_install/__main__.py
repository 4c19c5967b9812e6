"""`python tools/offline_install {wheels,te} ...`: the one command line (cli.py).

On a GPU node this runs before anything is installed: the package comes from tools/ and megatron_dapo (its cli
module: standard library only) from this checkout, both named here (python -I or -P leaves them off sys.path); this
folder itself comes off it, so that its modules (te, wheels...) never stand in for top-level ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from offline_install.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
