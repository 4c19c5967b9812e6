"""Convert a Megatron-Core checkpoint (converted or from training) to a Hugging Face directory (--help).

The conversion and its command line: megatron_dapo/hf_export.py (its way there: megatron_dapo/hf_import.py).
"""

from __future__ import annotations

import sys

from megatron_dapo.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
