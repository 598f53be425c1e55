"""The job's task and model from the config (data._target_, model._target_): Hydra's instantiate, whose error
becomes one line naming the config group, and a task checked for what the launcher calls on it.

Hydra's own error ends in `full_key: data`, and the launcher shows the last line of a rank's error: that line
alone named neither the target nor what went wrong. Every rank builds the same, so a worker prints no traceback of
it (rank 0 does, for a fault in the job's own code: `one_line` false). Exercised by: tests/test_bad_input_in_the_workers.py.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from launcher.derived import ConfigError
from launcher.train.data import random_streams_kept

# What the launcher uses of every task, and of one with an eval set (launcher/task.py's Task)
TASK_PARTS = ("train_set", "eval_set", "collate", "count_items", "loss_sum")
EVAL_PARTS = ("eval_sum_keys", "eval_sums", "eval_metrics")


def build_part(group: str, section: DictConfig, **kwargs: Any) -> Any:
    """instantiate(section, **kwargs); a failure is a ValueError whose one line says which group, which target
    and what failed (the job's own error, or an argument the target does not take)."""
    try:
        return instantiate(section, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__ or error
        what = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())[:300]
        # An argument the target does not take, a target that does not import: Hydra itself raised it (not for an
        # error in the module's own code as it was imported, which Hydra passes on as the cause of its ImportError)
        by_hydra = _raised_in_hydra(cause) and (cause.__cause__ is None or isinstance(cause.__cause__,
                                                                                        ModuleNotFoundError))
        hint = f"; the keys of {group}.* are its arguments (--cfg job shows them)" if by_hydra and isinstance(
            cause, TypeError) else ""
        failure = ValueError(f"{group}._target_={section.get('_target_')} failed: {type(cause).__name__}: {what}{hint}")
        # The line says all for a config mistake, or for a job's message about its input (an error with a true
        # `one_line`, launcher/task.py); a fault in the job's own code keeps its traceback, which says where
        failure.one_line = by_hydra or bool(getattr(cause, "one_line", False))
        raise failure from error


HYDRA_CODE = os.path.dirname(hydra.__file__) + os.sep


def _raised_in_hydra(error: BaseException) -> bool:
    """Whether Hydra's own code raised `error` (its innermost frame), not the target's code it called."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(HYDRA_CODE)


def check_task(task: Any, target: str) -> None:
    """Raise, before the first step, when the task lacks a part the launcher will call (an eval would
    otherwise fail only at train.eval_every, after the steps before it were trained for nothing)."""
    needed = TASK_PARTS + (EVAL_PARTS if getattr(task, "eval_set", None) is not None else ())
    missing = [name for name in needed if not hasattr(task, name)]
    if missing:
        failure = ValueError(f"data._target_={target} built a {type(task).__name__} without {', '.join(missing)}: a "
                             f"task has what launcher/task.py's Task lists (the eval parts only with an eval_set)")
        failure.one_line = True
        raise failure
    job = f"data._target_={target}"
    for name in ("train_set", "eval_set"):
        samples = getattr(task, name)
        if samples is not None and not (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")):
            raise ConfigError(f"{job}: its {name} is a {type(samples).__name__} without len() and indexing; give a "
                              f"map-style dataset (a sample's id is its index; streaming datasets are not supported)")
    if len(task.train_set) == 0:
        raise ConfigError(f"{job}: its train_set is empty")
    if task.eval_set is not None and len(task.eval_set) == 0:
        raise ConfigError(f"{job}: its eval_set is empty; give eval_set = None for a job without an eval")
    keys = getattr(task, "eval_sum_keys", None) if task.eval_set is not None else ()
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{job}: its eval_sum_keys is {keys!r}; give a tuple of the names of the sums eval_sums "
                          f"returns")
    with random_streams_kept(torch.device("cpu")):  # (a job's collate may draw: the run's streams stay as they were)
        batch = task.collate([task.train_set[i] for i in range(min(2, len(task.train_set)))])
    if not isinstance(batch, Mapping):  # (the data loader's collate_fn, on the CPU: no model, no device yet)
        raise ConfigError(f"{job}: its collate returned a {type(batch).__name__}; return a dict of CPU tensors "
                          f"(its loss_sum reads them by name)")
