"""Config mistakes in one line: Hydra reports compose errors over many lines before our code runs.

Until the task function starts, stderr is held back; if Hydra exits with an error instead, its text is
condensed into one `error: ...` line and the exit code is 2. HYDRA_FULL_ERROR=1 shows Hydra's own report.
Exercised by: `python -m launcher +exp=toy train.micro_batchsize=4`.
"""
from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from launcher import schema
from launcher.launch.known_keys import CONF_DIR, closest, elsewhere

if TYPE_CHECKING:
    from omegaconf import DictConfig

_held: dict[str, object] = {}  # the real stderr while Hydra's output is held back
UNITS = {"_min": "minutes", "_s": "seconds", "_mb": "MB", "_gb": "GB"}  # what a key's name says of its unit


def _schema_fields(type_name: str) -> list[str]:
    cls = getattr(schema, type_name, None)
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def condense(text: str) -> str:
    """Hydra's multi-line report -> one line that names the key and what would be valid."""
    lines, options, skip_block = [], [], False
    full_key = object_type = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("Set the environment variable HYDRA_FULL_ERROR"):
            continue
        if line.startswith(("Config search path:", "Traceback (most recent call last):")):
            skip_block = True
            continue
        if skip_block and raw[:1] in (" ", "\t"):
            continue
        skip_block = False
        if line.startswith("full_key:"):
            full_key = line.split(":", 1)[1].strip()
        elif line.startswith("object_type="):
            object_type = line.split("=", 1)[1].strip()
        elif line.startswith("reference_type="):
            continue
        elif raw.startswith("\t"):  # an "Available options" list
            options.append(line)
        else:
            lines.append(line.rstrip(".:") if line.startswith("Available options") else line.rstrip("."))
    # Hydra's "To append to your config use +key=value" adds a key nothing reads (launcher/launch/known_keys.py)
    message = "; ".join(line for line in lines if not line.startswith("To append to your config use +"))
    if options:
        message += ": " + ", ".join(options)
    if "mkdir" in text and "Error" in message:  # Hydra creates the run dir before our code runs
        # (pathlib's mkdir raises again as it retries after making the parents: the last error is the one that stood)
        last = [line for line in lines if re.match(r"\w+Error: ", line)][-1:] or [message]
        message = f"hydra.run.dir (or hydra.sweep.dir) cannot be created: {last[0]}; give a path this user can create"
    message = _primary_hint(_argparse_hint(_group_hint(_type_hint(message))))
    if re.search(r"Could not find '(exp|data|model)/[^']+'", message) and \
            not any(arg.startswith(("-cd", "--config-dir")) for arg in sys.argv):  # (the groups a job of one's own adds)
        message += "; a job's own configs: add their conf dir with -cd <dir> (README: Adding a job)"
    unknown = re.search(r"Key '([^']+)' not in '(\w+)'", message)
    if unknown and object_type:
        valid = _schema_fields(object_type)
        close = closest(unknown.group(1), set(valid))  # the same guess as for a key added with +
        prefix = full_key.rsplit(".", 1)[0] + "." if full_key and "." in full_key else ""
        cfg = _composed_without(full_key) if full_key else None
        moved = elsewhere(cfg, full_key) if cfg is not None else None  # an exact name beats a close one
        message += (f"; did you mean {moved}?" if moved else f"; did you mean {prefix}{close}?" if close
                    else f"; valid keys: {', '.join(valid)}" if valid else "")  # (Hydra's own dataclasses: none)
    elif re.search(r"Key '[^']+' is not in struct", message) and full_key and "." in full_key:
        message += _untyped_hint(full_key)
    elif full_key and full_key not in message:
        message = f"{full_key}: {message}"
    return message or "Hydra could not compose the config"


def _untyped_hint(full_key: str) -> str:
    """A key unknown to an untyped group (model.hiden): where a key of that name lives, else the group's keys
    in the config composed without the override that failed, the closest first. Nothing when that config does
    not compose either."""
    from omegaconf import DictConfig, OmegaConf

    cfg = _composed_without(full_key)
    if cfg is None:
        return ""
    group, _, name = full_key.rpartition(".")
    node = OmegaConf.select(cfg, group)
    keys = [str(key) for key in node] if isinstance(node, DictConfig) else []
    close, moved = closest(name, set(keys)), elsewhere(cfg, full_key)
    return (f"; did you mean {moved}?" if moved else f"; did you mean {group}.{close}?" if close
            else f"; {group}.* has {', '.join(keys)}" if keys else "")


