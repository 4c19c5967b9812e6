"""Installing onto GPU nodes with no internet (a login node with internet, GPU nodes without).

tools/stage_gpu_wheels.py (vLLM, megatron-core and their requirements) and tools/stage_te.py (Transformer Engine,
its PyTorch extension compiled on the login node) run this: wheels.py resolves what travels, pieces.py cuts it into
checked pieces and puts them back together, staging.py holds stage_gpu_wheels' commands. The command lines put
tools/ on sys.path (for this package) and the checkout (for megatron_dapo.cli). On a GPU node it runs on the bare
python3 before anything is installed: standard library and `packaging` only. Nothing is imported here.
"""
