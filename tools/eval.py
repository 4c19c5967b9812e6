"""avg@k / pass@k of a model on a math dataset with vLLM (python tools/eval.py --help).

The command line: megatron_dapo/evaluate.py; the evaluation loop is the trainer's periodic one
(megatron_dapo/rollout/held_out.py), and so are the metrics (megatron_dapo/reward/accuracy.py).
"""

from __future__ import annotations

import sys

from megatron_dapo.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
