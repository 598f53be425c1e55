"""The training loop: a plain function with explicit cadences (log, eval), then the final save.

Exercised by: `python -m launcher +exp=toy`.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import partial
from typing import Any, Iterable, Iterator

import torch

from launcher.preempt import StopFlag, ignore_in_data_workers
from launcher.rundir import step_dir
from launcher.train import checkpoint, compiled, micro_batch, sharded_checkpoint, sharding
from launcher.train.background_save import HostWeights
from launcher.train.best import write_best
from launcher.train.data import StepWindows, Window, WindowStream, window_loader
from launcher.train.dist import all_gather_objects, same_buffers, training_timeout
from launcher.train.evaluation import evaluate
from launcher.train.ledger import Progress, StepLedger
from launcher.train.meter import Meter, peak_flops, peak_memory_mb, training_flops_per_item
from launcher.train.prefetch import AutoPrefetch
from launcher.train.run import Run
from launcher.train.step import train_step


def timed(loader: Iterable[Window]) -> Iterator[tuple[Window, float]]:
    """Each window with the seconds spent waiting for it (the data loader's share of step time)."""
    it = iter(loader)
    while True:
        started = time.perf_counter()
        try:
            window = next(it)
        except StopIteration:
            return
        yield window, time.perf_counter() - started


def train(run: Run, progress: Progress, stop: StopFlag, final_eval: dict[str, float] | None = None) -> dict[str, Any]:
    """Train from progress.step to max_steps; returns the summary (also written by rank 0).

    A preemption request reaches every rank in the next step's all-reduce; the host reads it one step
    later (launcher/train/ledger.py), and there every rank saves the same complete checkpoint and stops.
    `final_eval`: the final eval written beside the resumed checkpoint (launcher/rundir.py EVAL_FILE), if any.
    """
    resumed_from, resumed_samples = progress.step, progress.samples
    # The checkpoint holds the weights an eval was due on: a preemption's at an eval step, or the final one of a run
    # whose final eval did not end (then resumed with a larger train.max_steps; at max_steps finish evaluates them)
    if progress.eval_due and progress.step < run.max_steps:
        best_now = record_eval(run, progress.step)  # every rank
        if best_now and run.env.is_main:  # its checkpoint (the resumed one) is the best
            run.best.write(run.run_dir)
    progress.eval_due = False
    stream = window_stream(run, progress, stop)
    meter = Meter(run.env.device, training_flops_per_item(run.module),
                  peak_flops(run.env.device, run.precision.name, run.precision.tf32), run.env.rank, run.env.world_size,
                  sharded=sharding.is_sharded(run.module))
    ledger = step_ledger(run, progress)
    started, preempted, first_step_at = time.perf_counter(), False, None
    compile_counts: dict[str, int] = {}
    for window, data_wait_s in timed(stream):
        step = progress.step + 1
        # the first step of a compiled model compiles it (minutes for a large one): a hang report then says so
        run.watchdog.at("train" if first_step_at or not run.compile_watch.enabled else "train, compiling", step)
        log_now = step % run.log_every == 0 or step == run.max_steps
        eval_now = run.eval_every and step % run.eval_every == 0 and step != run.max_steps
        ckpt_now = run.ckpt_every and step % run.ckpt_every == 0 and step != run.max_steps
        steady = run.sync_check.steady(step, resumed_from, busy=log_now or eval_now or ckpt_now)
        with run.sync_check.watching(step, run.log.warn) if steady else nullcontext():  # train.sync_check
            if run.out_of_memory.redoes:  # auto under DDP: what a dropped attempt of this step gives back
                run.out_of_memory.remember(run.module)
                run.out_of_memory.rebuild_buckets(run.model)
            if run.compile_watch.cuda_graphs:  # a new step: CUDA-graph outputs of the last one may be reused
                torch.compiler.cudagraph_mark_step_begin()
            with run.profiler.step(step):
                result = train_step(run.model, run.task, window, run.optimizer, ledger, run.scaler, run.precision,
                                    run.max_grad_norm, run.env.device, meter.timer, run.out_of_memory,
                                    stop_requested=stop.requested,
                                    reduce_every_micro_batch=run.reduce_every_micro_batch)
            if result is not None:
                meter.add(window.step_samples, result.loss, window.n_tokens, data_wait_s)
                run.log.advance()
        if result is None:  # a rank ran out of memory before the gradient all-reduce; nothing has changed
            micro_batch.shrink(run, step)
            stream.resplit(run.grad_accum_steps)  # the same step again, in smaller micro-batches
            continue
        if first_step_at is None:  # start-up cost as users feel it: until the GPU has done the first step
            ledger.settle()
            first_step_at = time.time()
            training_timeout(run.timeout_s, run.out_of_memory.group)  # start-up is over: dist.timeout_s now
        progress.step = step
        progress.samples += window.step_samples
        if run.log_samples:  # an audit: gathering the ids makes every step wait (not watched by sync_check)
            run.log.samples(step, all_gather_objects(window.sample_ids))

        if log_now or eval_now or ckpt_now or ledger.stop:  # these wait for the GPU anyway: read this step's
            ledger.settle()                                 # flags now, so what they record is exact
        if log_now:  # every rank: the meter sums tokens, the compile counts are gathered
            compile_counts = log_interval(run, progress, meter, result.grad_norm)
        if ledger.stop:  # agreed by all ranks, read by all at the same step
            progress.eval_due = bool(eval_now)  # no time for it now: the next start evaluates these weights
            save_checkpoint(run, progress, complete=True)  # first: the grace period may end during what follows
            if run.compile_watch.enabled:  # a requeue onto another node loads them (maybe before any log)
                run.compile_cache.keep(compiled.compiled_graphs())
            run.log.preempted(step, stop.signum)
            # No rank exits before the marker exists: a node's launcher reads it once its workers exit.
            torch.distributed.barrier()
            preempted = True
            break
        with meter.left_out():  # the next log's samples/s, tokens/s and MFU are those of training
            best_now = False
            if eval_now:  # every rank: the eval's sums are all-reduced
                best_now = record_eval(run, step)  # whether this eval is the best so far (train.best_metric)
            if ckpt_now or best_now:
                began = time.perf_counter()
                save_checkpoint(run, progress)
                meter.ckpt_wait_s += time.perf_counter() - began  # the next record's ckpt_wait_s

    wall = time.perf_counter() - started
    summary = {"steps": progress.step, "final_loss": progress.last_loss, "preempted": preempted,
               "resumed_from": resumed_from, "wall_time_s": wall,
               "samples_per_sec": (progress.samples - resumed_samples) / wall if wall else 0.0,
               **run_facts(run, progress, first_step_at, compile_counts)}
    if not preempted:
        finish(run, progress, summary, final_eval)
    return summary


def window_stream(run: Run, progress: Progress, stop: StopFlag) -> WindowStream:
    """The steps' windows from progress.step on, through data.num_workers' loader (auto: AutoPrefetch's)."""
    windows = StepWindows(run.task, run.data_plan, run.env.rank, run.env.world_size, run.grad_accum_steps,
                          same_count=sharding.is_sharded(run.model))
    in_data_workers = partial(ignore_in_data_workers, signals=stop.signals)
    loader = (AutoPrefetch(run.env.device, run.prefetch_factor, in_data_workers, run.log.info)
              if run.num_workers == "auto" else
              partial(window_loader, num_workers=run.num_workers, pin_memory=run.env.device.type == "cuda",
                      persistent_workers=run.persistent_workers, prefetch_factor=run.prefetch_factor,
                      worker_init_fn=in_data_workers))
    return WindowStream(windows, progress.step, run.max_steps, loader)


def log_interval(run: Run, progress: Progress, meter: Meter, grad_norm: torch.Tensor) -> dict[str, int]:
    """Every rank: the interval's record (rank 0 writes it); the compile counts of all ranks, where compiled."""
    step = progress.step
    run.watchdog.at("log", step)
    record = {"step": step, "epoch": run.data_plan.epoch_of(step - 1), **meter.read()}  # the interval ends
    compile_counts: dict[str, int] = {}
    with meter.left_out():  # the host's work of logging (trackers, first imports) is no step's time
        record.update(micro_batch_size=run.micro_batch_size, grad_accum_steps=run.grad_accum_steps,
                      lr=run.scheduler.get_last_lr()[0], grad_norm=grad_norm.item(),
                      skipped_steps=progress.skipped_steps)
        if run.scaler.is_enabled():
            record["loss_scale"] = run.scaler.get_scale()
        if run.compile_watch.enabled:  # every rank: a recompile on any rank stalls them all
            compiles = run.compile_watch.read()
            run.compile_cache.keep(compiles["compiled_graphs"])  # this rank's new graphs, for the next start
            compile_counts, warnings = compiled.combine(all_gather_objects(compiles))
            record.update(compile_counts)
            for warning in warnings:
                run.log.warn(f"step {step}: {warning}")
        progress.last_loss = record["loss"]
        run.log.metrics(record, run.max_steps)
    return compile_counts


def run_facts(run: Run, progress: Progress, first_step_at: float | None,
              compile_counts: dict[str, int]) -> dict[str, Any]:
    """What the summary says of how the run trained, besides its progress and speed."""
    compiled = run.compile_watch.enabled
    return {"world_size": run.env.world_size, "grad_accum_steps": run.grad_accum_steps,
            "micro_batch_size": run.micro_batch_size, "precision": run.precision.name,
            "skipped_steps": progress.skipped_steps, "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "config_hash": run.config_hash, "peak_mem_mb": peak_memory_mb(run.env.device),
            "started_unix_time": run.log.start, "first_step_unix_time": first_step_at, "compiled": compiled,
            "compile_cache": run.compile_cache.kind if compiled else None, **compile_counts,
            "strategy": "fsdp" if sharding.is_sharded(run.module) else "ddp",
            "state_bytes_per_rank": sharding.state_bytes(run.module, run.optimizer), **run.sync_check.summary()}


def finish(run: Run, progress: Progress, summary: dict[str, Any], final_eval: dict[str, float] | None) -> None:
    """The run's end (not a preemption's): the final save, the final eval and summary.json, into `summary`. The
    save comes first: an eval that fails at the end (out of memory, a fault in the job's eval) loses no step, and
    the next start evaluates those weights. The eval is then written beside them (rundir.EVAL_FILE), so a
    start after it (workers restarted on their way out) finds the run's end there (`final_eval`)."""
    resumed_from = summary["resumed_from"]
    if progress.step and progress.skipped_steps == progress.step:  # fewer steps than train.max_bad_steps, all skipped
        run.log.warn(f"warning: all {progress.step} steps had non-finite gradients and were skipped: the weights are "
                     f"the initial ones; lower optimizer.lr, or look for inf or nan in the data")
    if progress.step > resumed_from:  # else the final checkpoint is already there
        # its eval, until eval.json is beside it (a resume past max_steps does it first)
        progress.eval_due = run.task.eval_set is not None
        save_checkpoint(run, progress, complete=True)
        progress.eval_due = False
    else:
        checkpoint.wait_for_background(run.background_save)  # (none is in flight: no step was trained)
    ended_before = final_eval is not None and progress.step == resumed_from
    if ended_before:
        summary["eval"] = final_eval
    else:
        run.watchdog.at("final eval", progress.step)
        same_buffers(run.module)  # (every rank: ended_before comes from the checkpoint all ranks read)
        summary["eval"] = evaluate(run)
        if summary["eval"]:
            run.log.metrics({"step": progress.step, "eval": summary["eval"]}, run.max_steps)
            if progress.step:  # (train.max_steps=0 has no checkpoint to keep)
                run.best.improved(progress.step, summary["eval"])
    if run.env.is_main and progress.step:  # this eval, or that of the resumed checkpoint, may be the best:
        run.best.write(run.run_dir)  # best.json first, before write_eval's retention lets the one it replaced go
        if not ended_before:
            checkpoint.write_eval(run.run_dir, progress.step, summary["eval"], run.best.state(), run.keep_checkpoints)
    # train.max_steps=0 evaluates only: no step, no checkpoint
    summary["checkpoint"] = str(step_dir(run.run_dir, progress.step)) if progress.step else None
    if run.best.metric and progress.step:
        summary["best"] = run.best.record(run.run_dir)
    if run.profiler.dir:
        summary["profile"] = str(run.profiler.dir)
    # No rank ends before rank 0 has written summary.json (the trackers' end may take long: not waited for): by it
    # a node's launcher tells a signal after the last step, no stop, from one before (launcher/launch/local.py)
    run.log.summary(summary, ended_before, then=torch.distributed.barrier)


def record_eval(run: Run, step: int) -> bool:
    """Evaluate and record; whether it is train.best_metric's best so far (the same on every rank: the metrics
    are all-reduced)."""
    run.watchdog.at("eval", step)
    same_buffers(run.module)  # every rank evaluates rank 0's BatchNorm statistics
    metrics = evaluate(run)
    run.log.metrics({"step": step, "eval": metrics}, run.max_steps)
    return run.best.improved(step, metrics)


def step_ledger(run: Run, progress: Progress) -> StepLedger:
    """The host's late view of the steps' agreed flags, counting into `progress` (launcher/train/ledger.py)."""
    return StepLedger(progress, run.scheduler, run.max_bad_steps, run.run_dir)


def save_checkpoint(run: Run, progress: Progress, complete: bool = False) -> None:
    """All ranks enter (RNG states are gathered); rank 0 writes checkpoints/<step>/, in the background with
    train.ckpt_async unless `complete` (the final save, a preemption's), which returns once it is written."""
    run.watchdog.at("checkpoint", progress.step)
    same_buffers(run.module)  # the checkpoint's buffers are every rank's: a resume goes on as the run would have
    write_model_files = getattr(run.task, "write_model_files", None)  # optional in the Task interface
    best = run.best.record(run.run_dir)  # best.json names the checkpoint that holds this best once it is complete
    # The others wait in a collective while rank 0 writes and checksums (or waits for the save before): gigabytes to
    # a shared file system can take longer than dist.timeout_s, and NCCL's watchdog would end the waiting ranks
    training_timeout(max(run.checkpoint_timeout_s, run.timeout_s))
    # strategy=fsdp: the full weights, gathered to rank 0's host (model.safetensors is DDP's: sharding.py), and
    # each rank's shards of the optimizer's moments, which it writes itself (sharded_checkpoint.py)
    sharded = sharding.is_sharded(run.module)
    weights = HostWeights(sharding.full_weights(run.module, run.env.is_main)) if sharded else run.module
    if sharded:  # (made by every rank here, not in a thread, nor after work of rank 0's that may fail)
        sharded_checkpoint.checkpoint_group(run.checkpoint_timeout_s)
        if run.background_save is not None:
            sharded_checkpoint.make_host_mesh(run.module)
    try:
        checkpoint.save(run.run_dir, progress.step, weights, train_state(run, progress),
                        run.keep_checkpoints, run.env.device, also_keep=run.best.step, background=run.background_save,
                        model_files=write_model_files and (lambda directory: write_model_files(run.module, directory)),
                        then=partial(write_best, run.run_dir, best),
                        moments=sharded_checkpoint.moments(run.optimizer.state_dict()) if sharded else None)
        if complete:
            checkpoint.wait_for_background(run.background_save)
    finally:
        training_timeout(run.timeout_s)


def train_state(run: Run, progress: Progress) -> dict[str, Any]:
    """Everything besides the weights that an exact resume needs (RNG states are added by the save)."""
    sharded = sharding.is_sharded(run.module)  # strategy=fsdp: the moments are written in shards, beside
    return {"progress": asdict(progress), "best": run.best.state(),
            "optimizer": (sharded_checkpoint.without_moments(run.optimizer.state_dict()) if sharded
                          else run.optimizer.state_dict()),
            "optimizer_moments": sharded_checkpoint.SHARDS if sharded else None,
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "config_hash": run.config_hash, "world_size": run.env.world_size, "sample_order": run.data_plan.order,
            # train.micro_batch_size=auto's size, kept by a resume (a fixed size comes from the config)
            "micro_batch_size": run.micro_batch_size if run.out_of_memory.enabled else None,
            micro_batch.FOUND_UNDER: run.memory_config if run.out_of_memory.enabled else None,
            "trackers": run.log.tracker_ids()}  # the tracker runs it belongs to (rank 0 writes it)
