"""Convert a Hugging Face Qwen2/Qwen2.5, Qwen3 (dense or MoE) or Llama checkpoint into a Megatron-Core distributed
checkpoint (--help).

The conversion and its command line: megatron_dapo/hf_import.py (its way back: megatron_dapo/hf_export.py).
"""

from __future__ import annotations

import sys

from megatron_dapo.hf_import import main

if __name__ == "__main__":
    sys.exit(main())
