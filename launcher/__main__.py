"""`python -m launcher +exp=<name> [overrides]`: see launcher/launch/cli.py.

Hydra runs the task once per run (once per sweep point with -m); Slurm runs are queued by it and
submitted here afterwards, so a sweep becomes one job array.
"""
import os
import sys
import time

from launcher.closed_output import output_may_close
from launcher.interrupted import quiet_ctrl_c
from launcher.preempt import keep_early_signals
from launcher.startup_gc import imports_begin, imports_done

keep_early_signals()  # first, before the imports of seconds below
quiet_ctrl_c("stopped by SIGINT before any worker started")  # (while those imports run: no traceback of them)
output_may_close()  # (before Hydra's logging keeps sys.stdout): a closed pipe ends no launch
os.environ["LAUNCHER_LAUNCH_TIME"] = str(time.time())  # the workers' start-up phases count from here (train/phases.py)
imports_begin()
from launcher.launch.cli import flags_first, main  # noqa: E402
from launcher.launch.errors import hydra_errors_in_one_line  # noqa: E402
from launcher.launch.slurm_submit import discard_queued, submit_queued  # noqa: E402
from launcher.launch.sweep_dir import discard_new_sweep_dir  # noqa: E402
from launcher.launch.sweep_points import failed_points_code, tell_failed_points  # noqa: E402
from launcher.launch.tracker_start import end_sweeps  # noqa: E402
from launcher.process_exit import exit_without_teardown  # noqa: E402

imports_done()

sys.argv[1:] = flags_first(sys.argv[1:])  # before Hydra's parser, and what reads the overrides after it
failed = True
try:
    with hydra_errors_in_one_line():
        main()
    code = submit_queued() or failed_points_code()  # (a local sweep that went on past failed points)
    failed = code != 0
finally:
    tell_failed_points()  # (also where a later point's stop or refusal ended the sweep)
    discard_queued()  # a sweep point's error, or sbatch's refusal: nothing half-made of what was not submitted
    if failed:
        discard_new_sweep_dir()  # (Hydra's multirun.yaml, written before a bad override stopped the first point)
    end_sweeps(failed)  # a -m sweep's parent tracker run ends once its points ran or were submitted
exit_without_teardown(code)  # (a refusal's SystemExit, or an error, takes the slow way)
