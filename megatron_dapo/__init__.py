"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core policy with vLLM rollouts."""

__version__ = "0.1.0"
