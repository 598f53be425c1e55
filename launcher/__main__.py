"""`python -m launcher +exp=<name> [overrides]`: see launcher/launch/cli.py.

Hydra runs the task once per run (once per sweep point with -m); Slurm runs are queued by it and
submitted here afterwards, so a sweep becomes one job array.
"""
import sys

from launcher.launch.cli import main
from launcher.launch.errors import hydra_errors_in_one_line
from launcher.launch.slurm import submit_queued
from launcher.launch.tracker_start import end_sweeps

failed = True
try:
    with hydra_errors_in_one_line():
        main()
    code = submit_queued()
    failed = code != 0
finally:
    end_sweeps(failed)  # a -m sweep's parent tracker run ends once its points ran or were submitted
sys.exit(code)
