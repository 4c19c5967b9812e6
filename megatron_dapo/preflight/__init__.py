"""The GPU preflight (tools/preflight.py) and the wheel staging that brings vLLM to the GPU machine
(tools/stage_gpu_wheels.py).

checks.py and engine_checks.py hold the checks, run.py runs each in its own process and reports; wheels.py,
pieces.py and staging.py resolve, split, check and install the wheels. Nothing is imported here: staging runs
on the GPU machine's bare python3 (standard library and `packaging`) before anything else is installed.
"""
