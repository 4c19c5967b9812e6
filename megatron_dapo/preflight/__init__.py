"""The GPU preflight (tools/preflight.py): every check a machine can run, each in its own process.

checks.py holds the check types, their shared helpers and the environment checks; kernel_checks.py (with
kernel_bench.py, the fused loss against the reference), train_checks.py and engine_checks.py (vLLM) the families of
checks; run.py runs each in its own process and reports. Nothing is imported here.
"""
