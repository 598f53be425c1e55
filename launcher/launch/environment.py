"""What a bug report needs, recorded in launch.json by the parent: packages, code state, GPUs, env.

Installed packages and versions, the git revision of the code (and, when the tree has changes, the diff in
<run_dir>/git.diff) and of a job's own repo (job_git; its diff in job.git.diff), torch/CUDA/NCCL/driver versions,
GPU names, and the NCCL_*, TORCH_*, CUDA_*, PYTORCH_*, SLURM_* variables (and, from the first node of a Slurm job,
the job's own). Never a secret: a variable whose name says token, key, password, secret or credential is redacted,
and so are credentials inside URLs.
Exercised by: tests/test_cli.py (`python -m launcher +exp=toy`, then read <run_dir>/launch.json) and
tests/test_own_job.py (a job in a repo of its own).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from launcher.launch.gpus import driver_version, visible_gpus
from launcher.redact import redact
from launcher.rundir import LAUNCH_FILE, write_atomically
from launcher.train.prefetch import usable_cores

CODE = Path(__file__).resolve().parents[2]  # the checkout that holds launcher/ and jobs/
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PYTORCH_", "SLURM_")
ENV_NAMES = ("PYTHONPATH",)  # where a job of one's own was imported from (its repo's git state is not recorded)
MAX_DIFF_BYTES = 1 << 20


def _git(*args: str, where: Path = CODE) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=where, capture_output=True, encoding="utf-8", errors="replace",
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_state(run_dir: Path, where: Path = CODE, diff: str = "git.diff") -> dict[str, Any]:
    """The git revision of the checkout at `where`, and whether its tree differs from it (the diff goes to `diff`)."""
    revision = _git("rev-parse", "HEAD", where=where)
    if revision is None:
        return {"revision": None}
    status = _git("status", "--porcelain", "--untracked-files=no", where=where)
    state: dict[str, Any] = {"revision": revision.strip(), "dirty": None if status is None else bool(status.strip())}
    if state["dirty"]:  # the diff of tracked files, as they are: the code that ran (cut at 1 MB)
        (run_dir / diff).write_text((_git("diff", "HEAD", where=where) or "")[:MAX_DIFF_BYTES])
        state["diff"] = diff
    return state


def job_code_state(run_dir: Path, job_files: list[Path]) -> dict[str, Any]:
    """{top dir: its code_state} of each git checkout, other than the launcher's, that holds a module the job's
    `_target_`s name (a job of one's own, in its repo: README's 'Adding a job'); the first one's diff goes to
    job.git.diff, a second's to job-2.git.diff."""
    tops: list[str] = []
    for file in job_files:
        if file.is_relative_to(CODE):  # (jobs/: the launcher's own git state covers it)
            continue
        top = (_git("rev-parse", "--show-toplevel", where=file.parent) or "").strip()
        if top and top not in tops:
            tops.append(top)
    return {top: code_state(run_dir, Path(top), "job.git.diff" if i == 0 else f"job-{i + 1}.git.diff")
            for i, top in enumerate(tops)}


def _nccl() -> str | None:
    try:
        version = torch.cuda.nccl.version()  # (2, 21, 5), or an int on some builds
    except Exception:
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def environment_record(run_dir: Path, job_files: list[Path]) -> dict[str, Any]:
    gpus = [gpu.name for gpu in visible_gpus()]  # NVML: no CUDA context, no nvidia-smi (launcher/launch/gpus.py)
    return {
        "git": code_state(run_dir), "job_git": job_code_state(run_dir, job_files),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": _nccl() if gpus else None,
        "gpus": gpus, "driver": driver_version() if gpus else None,
        "env": {name: redact(name, value) for name, value in sorted(os.environ.items())
                if name.startswith(ENV_PREFIXES) or name in ENV_NAMES},
        "packages": dict(sorted((dist.metadata["Name"] or "?", dist.version)
                                for dist in importlib.metadata.distributions())),
    }


def record_slurm_job(run_dir: Path) -> None:
    """On the first node of a Slurm job (each attempt): its SLURM_* variables (job id, node list, array
    task, requeue count) go into launch.json, which the submit host wrote without them."""
    path = run_dir / LAUNCH_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["slurm_job"] = {name: redact(name, value) for name, value in sorted(os.environ.items())
                           if name.startswith("SLURM_")}
    record["slurm_job"]["usable_cpus"] = usable_cores()  # what Slurm bound the node's task to: its workers share them
    write_atomically(path, json.dumps(record, indent=2) + "\n")
