"""Pure tensor math of DAPO and its peers' objectives: no Megatron, no I/O, no distributed calls.

Import from the modules themselves (policy_loss, rollout_correction, ...): this package loads nothing, so that the
config reads the torch-free registry (registry.py) of objectives and corrections without loading torch.
"""
