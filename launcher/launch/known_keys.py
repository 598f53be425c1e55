"""No silent keys: every key of the composed config is one a schema or a `_target_` takes, `+` or not.

Hydra refuses a key a group lacks (`train.max_step=20`), but one added with `+` (`+train.max_step=20`, as Hydra's
own message suggests) goes into the config, and nothing reads it: the run trained 200 steps. Here, in the parent,
before any process starts: the typed groups' keys against their dataclasses (launcher/schema.py), the `_target_`
groups' (model, data, optimizer) against the target's signature, read from its source without importing it (a job's
module may import transformers: seconds), unless the target takes **kwargs.
Exercised by: `python -m launcher +exp=toy +train.max_step=20` (exit 2: did you mean train.max_steps?).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, get_args, get_type_hints

from omegaconf import DictConfig, OmegaConf

from launcher import schema
from launcher.derived import ConfigError
from launcher.launch.target_check import module_source

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repo's config groups, one folder each
TARGET_GROUPS = ("model", "data", "optimizer")
JOB_GROUPS = ("model", "data")  # their _target_ is the job: an option of another target is another job
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
GIVEN_BY_THE_WORKER = {"params"}  # the optimizer's parameters: the worker passes them

STEPS_NOT_EPOCHS = ("train.max_steps", "a run counts optimizer steps, not epochs")
ACCUMULATION = ("train.global_batch_size", "accumulation steps = global_batch_size / (micro_batch_size x ranks)")
BY_THE_PRECISION = ("precision=bf16", "or fp16, fp32, auto")  # (a group's choice: the value only where it is one)
# what HF's Trainer and Accelerate, Lightning and nanoGPT call keys of ours: a name no group has, so the guess by
# spelling missed (train.grad_clip listed TrainConfig's 30 keys), -> (our key, None: the same value means the same;
# or a note: the user's value is no value of ours, epochs=3 no train.max_steps=3)
PEER_NAMES: dict[str, tuple[str, str | None]] = {
    **dict.fromkeys(("grad_clip", "gradient_clip_val", "clip_grad_norm", "max_norm"), ("train.max_grad_norm", None)),
    **dict.fromkeys(("max_iters", "max_train_steps", "num_train_steps", "total_steps"), ("train.max_steps", None)),
    **dict.fromkeys(("epochs", "num_epochs", "max_epochs", "num_train_epochs"), STEPS_NOT_EPOCHS),
    **dict.fromkeys(("gradient_accumulation_steps", "accumulate_grad_batches"), ACCUMULATION),
    **dict.fromkeys(("per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
                    ("train.micro_batch_size", None)),
    **dict.fromkeys(("eval_interval", "eval_steps"), ("train.eval_every", None)),  # (Lightning's counts batches)
    **dict.fromkeys(("log_interval", "logging_steps", "log_every_n_steps"), ("train.log_every", None)),
    **dict.fromkeys(("save_steps", "save_interval", "checkpoint_interval"), ("train.ckpt_every", None)),
    "save_total_limit": ("train.keep_checkpoints", None),
    **dict.fromkeys(("warmup_iters", "num_warmup_steps"), ("scheduler.warmup_steps", None)),
    "learning_rate": ("optimizer.lr", None),
    **dict.fromkeys(("mixed_precision", "amp"), BY_THE_PRECISION),
    "fp16": ("precision=fp16", "or bf16, fp32, auto"), "bf16": BY_THE_PRECISION,  # (fp16=false: still the choice)
    "resume_from_checkpoint": ("resume=must", "from the newest checkpoint of the run dir that hydra.run.dir names"),
    "output_dir": ("hydra.run.dir", None),
}


def check_known_keys(cfg: DictConfig, configs: list[str] | None = None) -> None:
    """Raise ConfigError naming the first key nothing takes, and the closest key that is taken. `configs`: the
    defaults list's (launcher/launch/shadowed_config.py), which tells each group's option."""
    _check_dataclass(cfg, cfg, schema.Config, "")
    for group in TARGET_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and isinstance(node.get("_target_"), str):
            taken = target_parameters(node._target_)
            if taken is not None:
                _refuse_a_default_underneath(group, node, taken, configs or [])
                _refuse_unknown(cfg, group, [str(k) for k in node if k not in HYDRA_KEYS],
                                taken - GIVEN_BY_THE_WORKER, f"{node._target_} takes")


def _refuse_a_default_underneath(group: str, node: DictConfig, taken: set[str], configs: list[str]) -> None:
    """An experiment that writes its own model (or data) in place, without choosing it: Hydra merges it over the
    group's default option, whose keys its target does not take (model.hidden of model=mlp under torch.nn.Linear)."""
    choice = next((path.split("/", 1)[1] for path in configs if path.startswith(f"{group}/")), None)
    default = _raw(OmegaConf.load(CONF_DIR / group / f"{choice}.yaml")) if (
        choice and (CONF_DIR / group / f"{choice}.yaml").is_file()) else {}
    if default.get("_target_") in (None, node._target_):
        return
    leftover = [str(key) for key in node if key not in HYDRA_KEYS and key not in taken and key in default]
    if leftover:
        raise ConfigError(f"{group}.{leftover[0]} comes from {group}={choice} (conf/{group}/{choice}.yaml), the option "
                          f"under the {group}._target_ your config sets ({node._target_} takes no {leftover[0]}): "
                          f"write yours as a {group} option of its own and choose it ({group}=<name>, or "
                          f"`- override /{group}: <name>` in an experiment's defaults)")


