"""The optimizer's values are checked in the parent (launcher/launch/optimizer_check.py): optimizer.lr=abc crashed the
parent with a traceback, and optimizer.weight_decay=abc passed it and failed every rank, naming no key. Also what the
optimizer step takes: a fused step or a note that it waits for the GPU, a gradient norm on the step's device."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_the_gradient_norm_is_on_the_step_s_device_even_without_gradients() -> None:
    """torch's get_total_norm([]) is a CPU zero, which the step's stack with device flags would refuse on a GPU."""
    from launcher.train.sharding import total_norm

    assert total_norm([], torch.device("meta")).device.type == "meta"
    grads = [torch.tensor([3.0]), torch.tensor([4.0])]
    assert total_norm(grads, torch.device("cpu")).item() == 5.0


@pytest.mark.parametrize(("overrides", "why"), [
    ((), None), (("optimizer=sgd",), None), (("+optimizer.fused=true",), None),
    (("strategy=fsdp",), None),
    (("optimizer=sgd", "strategy=fsdp"), "torch has no fused SGD for strategy=fsdp"),
    (("+optimizer.foreach=true",), "optimizer.foreach=True"), (("+optimizer.fused=false",), "optimizer.fused=False"),
    (("optimizer._target_=torch.optim.Adagrad",), "the launcher fuses torch's Adam, AdamW and SGD only"),
])
def test_a_gpu_launch_names_an_optimizer_step_that_waits_for_the_gpu(overrides: tuple[str, ...], why: str | None) -> None:
    """The workers fuse what derived.takes_fused says; any other step reads its skip flag on the host, every step."""
    from launcher.derived import takes_fused, unfused_step_note

    cfg = compose_config("+exp=toy", *overrides)
    note = unfused_step_note(cfg.optimizer, cfg.strategy.name)
    assert (note is None) == (why is None), note
    if why:
        assert note.startswith(f"note: {cfg.optimizer._target_} steps unfused ({why}): each step waits for the GPU"), note
    assert takes_fused(cfg.optimizer, cfg.strategy.name) == (not overrides or overrides in (("optimizer=sgd",),
                                                                                            ("strategy=fsdp",)))
