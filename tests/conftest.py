"""Helpers shared by the tests: compose configs like the parent does, run the CLI and torchrun for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from launcher.plan import make_plan, resolve, write_config
from launcher.schema import register

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
register()


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def compose_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def write_run_config(run_dir: Path, *overrides: str) -> Path:
    """What the parent does before it starts workers: compose, plan, resolve, write config.yaml."""
    cfg = compose_config(*overrides)
    return write_config(run_dir, resolve(cfg, make_plan(cfg)))


def run_cli(*overrides: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m launcher <overrides>` in a real subprocess."""
    return subprocess.run([sys.executable, "-m", "launcher", *overrides], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_torchrun(nproc: int, script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A real torchrun (elastic agent, c10d rendezvous on a free port) running `script` on `nproc` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def repo() -> Path:
    return REPO
