"""Prompt datasets, the offline problem generator and the dynamic-sampling loader."""
