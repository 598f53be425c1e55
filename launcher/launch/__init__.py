"""The parent side, the Hydra process: validate, plan, check, launch locally (torchrun) or on Slurm, report status."""
