"""Continuing a run from its checkpoint: the optimizer, scheduler, scaler, RNG streams and progress it saved.

Exercised by: tests/test_resume.py, tests/test_fsdp.py (another strategy or world size).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from launcher.rundir import step_dir
from launcher.train import rng, sharded_checkpoint, sharding
from launcher.train.data import rank_seed, seed_all
from launcher.train.ledger import Progress
from launcher.train.run import Run
from launcher.train.schedule import resume_schedule


def restore(run: Run, state: dict[str, Any] | None, seed: int, allow_config_change: bool) -> Progress:
    """Optimizer, scheduler, scaler, RNG and progress from a checkpoint (weights are already loaded)."""
    if state is None:
        return Progress()
    if state["config_hash"] != run.config_hash and not allow_config_change:
        raise RuntimeError(f"the checkpoint was trained with config {state['config_hash']}, this run is "
                           f"{run.config_hash}; set resume.allow_config_change=true to resume anyway")
    # The checkpoint holds the state (moments, step counts, the schedule's position); this run's config holds the
    # settings (lr, betas, weight decay, fused...): a change that resume.allow_config_change let through applies.
    saved = state["optimizer"]
    if state.get("optimizer_moments"):  # strategy=fsdp wrote its moments in shards: each rank reads what it keeps
        shards = step_dir(run.run_dir, state["progress"]["step"]) / state["optimizer_moments"]
        saved = sharded_checkpoint.read(shards, saved, run.optimizer, run.checkpoint_timeout_s)
    elif sharding.is_sharded(run.module):  # DDP's full tensors: strategy=fsdp keeps its rows of each (sharding.py)
        saved = sharding.shard_optimizer_state(run.optimizer, saved)
    settings = run.optimizer.state_dict()["param_groups"]
    run.optimizer.load_state_dict({**saved, "param_groups": [{**new, "params": old["params"]} for new, old
                                                              in zip(settings, saved["param_groups"])]})
    resume_schedule(run.scheduler, state["scheduler"])
    if state["scaler"] and run.scaler.is_enabled():
        run.scaler.load_state_dict(state["scaler"])
    progress = Progress(**state["progress"])
    # a run goes on in the sample order it started with: one started before the "feistel" order names none
    order = state.get("sample_order", "randperm")
    if order != run.data_plan.order:
        run.data_plan = replace(run.data_plan, order=order)
        run.log.info(f"this run continues in the sample order it started with ({order}: torch.randperm of the whole "
                     f"train set at every step, a cost that grows with it); a new run dir reads its order in O(batch)")
    run.best.load(state.get("best"))
    if len(state["rng"]) == run.env.world_size:  # the same ranks: continue each rank's random stream
        rng.set_rng_state(state["rng"][run.env.rank], run.env.device)
    else:  # another world size: fresh, still deterministic per-rank streams
        seed_all(rank_seed(seed, run.env.rank, progress.step))
    run.log.info(f"resumed from step {progress.step} ({step_dir(run.run_dir, progress.step)})")
    return progress
