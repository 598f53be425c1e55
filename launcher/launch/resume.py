"""Resume policy, checked in the parent before any worker starts: auto, never or must, no silent config
change under an existing run, and no second start of a run that already finished.
Exercised by: `python -m launcher +exp=toy resume=must`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from launcher.derived import ConfigError, config_hash, differing_keys, trajectory_config
from launcher.redact import redacted
from launcher.rundir import complete_steps, ended_summary, shown_number


def new_dir_key() -> str:
    """The key that gives a run a new dir: hydra.sweep.dir for a point of a -m sweep (its run dir is a subdir)."""
    try:
        return "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"
    except ValueError:  # outside a Hydra run (a test calling the check itself)
        return "hydra.run.dir"


def check_resume(run_dir: Path, config: dict[str, Any]) -> int | None:
    """The step a run will resume from (None: fresh), or ConfigError when the policy forbids it."""
    mode, allow_change = config["resume"]["mode"], config["resume"]["allow_config_change"]
    steps = complete_steps(run_dir)
    if mode == "must" and not steps:
        raise ConfigError(f"resume=must but {run_dir}/checkpoints has no complete checkpoint; "
                          f"use resume=auto to start fresh, or point hydra.run.dir at the run to resume")
    if mode == "never" and steps:
        raise ConfigError(f"resume=never but {run_dir} already holds checkpoints (latest step {steps[-1]}); "
                          f"use a new {new_dir_key()} or resume=auto")
    if not steps or mode == "never":
        return None
    previous = run_dir / "config.yaml"
    if previous.is_file() and not allow_change:
        try:
            old = trajectory_config(OmegaConf.to_container(OmegaConf.load(previous)))
        except Exception as err:  # unreadable, or not YAML
            raise ConfigError(f"{previous} cannot be read ({type(err).__name__}); restore it, use a new "
                              f"{new_dir_key()}, or set resume.allow_config_change=true") from None
        new = trajectory_config(config)
        changed = differing_keys(old, new)
        if changed:  # each key with both values: which one to restore, or to allow
            was = ", ".join(f"{key} was {_at(old, key)}, now {_at(new, key)}" for key in changed[:5])
            raise ConfigError(f"the checkpoints in {run_dir} were trained with a different config ({was}"
                              f"{' and more' if len(changed) > 5 else ''}); restore it, use a new {new_dir_key()}, "
                              f"or set resume.allow_config_change=true")
    max_steps = config["train"]["max_steps"]
    if steps[-1] > max_steps:  # the workers would train nothing, and record a second end of the run
        evaluate = (f" (with model.pretrained={run_dir} train.max_steps=0 it evaluates this run)"
                    if "pretrained" in config.get("model", {}) else "")
        raise ConfigError(f"the latest checkpoint in {run_dir} is step {steps[-1]}, past train.max_steps={max_steps}; "
                          f"raise train.max_steps, or use a new {new_dir_key()}{evaluate}")
    return steps[-1]


def finished(run_dir: Path, config: dict[str, Any], resume_step: int | None) -> str | None:
    """The line to print instead of starting the workers again when the run dir's run already finished
    (summary.json, at train.max_steps' checkpoint; None: start them). A second start would train nothing,
    and record the end of the run a second time: an eval, a summary and the trackers' final values."""
    max_steps = config["train"]["max_steps"]
    if config["resume"]["mode"] == "never" or resume_step != (max_steps or None):  # 0 evaluates: no checkpoint
        return None
    summary = ended_summary(run_dir, max_steps)  # (steps: not those of an earlier, shorter config)
    if summary is None:
        return None
    evaluated = " ".join(f"{k}={shown_number(v)}" for k, v in (summary.get("eval") or {}).items()) or "none"
    if max_steps:
        return (f"run dir {run_dir} already finished: {max_steps} steps, final loss {shown_number(summary['final_loss'])}, eval "
                f"{evaluated}; nothing to run (to train on, raise train.max_steps with "
                f"resume.allow_config_change=true; to train again, use a new {new_dir_key()})")
    if summary.get("config_hash") != config_hash(config):  # train.max_steps=0 with another config: a new evaluation
        return None
    return (f"run dir {run_dir} already evaluated without training: eval {evaluated}; nothing to run (to "
            f"evaluate again, use a new {new_dir_key()} or resume=never)")


def _at(config: dict[str, Any], dotted: str) -> str:
    """The value at a dotted key of a resolved config, as the user would type it (missing: unset), secrets out."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "unset"
        node = node[part]
    if node is None or isinstance(node, bool):  # (YAML's words)
        return "null" if node is None else str(node).lower()
    return str(redacted(dotted, node))[:60]  # (the line goes to launcher.log too: no token, no URL's credentials)
