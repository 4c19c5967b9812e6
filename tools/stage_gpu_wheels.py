"""Install vLLM, megatron-core and what they need onto GPU nodes with no internet (python tools/stage_gpu_wheels.py --help).

The code: tools/offline_install/ (staging.py the commands, wheels.py what travels, pieces.py split, manifest,
reassembly).
"""

from __future__ import annotations

import sys
from pathlib import Path

# On a GPU node this runs before anything is installed (`receive`, `install`): megatron_dapo comes from this
# checkout, and offline_install (beside this script: python puts tools/ first on sys.path) needs only the
# standard library and `packaging`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline_install.staging import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