def _check_dataclass(cfg: DictConfig, node: DictConfig, cls: type, prefix: str) -> None:
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    where = f"{prefix.rstrip('.')} (launcher/schema.py's {cls.__name__})" if prefix else "the config"
    _refuse_unknown(cfg, prefix.rstrip("."), [str(k) for k in node], fields, f"{where} has")
    for name in fields:
        child, typed = node.get(name), _dataclass_of(hints[name])
        if typed is not None and isinstance(child, DictConfig):
            _check_dataclass(cfg, child, typed, f"{prefix}{name}.")


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (Optional[X] too), or None."""
    for candidate in (hint, *get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _refuse_unknown(cfg: DictConfig, group: str, keys: list[str], taken: set[str], what: str) -> None:
    for key in keys:
        if key not in taken:
            name = f"{group}.{key}" if group else key
            close, moved = closest(key, taken), elsewhere(cfg, name)
            fix = (f"did you mean {moved}?" if moved else f"did you mean {group + '.' if group else ''}{close}?"
                   if close else f"{what} {', '.join(sorted(taken))}" if taken else f"{group} takes no keys")
            raise ConfigError(f"{name} is a key nothing reads (a typo, or one added with + that no schema or target "
                              f"takes): {fix}")


def elsewhere(cfg: DictConfig, full_key: str) -> str | None:
    """Where a key of that name lives when it is not in the group the user put it in (train.lr: optimizer.lr;
    launcher.max_steps: train.max_steps): keys of the config's top level or of its groups, or None. A group's
    choice comes with the value given (train.precision=bf16: precision=bf16; optimizer.name=sgd: optimizer=sgd)."""
    group, _, name = full_key.rpartition(".")
    root = group.split(".")[0]
    if root == "hydra":  # Hydra's own settings are no key of the job's
        return None
    given = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.split("=", 1)[0].lstrip("+~") == full_key]
    value = f"={given[0]}" if given else "=..."
    if name == "name" and (CONF_DIR / root).is_dir():  # a group's name is its choice
        return f"{root}{value}"
    top = {str(key): node for key, node in cfg.items_ex(resolve=False)}
    if group and name in top:
        node = top[name]
        if not isinstance(node, DictConfig):
            return name
        return f"{name}{value}" if (CONF_DIR / name).is_dir() else None  # (dist=x is no choice)
    # keys(), not `in`: that resolves interpolations, and a ??? key counts as absent (data.path of data=files)
    found = [f"{other}.{name}" for other, node in top.items()
             if other != root and isinstance(node, DictConfig) and name in node.keys()]
    chosen = top.get(root)
    option = (_option_with(root, full_key, value, chosen) if group and group == root and (CONF_DIR / root).is_dir()
              else None)  # (not train.scheduler.x, nor +seed)
    if option and (option[1] or not found):  # an option of the same job beats a key of another group
        return option[0]
    return " or ".join(found) or _ours(name, value)  # (+seed=1: data.seed or train.seed)


def _ours(peer: str, value: str) -> str | None:
    """The key of ours for a peer's name (PEER_NAMES): with the user's value where it means the same; a group's
    choice where the value names one (+mixed_precision=fp16: precision=fp16)."""
    ours, note = PEER_NAMES.get(peer, (None, None))
    group, choice = (ours or "").partition("=")[0], value[1:].strip("'\"")
    if ours and "=" in ours and choice in {path.stem for path in (CONF_DIR / group).glob("*.yaml")}:
        return f"{group}={choice}"
    return None if ours is None else f"{ours} ({note})" if note else f"{ours}{value}"


def _option_with(group: str, full_key: str, value: str, chosen: object) -> tuple[str, bool] | None:
    """The override that another option of `group` would take the key with, and whether that option builds the chosen
    one's `_target_` (or holds the key under the group's own package); its other options after it. Read from
    conf/<group>/*.yaml as written (nothing composed or resolved). data.path=x under data=sentiment: data=files
    data.path=x (data=corpus builds the MLM: another job, never offered to a classifier); optimizer.momentum=x under
    adamw: optimizer=sgd optimizer.momentum=x; a logger's keys live under its package: logger.wandb.mode=x."""
    name = full_key.rpartition(".")[2]
    target = _raw(chosen).get("_target_")
    found = []
    for path in sorted(CONF_DIR.glob(f"{group}/*.yaml")):
        text = path.read_text(encoding="utf-8")  # read once: its package header, then its keys
        package, node = re.match(r"#\s*@package\s+(\S+)", text), _raw(OmegaConf.create(text))
        same = bool(package) or (target is not None and node.get("_target_") == target)  # (a logger's: the group's)
        if name not in node or (package and package.group(1) == "_global_") or (group in JOB_GROUPS and not same):
            continue
        override = f"{package.group(1)}.{name}{value}" if package else f"{group}={path.stem} {full_key}{value}"
        found.append((not same, node[name] != "???", override, same))  # a key the option requires (???) first
    if not found:
        return None
    first, *rest = sorted(found)
    return first[2] + (f" (or {', '.join(other[2].split(' ')[0] for other in rest)})" if rest else ""), first[3]


def _raw(node: object) -> dict:
    """A config node's keys and values as written: interpolations and ??? unresolved."""
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}


def closest(key: str, taken: set[str]) -> str | None:
    """The taken key the typo most likely meant: of the similar ones, the one that starts most like it
    (nprocs: nproc_per_node, not nodes)."""
    similar = difflib.get_close_matches(key, sorted(taken), n=3, cutoff=0.5)
    return max(similar, key=lambda name: len(os.path.commonprefix([key, name])), default=None)


def target_parameters(target: str) -> set[str] | None:
    """The keyword parameters `target` (module.name, or module.Class for its __init__) takes; None where any key
    may be right (it takes **kwargs) or its signature cannot be read (a name the module imports from elsewhere)."""
    module_name, _, name = target.rpartition(".")
    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, name):  # imported already (torch.optim): ask Python
        try:
            parameters = inspect.signature(getattr(module, name)).parameters.values()
        except (TypeError, ValueError):
            return None
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return None
        return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # noqa: BLE001 - no such module, or a package that raises on import: the workers say it
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        tree = module_source(spec.origin)[0]
    except (OSError, SyntaxError, ValueError):  # (launcher/launch/target_check.py names a module that does not parse)
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            return None if init is None else _arguments(init.args, skip_self=True)
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _arguments(node.args, skip_self=False)
    return None


def _arguments(args: ast.arguments, skip_self: bool) -> set[str] | None:
    if args.kwarg is not None:
        return None
    names = [a.arg for a in args.posonlyargs + args.args][1 if skip_self else 0:] + [a.arg for a in args.kwonlyargs]
    return set(names) - {a.arg for a in args.posonlyargs}
