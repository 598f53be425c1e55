"""What a bug report needs, recorded in launch.json by the parent: packages, code state, GPUs, env.

Installed packages and versions, the git revision of the code (and, when the tree has changes, the
diff in <run_dir>/git.diff), torch/CUDA/NCCL/driver versions, GPU names, and the NCCL_*, TORCH_*,
CUDA_*, PYTORCH_*, SLURM_* variables. Never a secret: a variable whose name says token, key, password,
secret or credential is redacted, and so are credentials inside URLs.
Exercised by: tests/test_cli.py (`python -m launcher +exp=toy`, then read <run_dir>/launch.json).
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

CODE = Path(__file__).resolve().parent.parent  # the checkout that holds launcher/ and jobs/
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PYTORCH_", "SLURM_")
SECRET_NAME = re.compile(r"TOKEN|KEY|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.IGNORECASE)
URL_CREDENTIALS = re.compile(r"(://)[^/@\s]+@")
REDACTED = "<redacted>"


def redact(name: str, value: str) -> str:
    if SECRET_NAME.search(name):
        return REDACTED
    return URL_CREDENTIALS.sub(rf"\g<1>{REDACTED}@", value)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=CODE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_state(run_dir: Path) -> dict[str, Any]:
    """The git revision of the code, and whether the tree differs from it (the diff goes to git.diff)."""
    revision = _git("rev-parse", "HEAD")
    if revision is None:
        return {"revision": None}
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    state: dict[str, Any] = {"revision": revision.strip(), "dirty": bool(status.strip())}
    if state["dirty"]:
        (run_dir / "git.diff").write_text(_git("diff", "HEAD") or "")
        state["diff"] = "git.diff"
    return state


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _nccl() -> str:
    version = torch.cuda.nccl.version()  # (2, 21, 5), or an int on some builds
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def environment_record(run_dir: Path) -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "git": code_state(run_dir),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": _nccl() if gpus else None,
        "gpus": gpus, "driver": _driver() if gpus else None,
        "env": {name: redact(name, value) for name, value in sorted(os.environ.items())
                if name.startswith(ENV_PREFIXES)},
        "packages": dict(sorted((dist.metadata["Name"] or "?", dist.version)
                                for dist in importlib.metadata.distributions())),
    }
