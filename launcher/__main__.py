"""`python -m launcher +exp=<name> [overrides]`: see launcher/cli.py.

Hydra runs the task once per run (once per sweep point with -m); Slurm runs are queued by it and
submitted here afterwards, so a sweep becomes one job array.
"""
import sys

from launcher.cli import main
from launcher.slurm import submit_queued

main()
sys.exit(submit_queued())
