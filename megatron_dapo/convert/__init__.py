"""Hugging Face <-> Megatron-Core name and layout maps, per model family."""
