"""Complete checkpoints only: written to a temp dir, fsynced, renamed to checkpoints/<step>/, marked.

Model weights are safetensors (loadable without unpickling); optimizer, scaler, scheduler, train state
and every rank's RNG state go in train_state.pt, loaded with weights_only=True. The COMPLETE marker
holds each file's sha256, so a truncated or corrupt checkpoint is never loaded. A job may keep files of its
own beside the weights: a transformers job's checkpoint is a save_pretrained dir (from_pretrained loads it).
Exercised by: tests/test_resume.py, tests/test_pretrained_runs.py and `python -m launcher +exp=toy train.ckpt_every=50`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_model, save_model

from launcher.derived import ConfigError
from launcher.rundir import (CHECKPOINTS_DIR, EVAL_FILE, MARKER, PRETRAINED_FILE, PRETRAINED_KEYS, best_record,
                             checkpoint_eval, complete_steps, is_run_dir, pinned_checkpoint, pinned_pretrained,
                             step_dir, write_atomically)
from launcher.train import rng, sharded_checkpoint, sharding
from launcher.train.background_save import BackgroundSave, HostWeights
from launcher.train.dist import all_gather_objects, every_rank, on_rank_0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: Path, step: int, model: torch.nn.Module, train_state: dict[str, Any], keep: int,
         device: torch.device, model_files: Callable[[Path], None] | None = None,
         also_keep: int | None = None, background: BackgroundSave | None = None,
         then: Callable[[], None] | None = None, moments: dict[str, Any] | None = None) -> Path:
    """Every rank calls this (it gathers every rank's RNG state); rank 0 writes; all wait for the files, or, with
    `background` (train.ckpt_async), for rank 0's host buffers (and the save before), then its copy is queued.
    With `moments` (strategy=fsdp: this rank's shards of the optimizer's moments, sharded_checkpoint.py) every
    rank writes its own into the same checkpoint, and copies them to host memory for a background save.
    The newest `keep` checkpoints stay, and the one of step `also_keep` (train.best_metric's best).
    `model_files` writes what the job keeps beside the weights (a transformers job: config.json and the
    tokenizer, which make the checkpoint a save_pretrained dir); `then` runs on rank 0 once the save is complete."""
    rng_states = all_gather_objects(rng.rng_state(device))
    final = step_dir(run_dir, step)
    state = {**train_state, "rng": rng_states}
    is_main = torch.distributed.get_rank() == 0

    def write(weights: torch.nn.Module | HostWeights | None, written: dict[str, Any] | None,
              shards: dict[str, Any] | None) -> None:
        _write(run_dir, step, weights, written, keep, model_files, also_keep, shards)
        if then and weights is not None:
            then()

    def describe(error: Exception) -> str:
        return f"checkpoint of step {step} in {final.parent} failed: {type(error).__name__}: {error}"

    if moments is None:  # also the wait for the files (or the buffers): no rank reads them before; a failure (a full
        # disk) is every rank's, a background save's at the next save
        on_rank_0(lambda: (write(model, state, None) if background is None
                           else background.prepare(step, model, state, write)), describe=describe)
    else:
        wait_for_background(background)  # every rank's part of the save before: any rank's error is every rank's
        # rank 0 makes the temp dir before any rank starts: DCP makes its folder in there on every rank
        on_rank_0(lambda: _fresh(_tmp_dir(run_dir, step)), describe=describe)
        mine = (model, state) if is_main else (None, None)  # the other ranks write their shards only
        every_rank(lambda: write(*mine, moments) if background is None
                   else background.prepare(step, *mine, write, moments), describe=describe)
    if background is not None:  # every rank made its buffers: copy, write (no thread waits in DCP for a failed rank)
        background.go()
    return final


def wait_for_background(background: BackgroundSave | None) -> None:
    """Every rank calls this: returns once every rank's save in flight is complete (rank 0's, and under
    strategy=fsdp each rank's shards); any rank's failure is every rank's."""
    if background is not None:
        every_rank(background.wait)


def _write(run_dir: Path, step: int, model: torch.nn.Module | HostWeights | None, train_state: dict[str, Any] | None,
           keep: int, model_files: Callable[[Path], None] | None, also_keep: int | None,
           moments: dict[str, Any] | None = None) -> None:
    """Rank 0's part of save: the files, made complete at once, then the retention. `model`: the module, or
    its weights copied to host memory (launcher/train/background_save.py). With `moments` (strategy=fsdp) every
    rank enters: each writes its shards, and the others' part ends there (`model` None)."""
    root = run_dir / CHECKPOINTS_DIR
    tmp, final = _tmp_dir(run_dir, step), step_dir(run_dir, step)
    if moments is None:
        _fresh(tmp)
        shard_sums = {}
    else:  # (save made the temp dir); each rank sums its own files, rank 0 gets them all
        shard_sums = sharded_checkpoint.write(tmp / sharded_checkpoint.SHARDS, moments, _sha256)
    if model is None:
        return
    # handles tied weights; transformers 4 loads only a file that says it holds torch tensors
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if model_files:
        model_files(tmp)
    torch.save(train_state, tmp / "train_state.pt")
    files = {**{str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*"))
                if p.is_file() and p.relative_to(tmp).parts[0] != sharded_checkpoint.SHARDS}, **shard_sums}
    (tmp / MARKER).write_text(json.dumps({"step": step, "sha256": files}) + "\n")
    for item in (*tmp.rglob("*"), tmp):
        _fsync(item)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic: a reader sees no dir or a complete one
    _fsync(root)
    _retain(run_dir, keep, also_keep, step)


def _retain(run_dir: Path, keep: int, also_keep: int | None, step: int) -> None:
    """Rank 0: the newest `keep` checkpoints stay, that of `also_keep` (the best) and of `step` too."""
    for old in complete_steps(run_dir)[:-keep]:
        if old not in (also_keep, step):  # marker first: a dir half deleted (NFS keeps files in use) is none
            (step_dir(run_dir, old) / MARKER).unlink(missing_ok=True)  # (a resume deletes what is left)
            shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)  # the save stands


def write_eval(run_dir: Path, step: int, metrics: dict[str, float], best: dict[str, Any] | None, keep: int) -> None:
    """Rank 0, after the final eval: its metrics and the best with it, beside the final checkpoint's weights (written
    before the eval). A best that moved to this checkpoint lets the one it replaced go, as a save after it would."""
    write_atomically(step_dir(run_dir, step) / EVAL_FILE, json.dumps({"eval": metrics, "best": best}) + "\n")
    _retain(run_dir, keep, best and best["step"], step)


def _tmp_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before its rename to step_dir (_resume_point deletes leftovers)."""
    return run_dir / CHECKPOINTS_DIR / f".tmp-{step}"


def _fresh(tmp: Path) -> None:
    """An empty temp dir for a save (a killed save's is removed)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _verify(checkpoint: Path) -> None:
    """Raise unless every file of the checkpoint matches the checksum its marker recorded."""
    recorded = json.loads((checkpoint / MARKER).read_text())["sha256"]
    for name, digest in recorded.items():
        if _sha256(checkpoint / name) != digest:
            raise ValueError(f"{name} does not match its checksum")


def _usable(checkpoint: Path, warn: Callable[[str], None]) -> bool:
    """Whether checkpoint is a complete checkpoint whose files match their checksums (else a warning says why)."""
    try:
        _verify(checkpoint)
        return True
    except Exception as err:  # missing, truncated, corrupt, unreadable: say so
        warn(f"warning: checkpoint {checkpoint} is unusable ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
        return False


def _newest_usable(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of run_dir whose files match their checksums (rank 0 reads them); older ones
    when newer are unusable."""
    newest_first = (step_dir(run_dir, step) for step in reversed(complete_steps(run_dir)))
    return next((checkpoint for checkpoint in newest_first if _usable(checkpoint, warn)), None)


def _best_usable(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint of the best eval of a run that tracked one (train.best_metric), if it reads back whole."""
    best = best_record(run_dir)
    if best is None:
        return None
    best_dir = step_dir(run_dir, best["step"])
    return best_dir if (best_dir / MARKER).is_file() and _usable(best_dir, warn) else None


def load_latest(run_dir: Path, model: torch.nn.Module, warn: Callable[[str], None]) -> dict[str, Any] | None:
    """Load the newest readable checkpoint into model (all ranks agree on rank 0's choice).

    Weights are read to the CPU and copied into the parameters wherever they live; the train state stays
    on the CPU (optimizer.load_state_dict moves its tensors to the parameters' device, and RNG states must
    be CPU byte tensors), so a checkpoint written on GPUs loads on a CPU plan and the other way round."""
    found = on_rank_0(lambda: _resume_point(run_dir, warn))
    if found is None:
        return None
    step, evaluated = found  # (rank 0's read of its eval: a file system's cache may show another rank none yet)
    chosen = step_dir(run_dir, step)  # under this node's own path to the run dir
    _check_fits(model, chosen / "model.safetensors")
    if sharding.is_sharded(model):  # strategy=fsdp: each rank keeps its rows of the full tensors
        sharding.load_full_weights(model, chosen / "model.safetensors")
    else:
        load_model(model, str(chosen / "model.safetensors"))
    state = torch.load(chosen / "train_state.pt", weights_only=True, map_location="cpu")
    if evaluated is not None:  # the final eval of these weights, written after them: none is due
        state.update(final_eval=evaluated["eval"], best=evaluated["best"])
        state["progress"]["eval_due"] = False
    return state


def _check_fits(model: torch.nn.Module, weights: Path) -> None:
    """A checkpoint of another model (model.hidden changed under resume.allow_config_change=true) stops in one line
    naming the tensors that differ, before any is copied: load_state_dict listed them under a traceback on every
    rank. A name the file leaves out must be tied to one it holds (safetensors saves tied weights once)."""
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)  # (strategy=fsdp: DTensors, of the full shapes)
    with safe_open(str(weights), framework="pt") as tensors:
        shapes = {name: list(tensors.get_slice(name).get_shape()) for name in tensors.keys()}
    problems, loaded = [], {}  # loaded: id of each model tensor the file holds -> its first name there
    for name, shape in shapes.items():
        target = targets.get(name)
        if target is None:
            continue
        if shape != list(target.shape):
            problems.append(f"{name} is {shape} there, {list(target.shape)} here")
        if loaded.setdefault(id(target), name) != name:  # two tensors there, one here: one would overwrite the other
            problems.append(f"{name} is tied to {loaded[id(target)]} here, a tensor of its own there")
    problems += [f"{name} is not in this model" for name in sorted(set(shapes) - set(targets))]
    problems += [f"{name} is not in the checkpoint" for name, target in targets.items()
                 if name not in shapes and id(target) not in loaded]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(f"the checkpoint {weights.parent} does not fit this model: {'; '.join(problems[:3])}{more}; "
                          f"resume.allow_config_change=true lets a run's config change, not its weights' shapes: "
                          f"restore the model's config (the run dir's config.yaml), or train it in a new run dir")


def _resume_point(run_dir: Path, warn: Callable[[str], None]) -> tuple[int, dict[str, Any] | None] | None:
    """Rank 0's part of load_latest: the step to resume and its final eval (rundir.EVAL_FILE), if any. What no
    resume reads goes: the temp dirs of saves that were killed (each as big as a checkpoint), what the retention
    could not delete, and the unusable checkpoints newer than the one chosen, moved aside to
    checkpoints/.unusable-<step>: the retention of later saves counts by step, so it would keep them as the
    newest and delete the new checkpoints. A run none of whose checkpoints reads back does not start over."""
    root = run_dir / CHECKPOINTS_DIR
    unmarked = [d for d in root.glob("*") if d.name.isdigit() and not (d / MARKER).exists()]  # retention's rest
    for leftover in [*root.glob(".tmp-*"), *unmarked]:
        shutil.rmtree(leftover, ignore_errors=True)  # (what a file system keeps, it keeps: no reason to stop)
    chosen = _newest_usable(run_dir, warn)
    unusable = [step for step in complete_steps(run_dir) if chosen is None or step > int(chosen.name)]
    for step in unusable:
        aside = root / f".unusable-{step}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(step_dir(run_dir, step), aside)
    where = f"{root}/.unusable-<step> (steps {', '.join(map(str, unusable))})"
    if unusable and chosen is None:
        raise ConfigError(f"no checkpoint of this run reads back whole; they are moved aside to {where}: launch "
                         f"again to train from step 0, or put a good copy back")
    if unusable:
        warn(f"warning: moved the unusable checkpoints aside to {where}; delete them once looked at")
    return None if chosen is None else (int(chosen.name), checkpoint_eval(chosen))


def pretrained_sources(run_dir: Path, sections: dict[str, Any], resume: bool,
                       warn: Callable[[str], None]) -> dict[str, dict[str, str]]:
    """{"model": {"pretrained": checkpoint dir}, "data": {...}}: what each key of PRETRAINED_KEYS that names a run
    dir (model.pretrained=runs/pretrain) stands for, chosen by rank 0 and the same on every rank. At this run's
    first start it is that run's best checkpoint (train.best_metric), else its newest usable one, kept in
    <run dir>/pretrained.json: a restart, a requeue or a resume builds from the same one, or, should it be gone,
    from this run's own newest checkpoint (a save_pretrained dir as well, whose weights the resume loads anyway).
    Rank 0's error is every rank's: the others would otherwise wait in the broadcast (other nodes' ranks until
    dist.startup_timeout_s)."""
    chosen = on_rank_0(lambda: _choose_pretrained(run_dir, sections, resume, warn), error_type=ValueError)
    return {group: chosen.get(group, {}) for group in sections}


def _choose_pretrained(run_dir: Path, sections: dict[str, Any], resume: bool,
                       warn: Callable[[str], None]) -> dict[str, dict[str, str]]:
    """Rank 0's part of pretrained_sources."""
    pinned, sources, verified = pinned_pretrained(run_dir), {}, {}  # verified: each run's checkpoint, read whole
    before = dict(pinned)
    for group, section in sections.items():
        for key in (key for key in PRETRAINED_KEYS if is_run_dir(section.get(key))):  # (others load as they are)
            name, value = f"{group}.{key}", section[key]
            source, run = pinned_checkpoint(before, name, value), Path(value).resolve()  # (the parent's pins too)
            if source is None:  # this run's first start with this value (data.tokenizer is often model.pretrained)
                if run not in verified:
                    verified[run] = _best_usable(run, warn) or _newest_usable(run, warn)
                if verified[run] is None:
                    raise ConfigError(f"{name}={value} is a run dir without a usable checkpoint; train it first")
                source = str(verified[run])
            pinned[name] = {"run": str(run), "checkpoint": source}  # (what a later start of this run builds from)
            if source == str(verified.get(run)) or _usable(Path(source), warn):  # (read once for all the run's keys)
                verified[run] = Path(source)
            else:
                own = _newest_usable(run_dir, warn) if resume else None  # resume=never: its own weights won't load
                if own is None:
                    raise ConfigError(f"{name}={value}: its checkpoint {source}, which this run started from, is gone")
                source = str(own)
            sources.setdefault(group, {})[key] = source
    if pinned != before:
        write_atomically(run_dir / PRETRAINED_FILE, json.dumps(pinned, indent=2) + "\n")
    return sources
