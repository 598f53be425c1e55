"""launcher: compose a Hydra config, run it as a DDP job on local GPUs/CPUs (torchrun) or Slurm."""
