"""Resume policy, checked in the parent before any worker starts: auto, never or must, and no silent
config change under an existing run. Exercised by: `python -m launcher +exp=toy resume=must`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher.derived import ConfigError, differing_keys, trajectory_config
from launcher.rundir import complete_steps


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
