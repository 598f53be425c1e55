"""A config of one's own that Hydra would never read: a file in a `-cd` dir named like one of the launcher's.

Hydra takes each config of the defaults list (model/mlp, logger/tensorboard, exp/toy) from the first dir on its search
path that has it, and the launcher's conf/ comes before a `--config-dir` (or `hydra.searchpath`) of one's own:
~/myjobs/conf/model/mlp.yaml was ignored in silence and the launcher's mlp trained. Refused in the parent, before any
process starts (for each point of a sweep), naming the rename; the same file in both (a copied conf/) changes nothing
and passes. The defaults list (chosen_configs) also tells launcher/launch/known_keys.py each group's option.
Exercised by: tests/test_own_job.py.
"""
from __future__ import annotations

from pathlib import Path

from launcher.derived import ConfigError


def chosen_configs(overrides: list[str] | None = None) -> list[str] | None:
    """The configs of the defaults list, as Hydra's search path names them (model/mlp, logger/tensorboard, exp/toy;
    not Hydra's own), with `overrides` (a sweep point's: the launch's Hydra config is point 0's in the up-front check
    of every point), else this launch's; None outside a Hydra app."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    defaults = GlobalHydra.instance().config_loader().compute_defaults_list(
        config_name=hydra.job.config_name, run_mode=RunMode.RUN,
        overrides=list(hydra.overrides.task) if overrides is None else overrides).defaults
    paths = dict.fromkeys(d.config_path for d in defaults if d.config_path)  # (a config's _self_ names it again)
    return [path for path in paths if not path.startswith("hydra/")]


def check_shadowed_configs(configs: list[str] | None) -> None:
    """Raise ConfigError for the first of `configs` (chosen_configs) that a later dir of Hydra's search path has with
    other text."""
    from hydra.core.hydra_config import HydraConfig

    if configs is None:
        return
    sources = HydraConfig.get().runtime.config_sources
    dirs = [Path(source.path) for source in sources if source.schema == "file" and source.path]
    for path in configs:
        found = [d / f"{path}.yaml" for d in dirs if (d / f"{path}.yaml").is_file()]
        for other in found[1:]:
            if other.read_bytes() != found[0].read_bytes():
                group, _, _ = path.rpartition("/")
                choose = f"choose {group}=<name>" if group else "choose it with --config-name=<name>"
                raise ConfigError(f"{other} is not what this run reads: Hydra reads {found[0]}, which comes first "
                                  f"on its search path; give yours a name of its own ({group or '.'}/<name>.yaml) "
                                  f"and {choose}")
