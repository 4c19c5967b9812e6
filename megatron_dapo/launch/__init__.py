"""The three launchers, one command (`python -m megatron_dapo.launch {local,slurm,ray} --config FILE [overrides]`):
this machine (local.py: one process or torchrun, and an asynchronous job's two sides), a Slurm cluster (slurm.py:
sbatch of slurm/train_qwen32b.sh) and a Ray cluster (ray_cluster.py: one actor per GPU). procs.py: what they share.
"""