def _composed_without(full_key: str) -> DictConfig | None:
    """The config of this command without the override of full_key, or None where it does not compose either (a
    --config-dir of the user's)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def other(key: str) -> bool:  # (train.scheduler.name=x fails as train.scheduler)
        return key != full_key and not key.startswith(f"{full_key}.")

    # a sweep's a,b values go too: what the keys are does not depend on them
    overrides = [arg for arg in sys.argv[1:] if "=" in arg and not arg.startswith(("-", "hydra."))
                 and other(arg.split("=", 1)[0].lstrip("+~")) and "," not in arg.split("=", 1)[1]]
    GlobalHydra.instance().clear()  # what the failed compose left
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except Exception:  # say no more than Hydra did
        return None


def _type_hint(message: str) -> str:
    """A value of the wrong type (launcher.timeout_min=1:00:00 said only that '1:00:00' is no Integer): what the key
    takes, in which unit where its name says, and its value in this config."""
    bad = re.search(r"Error merging override \+{0,2}([\w.]+)=([^\[].*?); Value '.*' of type '\w+' could not be "
                    r"converted to (Integer|Float)", message)  # (a list's item: Hydra's words, which name it)
    if not bad:
        return message
    from omegaconf import OmegaConf

    key, value, kind = bad.groups()
    if kind == "Integer" and re.fullmatch(r"[+-]?\d+\.0*", value):  # (32.0: a whole number, but no integer to Hydra)
        return f"{key}={value} is not an integer: write {key}={int(float(value))}"
    takes = {"Integer": "a whole number", "Float": "a number"}[kind]
    unit = next((f" of {word}" for end, word in UNITS.items() if key.endswith(end)), "")
    cfg = _composed_without(key)
    now = OmegaConf.select(cfg, key) if cfg is not None else None
    return f"{key}={value} is not {takes}: {key} takes {takes}{unit}" + (f", e.g. {key}={now}" if now is not None else "")


def _argparse_hint(message: str) -> str:
    """Hydra's argparse error without the usage text before it. (Its options are before the overrides already,
    wherever they were typed: cli.flags_first; what is left is an option it does not have, or a bad value.)"""
    if not message.startswith("usage:") or ": error: " not in message:
        return message
    refused = message.split(": error: ", 1)[1]
    if "unrecognized" not in refused:
        return refused
    flag = re.search(r"--(nproc[_-]per[_-]node|nnodes|node[_-]rank|rdzv[_-]endpoint|max[_-]restarts)\b", refused)
    if flag:  # torchrun's, typed as one would to torchrun: the launcher runs torchrun itself, from its launcher keys
        key = f"launcher.{flag.group(1).replace('-', '_')}"
        key = "launcher.nodes" if key == "launcher.nnodes" and "launcher=slurm" in sys.argv else key  # (its name)
        return f"{refused}; the launcher runs torchrun itself: give {key}=<value> (an override, no dashes)"
    return f"{refused}; python -m launcher --help lists the options"


def _primary_hint(message: str) -> str:
    """--config-name bert: an experiment named as the primary config, which is conf/config.yaml's."""
    named = re.search(r"Cannot find primary config '([^']+)'", message)
    if named and (CONF_DIR / "exp" / f"{named.group(1)}.yaml").is_file():
        return f"{message}; {named.group(1)} is an experiment: python -m launcher +exp={named.group(1)}"
    return message


def _group_hint(message: str) -> str:
    """What Hydra says without naming the fix: a list option that does not exist (logger=[mlfow]), an experiment
    without its package line, or a key of a logger that is not on (logger.mlflow.artifacts=true without mlflow in
    logger=[...])."""
    missing = re.search(r"Could not load '(\w+)/([^']+)'", message)
    if missing:
        options = sorted(p.stem for p in (CONF_DIR / missing.group(1)).glob("*.yaml"))
        return f"{missing.group(1)}={missing.group(2)} is not an option of {missing.group(1)}/: {', '.join(options)}"
    unpackaged = re.search(r"In '(exp/[^']+)': Could not override '\w+@exp\.", message)
    if unpackaged:  # the experiment's keys went under exp., its defaults' overrides found nothing there
        return (f"{message}; an experiment sets keys of the whole config: make `# @package _global_` the first "
                f"line of {unpackaged.group(1)}.yaml")
    if "Unexpected type for root: NoneType" in message:
        picked = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("logger=")), "[tensorboard]")
        for arg in sys.argv[1:]:
            name = arg.split(".")[1] if arg.startswith("logger.") and arg.count(".") >= 2 else None
            if name and name not in picked:
                return (f"{arg.split('=', 1)[0]} is set but {name} is not in logger={picked}; add it, e.g. "
                        f"logger=[tensorboard,{name}]")
    return message


@contextmanager
def hydra_errors_in_one_line() -> Iterator[None]:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return
    buffer = io.StringIO()
    _held["stderr"], sys.stderr = sys.stderr, buffer
    try:
        yield
    except SystemExit as stop:
        if sys.stderr is buffer and stop.code not in (0, None):  # Hydra failed before our task ran
            release_stderr(replay=False)
            print(f"error: {condense(buffer.getvalue())}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    finally:
        release_stderr()


def release_stderr(replay: bool = True) -> None:
    """Give stderr back (the task has started: from here on our own errors are one line already)."""
    if "stderr" in _held:
        held, real = sys.stderr, _held.pop("stderr")
        sys.stderr = real
        if replay and isinstance(held, io.StringIO):
            real.write(held.getvalue())
