"""Install vLLM, megatron-core and what they need onto GPU nodes with no internet (python tools/stage_gpu_wheels.py --help).

The code: tools/offline_install/ (staging.py the commands, wheels.py what travels, pieces.py split, manifest,
reassembly).
"""

from __future__ import annotations

import sys
from pathlib import Path

# On a GPU node this runs before anything is installed (`receive`, `install`): offline_install comes from beside
# this script (named here too: python -I or -P leaves the script's folder off sys.path), megatron_dapo from this
# checkout; both need only the standard library and `packaging`.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from offline_install.staging import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
