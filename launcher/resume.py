"""Resume policy, checked in the parent before any worker starts: auto, never or must, and no silent
config change under an existing run. Exercised by: `python -m launcher +exp=toy resume=must`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher.checkpoint import complete_steps
from launcher.plan import ConfigError

# Keys that do not change the trajectory: where it runs, how often and where it logs, and the batch's split
# (micro_batch_size only changes accumulation at a fixed global batch).
NOT_TRAJECTORY = {"plan", "launcher", "dist", "resume", "name", "logger"}
NOT_TRAJECTORY_TRAIN = {"log_every", "eval_every", "ckpt_every", "keep_checkpoints", "num_workers",
                        "persistent_workers", "prefetch_factor", "compile", "max_bad_steps", "log_samples",
                        "micro_batch_size", "profile", "profile_ranks", "straggler_ratio"}


def trajectory_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved config that decides the trained weights."""
    kept = {k: v for k, v in config.items() if k not in NOT_TRAJECTORY}
    kept["train"] = {k: v for k, v in config.get("train", {}).items() if k not in NOT_TRAJECTORY_TRAIN}
    return kept


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(trajectory_config(config), sort_keys=True).encode()).hexdigest()[:16]


def differing_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing_keys(a, b, f"{name}.")
        elif a != b:
            keys.append(name)
    return keys


def check_resume(run_dir: Path, config: dict[str, Any]) -> int | None:
    """The step a run will resume from (None: fresh), or ConfigError when the policy forbids it."""
    mode, allow_change = config["resume"]["mode"], config["resume"]["allow_config_change"]
    steps = complete_steps(run_dir)
    if mode == "must" and not steps:
        raise ConfigError(f"resume=must but {run_dir}/checkpoints has no complete checkpoint; "
                          f"use resume=auto to start fresh, or point hydra.run.dir at the run to resume")
    if mode == "never" and steps:
        raise ConfigError(f"resume=never but {run_dir} already holds checkpoints (latest step {steps[-1]}); "
                          f"use a new hydra.run.dir or resume=auto")
    if not steps or mode == "never":
        return None
    previous = run_dir / "config.yaml"
    if previous.is_file() and not allow_change:
        try:
            old = trajectory_config(OmegaConf.to_container(OmegaConf.load(previous)))
        except Exception as err:  # unreadable, or not YAML
            raise ConfigError(f"{previous} cannot be read ({type(err).__name__}); restore it, use a new "
                              f"hydra.run.dir, or set resume.allow_config_change=true") from None
        changed = differing_keys(old, trajectory_config(config))
        if changed:
            raise ConfigError(f"the checkpoints in {run_dir} were trained with a different config "
                              f"({', '.join(changed)} changed); restore it, use a new hydra.run.dir, "
                              f"or set resume.allow_config_change=true")
    return steps[-1]
