"""avg@k / pass@k of a model on a math dataset with vLLM (python tools/eval.py --help).

The evaluation and its command line: megatron_dapo/evaluate.py (the trainer's periodic evaluation shares
its metrics: megatron_dapo/reward/accuracy.py).
"""

from __future__ import annotations

import sys

from megatron_dapo.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
