"""Prompt datasets, the offline problem generator, the dynamic-sampling loader and its simulator (sim/)."""
