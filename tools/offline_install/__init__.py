"""Installing onto GPU nodes with no internet (a login node with internet, GPU nodes without): one command line,
`python tools/offline_install {wheels,te} ...` (cli.py; __main__.py puts tools/ and the checkout on sys.path).

Two sets travel: `wheels` (vLLM, megatron-core and their requirements; staging.py its commands, wheels.py what
travels) and `te` (Transformer Engine, its PyTorch extension compiled on the login node; te.py). Both go through
pieces.py: cut into checked pieces, manifest, checks, reassembly. On a GPU node it runs on the bare python3 before
anything is installed: standard library and `packaging` only. Nothing is imported here.
"""
