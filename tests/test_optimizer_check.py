"""The optimizer's values are checked in the parent (launcher/launch/optimizer_check.py): optimizer.lr=abc crashed the
parent with a traceback, and optimizer.weight_decay=abc passed it and failed every rank, naming no key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_config, run_cli, subprocess_env
from launcher.derived import ConfigError
from launcher.launch.optimizer_check import check_optimizer


@pytest.mark.parametrize("overrides, expected", [
    (["optimizer.weight_decay=abc"], "optimizer.weight_decay=abc is not a number (torch.optim.AdamW takes "
                                     "weight_decay=0.01 by default)"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] is not a list of 2 numbers (torch.optim.AdamW takes "
                                "betas=(0.9, 0.999) by default)"),
    (["+optimizer.amsgrad=yes"], "optimizer.amsgrad=yes is not true or false (torch.optim.AdamW takes amsgrad=False by "
                                 "default)"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "torch.optim.SGD refused optimizer.lr=0.1, optimizer.momentum=-1: "
                                                 "Invalid momentum value: -1"),
    (["optimizer=sgd", "+optimizer.nesterov=true"], "torch.optim.SGD refused optimizer.lr=0.1, optimizer.momentum=0.0, "
                                                    "optimizer.nesterov=True: Nesterov momentum requires a momentum"),
], ids=["not a number", "not a pair", "not a bool", "refused by torch", "refused together"])
def test_a_value_the_optimizer_does_not_take_is_one_line_naming_its_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_optimizer(compose_config("+exp=toy", *overrides).optimizer)
    assert str(error.value).startswith(expected), str(error.value)


def test_what_the_optimizer_takes_passes_and_a_job_s_own_optimizer_is_the_workers_to_build() -> None:
    check_optimizer(compose_config("+exp=toy", "optimizer.lr=3e-4", "+optimizer.fused=true").optimizer)
    check_optimizer(compose_config("+exp=toy", "optimizer=sgd", "+optimizer.nesterov=true",
                                   "optimizer.momentum=0.9").optimizer)
    check_optimizer(compose_config("+exp=toy", "optimizer._target_=jobs.no_such.Optimizer").optimizer)  # not imported


def test_the_check_imports_no_dynamo_and_leaves_the_workers_environment_alone() -> None:
    """Built on a parameter, an optimizer imports torch._dynamo (2 s of the parent's start), which sets
    TORCHINDUCTOR_CACHE_DIR: the workers took it for the user's own cache, and kept no compile cache in the run dir."""
    code = ("import os, sys\nfrom conftest import compose_config\nfrom launcher.launch.optimizer_check import "
            "check_optimizer\ncheck_optimizer(compose_config('+exp=toy', 'optimizer=sgd', 'optimizer.momentum=0.9')"
            ".optimizer)\nprint('torch._dynamo' in sys.modules, os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    env = {k: v for k, v in subprocess_env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = f"{REPO / 'tests'}:{REPO}"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False None", out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_an_optimizer_value_that_is_no_number_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    out = run_cli("+exp=toy", "optimizer.lr=abc", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: optimizer.lr=abc is not a number"], out.stderr
    assert not (tmp_path / "run").exists()
