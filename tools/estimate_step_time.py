"""Predict the paper-scale DAPO step time from measured per-GPU rates (python tools/estimate_step_time.py --help).

The model, its symbols and the command line: megatron_dapo/sampling/sim/step_time.py.
"""

from __future__ import annotations

import sys

from megatron_dapo.sampling.sim.step_time import main

if __name__ == "__main__":
    main(sys.argv[1:])
