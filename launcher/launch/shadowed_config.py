"""A config of one's own that Hydra would never read: an option in a `-cd` dir named like one of the launcher's.

Hydra takes a chosen option (model=mlp) from the first dir on its search path that has it, and the launcher's conf/
comes before a `--config-dir` (or `hydra.searchpath`) of one's own: ~/myjobs/conf/model/mlp.yaml was ignored in
silence and the launcher's mlp trained. Refused in the parent, before any process starts, naming the rename; the
same file in both (a copied conf/) changes nothing and passes.
Exercised by: tests/test_own_job.py.
"""
from __future__ import annotations

from pathlib import Path

from launcher.derived import ConfigError


def check_shadowed_options() -> None:
    """Raise ConfigError for the first chosen option that a later dir of Hydra's search path has with other text."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    runtime = HydraConfig.get().runtime
    dirs = [Path(source.path) for source in runtime.config_sources if source.schema == "file" and source.path]
    for group, option in runtime.choices.items():
        if option is None or group.startswith("hydra/"):
            continue
        name = f"{group}/{option}.yaml"
        found = [d / name for d in dirs if (d / name).is_file()]
        read = found[0] if found else None
        for other in found[1:]:
            if other.read_bytes() != read.read_bytes():
                raise ConfigError(f"{group}={option}: {other} is not what this run reads: Hydra reads {read}, which "
                                  f"comes first on its search path; give yours a name of its own ({group}/<name>.yaml) "
                                  f"and choose {group}=<name>")
