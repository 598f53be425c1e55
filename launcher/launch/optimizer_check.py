"""The optimizer takes the values of its keys: checked in the parent, before any process starts.

optimizer.lr=abc crashed the parent with a traceback, and optimizer.weight_decay=abc passed it: every rank then
failed building the optimizer with `'<=' not supported between 'float' and 'str'`, a screen of tracebacks naming no
key. torch's optimizers check their values as they are built: here one is built without parameters (its values
checked, then the empty list refused), after each key's value is checked against the type of the optimizer's default.
Exercised by: tests/test_optimizer_check.py.
"""
from __future__ import annotations

import inspect
import sys
from numbers import Real
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.derived import ConfigError

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
EMPTY = "empty parameter list"  # torch's refusal of no parameters: every value passed its constructor's checks
BY_DEVICE = {"fused", "foreach", "capturable"}  # kernels chosen for the workers' device, not this process's


def check_optimizer(optimizer: DictConfig) -> None:
    """Raise ConfigError naming the optimizer key whose value the optimizer does not take."""
    target = str(optimizer.get("_target_"))
    module_name, _, name = target.rpartition(".")
    # torch's (imported already); a job's own is the workers' to build (its package may be imported by now:
    # launcher/launch/target_check.py)
    build = getattr(sys.modules.get(module_name), name, None) if module_name.startswith("torch.") else None
    if not isinstance(build, type) or not issubclass(build, torch.optim.Optimizer):
        return
    values = {str(k): v for k, v in OmegaConf.to_container(optimizer, resolve=True).items() if k not in HYDRA_KEYS}
    defaults = {p.name: p.default for p in inspect.signature(build).parameters.values()
                if p.default is not inspect.Parameter.empty}
    for key, value in values.items():
        kind = _kind(defaults.get(key))
        if kind and not _is(kind, value):
            raise ConfigError(f"optimizer.{key}={value} is not {kind} ({target} takes {key}={defaults[key]!r} by "
                              f"default)")
    try:  # no parameters: the constructor checks its values first, then refuses the empty list. (With one, torch's
        # add_param_group imports dynamo, 2 s here, which also sets TORCHINDUCTOR_CACHE_DIR for the workers to inherit)
        build([], **{k: v for k, v in values.items() if k not in BY_DEVICE})
    except (ValueError, TypeError, RuntimeError) as error:
        if EMPTY in str(error):
            return
        given = ", ".join(f"optimizer.{k}={v}" for k, v in values.items())
        raise ConfigError(f"{target} refused {given}: {str(error).strip().splitlines()[0][:200]}") from None
    except Exception:  # noqa: BLE001 - a constructor that needs parameters to check anything: the workers' to tell
        return


def _kind(default: Any) -> str | None:
    """What a value must be, from the optimizer's default (None: anything it checks itself)."""
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, Real):
        return "a number"
    if isinstance(default, tuple) and default and all(isinstance(v, Real) for v in default):
        return f"a list of {len(default)} numbers"
    return None


def _is(kind: str, value: Any) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, Real) and not isinstance(v, bool)

    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "a number":
        return number(value)
    return isinstance(value, (list, tuple)) and len(value) == int(kind.split()[3]) and all(map(number, value))
