"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core policy with vLLM rollouts."""

from megatron_dapo import gc_tuning

__version__ = "0.1.0"

gc_tuning.hold_full_collections()  # every process of a run imports the package before its heavy libraries
