"""Prompt datasets (jsonl/parquet, DAPO-Math-17K, GSM8K) and the offline problem generator."""
