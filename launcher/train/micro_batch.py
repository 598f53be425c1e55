"""train.micro_batch_size=auto: the largest micro-batch that fits on every rank, and what happens when a
rank runs out of memory later (every rank redoes the step in smaller micro-batches, or the run restarts).

The samples of a step depend only on the global batch (launcher/train/data.py) and the loss is divided by
the step's item count (launcher/train/step.py), so the micro-batch, and with it the accumulation, can
change between steps and the trajectory stays the same. Exercised by: tests/test_micro_batch.py and
`python -m launcher +exp=bert train.micro_batch_size=auto`.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors.handlers import get_error_handler

from launcher.preempt import OUT_OF_MEMORY_EXIT_CODE
from launcher.rundir import CHECKPOINTS_DIR
from launcher.task import to_device
from launcher.train import micro_batch_record
from launcher.train.dist import all_gather_objects, on_rank_0
from launcher.train.memory_trial import (forward_backward, free_memory, memory_report, moments_to_come,
                                         out_of_memory_in, usable_bytes)
from launcher.train.sharded_micro_batch import probe_in_step
from launcher.train.sync_check import host_side

if TYPE_CHECKING:
    from launcher.train.run import Run

MICRO_BATCH_FILE = micro_batch_record.MICRO_BATCH_FILE
FOUND_UNDER = "micro_batch_found_under"  # the checkpoint's copy of what its micro_batch_size was found under
SMALLER = ("use a smaller model, shorter inputs (data.max_length for text), a lower precision, or for the BERT jobs "
           "model.activation_checkpointing=true")
PROBE = "micro-batch probe"  # the watchdog's phase while the trials run


def sizes_to_try(share: int, bound: int) -> list[int]:
    """Divisors of this rank's share of the global batch, at most `bound`, largest first."""
    return [size for size in range(min(share, bound), 0, -1) if share % size == 0]


def halved(share: int, size: int) -> int | None:
    """The largest divisor of `share` that is at most half of `size`; None when `size` is 1."""
    smaller = sizes_to_try(share, size // 2)
    return smaller[0] if smaller else None


class OutOfMemoryAgreement:
    """Whether any rank ran out of memory in this step, agreed before the step's gradient all-reduce, and
    what a dropped attempt must give back besides its gradients.

    On the host, over gloo: the flag is a Python bool the moment the allocator fails, so agreeing on it
    never waits for the GPU (a small gloo group of its own, with the same timeouts as the main group: a rank
    stuck before the agreement fails the run after dist.timeout_s, as in the all-reduce; its own on CPU plans
    too, so that CI runs its collectives apart from the model's as a CUDA plan's NCCL ones are).
    Off, and no collective at all, unless train.micro_batch_size=auto: a fixed size is the user's to change;
    and under strategy=fsdp (`redoes` false), whose forward and backward enter collectives: there running out
    of memory ends the run for a start with half the size (exit_out_of_memory).
    """

    def __init__(self, enabled: bool, device: torch.device, timeout_s: float, redoes: bool = True):
        self.enabled, self.redoes, self.device, self.ran_out_here = enabled, enabled and redoes, device, False
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.redoes else None
        self.saved: tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]] | None = None

    @staticmethod
    def rebuild_buckets(model: torch.nn.Module) -> None:
        """Every rank, at a step's start: DDP rebuilds its gradient buckets once, in the first forward after the
        first synced backward, with a broadcast among the ranks. A rank that ran out before that forward (in
        the copy to the device, or in the job's code) would wait in the agreement while the others wait in the
        broadcast, until dist.timeout_s: so it is done here, where every rank is, as DDP's join hook does."""
        reducer = getattr(model, "reducer", None)  # (DDP's; torch has had _rebuild_buckets since 1.7)
        if reducer is not None and not model._has_rebuilt_buckets and reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True

    def any_rank_ran_out(self, ran_out: bool) -> bool:
        """Every rank, once per step (auto under DDP only); who_ran_out() then reads this rank's answer."""
        if not self.redoes:
            return False
        self.ran_out_here = ran_out
        flag = torch.tensor([int(ran_out)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        with host_side():  # train.sync_check: a CPU tensor, the GPU is not involved
            return bool(flag.item())

    def who_ran_out(self) -> str:
        """`rank 1 (<its memory>)` for every rank that ran out in the agreed step; every rank calls it."""
        reports = all_gather_objects(memory_report(self.device) if self.ran_out_here else None)
        return ", ".join(f"rank {rank} ({report})" for rank, report in enumerate(reports) if report)

    def remember(self, module: torch.nn.Module) -> None:
        """Before a step (or the probe): the random streams and buffers (BatchNorm statistics) that its
        forwards change, so that dropping it restores them. Host-side state and device copies: no wait."""
        if self.enabled:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            self.saved = (torch.get_rng_state(), cuda, [b.detach().clone() for b in module.buffers()])

    def rewind(self, module: torch.nn.Module) -> None:
        assert self.saved is not None, "rewind() without remember()"
        cpu, cuda, buffers = self.saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), buffers):
                buffer.copy_(saved)


def trial(run: Run, size: int, state_bytes: int) -> str | None:
    """Forward and backward of the largest batch of `size` outside DDP's sync (no collective, so running
    out interrupts no other rank): None when it fits with HEADROOM to spare, else why not."""
    device = run.env.device
    usable = usable_bytes(device) if device.type == "cuda" else 0.0
    try:
        peak = forward_backward(run, size, gradient_sync=False)
    except Exception as error:  # (the first trial compiles, where train.compile is on)
        if out_of_memory_in(error) is None:
            raise
        peak = -1
    if peak == -1:  # (outside the except block: its traceback, and the activations it holds, are gone)
        run.optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        return "out of memory"
    if peak is None:
        return None
    peak += state_bytes
    return None if peak <= usable else f"needs {peak / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable"


def probe(run: Run, sizes: list[int]) -> tuple[int, list[str]]:
    """This rank's largest size of `sizes` that fits (0: none) and what each trial found."""
    state_bytes = moments_to_come(run)
    tried = []
    for size in sizes:
        failed = trial(run, size, state_bytes)
        tried.append(f"{size} {failed or 'fits'}")
        if failed is None:
            return size, tried
    return 0, tried


def share_of(run: Run) -> int:
    return run.data_plan.global_batch_size // run.env.world_size


def use(run: Run, size: int, why: str, record: bool = True) -> None:
    """Every rank: train in micro-batches of `size` from now on; rank 0 records it and says why."""
    run.micro_batch_size, run.grad_accum_steps = size, share_of(run) // size
    if run.env.is_main and record:
        micro_batch_record.write(run.run_dir, size, why, run.memory_config)
    run.log.info(f"micro-batch {size}, accumulation {run.grad_accum_steps} (train.micro_batch_size=auto: {why})")


def choose(run: Run, max_size: int | None, state: dict[str, Any] | None) -> None:
    """Before the first step: the size a restart or resume had (micro_batch.json, or the checkpoint's `state`) where
    it was found under the same settings, else the largest that fits on every rank."""
    share = share_of(run)
    bound = min(max_size or share, share)
    # Rank 0's reading and judging, for all: another node may see an older copy of a file just replaced (NFS caches
    # names), and ranks that disagreed here would enter different collectives. No rank writes the record before this.
    record, kept, stale = on_rank_0(lambda: kept_sizes(run, state or {}))
    if kept and min(kept.values()) <= bound and share % min(kept.values()) == 0:  # alike on every rank
        source = min(kept, key=kept.get)
        use(run, kept[source], f"kept from {source}" + (f": {record['why']}" if source == MICRO_BATCH_FILE else ""),
            record=False)
        return
    if stale:
        run.log.info(f"train.micro_batch_size=auto: trying the sizes again: {'; '.join(stale)}")
    run.out_of_memory.remember(run.module)  # the trials' forwards may not change what step 1 starts from
    sizes = sizes_to_try(share, min([bound, *kept.values()]))
    # Either way the trials end in collectives: every rank has read the record before rank 0 writes it
    agreed, why = agree_on_probes(run, sizes) if run.out_of_memory.redoes else probe_in_step(run, sizes, SMALLER)
    run.out_of_memory.rewind(run.module)
    where = "" if run.env.device.type == "cuda" else (
        "; on a CPU running out of memory is not caught (the OS kills the process), so the largest size that "
        "runs is taken")
    use(run, agreed, why + where)


def kept_sizes(run: Run, state: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, int], list[str]]:
    """Rank 0: the record, the sizes kept from it and from the checkpoint, and for each not kept (found under other
    settings) why."""
    record = micro_batch_record.read(run.run_dir)
    kept, stale = {}, []
    from_checkpoint = {"micro_batch_size": state.get("micro_batch_size"), "found_under": state.get(FOUND_UNDER)}
    for source, found in ((MICRO_BATCH_FILE, record), ("the checkpoint", from_checkpoint)):
        size = found and found.get("micro_batch_size")
        if size:
            changed = micro_batch_record.changed(found.get("found_under"), run.memory_config)
            if changed:
                stale.append(f"micro-batch {size} of {source} was found before {changed} changed")
            else:
                kept[source] = size
    return record, kept, stale


def agree_on_probes(run: Run, sizes: list[int]) -> tuple[int, str]:
    """DDP: each rank probes alone (no collective in a trial), then all take the smallest size any found."""
    size, tried = probe(run, sizes)
    found = all_gather_objects((size, tried, memory_report(run.env.device) if not size else None))
    agreed = min(size for size, _, _ in found)
    if not agreed:
        rank, (_, tried, report) = next((r, f) for r, f in enumerate(found) if not f[0])
        raise RuntimeError(f"train.micro_batch_size=auto: rank {rank} cannot fit even micro-batch 1 of the "
                           f"job's largest batch ({report}); {SMALLER}")
    return agreed, "tried " + "; ".join(f"rank {r}: {', '.join(t)}" for r, (_, t, _) in enumerate(found))


def shrink(run: Run, step: int) -> None:
    """Every rank, after the agreed out-of-memory of `step`: drop the step and go on in micro-batches half
    the size, or end the run when there is no smaller size."""
    who, smaller = run.out_of_memory.who_ran_out(), halved(share_of(run), run.micro_batch_size)
    if smaller is None:
        raise RuntimeError(f"train.micro_batch_size=auto: {who} ran out of memory at step {step} even with "
                           f"micro-batch 1; the last complete checkpoint is kept in {run.run_dir / CHECKPOINTS_DIR}; "
                           f"{SMALLER}")
    drop_step(run, step)
    use(run, smaller, f"{who} ran out of memory at step {step} with micro-batch {run.micro_batch_size}; every "
                      f"rank redoes step {step}")


def drop_step(run: Run, step: int) -> None:
    """Forget the step's partial gradients and activations, then join DDP's gradient all-reduce once with
    a one-sample backward of zero: a rank whose last forward finished has DDP expecting that all-reduce
    (its next no_sync backward would start it instead), so every rank enters it, alike. Then the random
    streams and buffers go back to where the step started."""
    run.optimizer.zero_grad(set_to_none=True)
    free_memory(run.env.device)
    one = to_device(run.task.collate([run.task.train_set[0]]), run.env.device)
    try:
        with run.precision.autocast():
            loss = run.task.loss_sum(run.model, one) * 0.0
        loss.backward()
    except Exception as error:  # with the step's memory freed: this rank cannot train at all
        if out_of_memory_in(error) is None:
            raise
        raise RuntimeError(f"train.micro_batch_size=auto: rank {run.env.rank} ran out of memory at step {step} even "
                           f"for one sample ({memory_report(run.env.device)}); the last complete checkpoint is kept "
                           f"in {run.run_dir / CHECKPOINTS_DIR}; {SMALLER}") from None
    run.optimizer.zero_grad(set_to_none=True)
    run.out_of_memory.rewind(run.module)
    free_memory(run.env.device)


def exit_out_of_memory(run: Run, error: torch.OutOfMemoryError) -> NoReturn:
    """Out of memory where the step cannot be redone: in or after its gradient all-reduce (the other ranks
    wait in a collective this rank will not finish), anywhere in a step or trial of strategy=fsdp, in eval or
    in a checkpoint. With auto, the next start (torchrun's restart with launcher.max_restarts, or a relaunch)
    resumes from the last checkpoint with half the micro-batch, and the exit code says so
    (OUT_OF_MEMORY_EXIT_CODE); a fixed size exits with 1 (the same size would run out again). Exits once this
    rank's part of a save in flight is written (rank 0's, or under fsdp every rank's shards: the peers' exit may
    still cut rank 0 short, and the next start then takes the checkpoint before), without a clean shutdown: that
    could wait as long as the peers do."""
    phase, step = run.watchdog.phase, run.watchdog.step  # where the loop was: train, log, eval, checkpoint
    auto, redoes = run.out_of_memory.enabled, run.out_of_memory.redoes
    place = ("in the micro-batch probe" if phase == PROBE else
             f"in {phase} after step {step}" if not phase.startswith("train") else
             f"in or after the gradient all-reduce of step {step}" if redoes else f"in step {step}")
    where = (f"rank {run.env.rank} ran out of memory {place} ({memory_report(run.env.device)}; "
             f"{str(error).splitlines()[0][:200]})")
    smaller = halved(share_of(run), run.micro_batch_size) if auto else None  # (None before any trial: size 0)
    cannot = "where a step cannot be redone" if redoes or not phase.startswith(("train", PROBE)) else (
        "which strategy=fsdp cannot redo (every rank's forward and backward gather weights from the others)")
    if not auto:
        message = (f"{where} with train.micro_batch_size={run.micro_batch_size}; set train.micro_batch_size=auto "
                   f"(the largest size that fits, halved after running out) or a smaller size")
    elif not run.micro_batch_size:  # the probe, before its first trial: the model and its state alone do not fit
        message = f"train.micro_batch_size=auto: {where} before any micro-batch was tried; {SMALLER}"
    elif smaller is None:
        message = f"train.micro_batch_size=auto: {where} even with micro-batch 1; {SMALLER}"
    else:
        micro_batch_record.write(run.run_dir, smaller, f"rank {run.env.rank} ran out of memory {place} with micro-batch "
                                                   f"{run.micro_batch_size}, {cannot}", run.memory_config)
        restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        message = (f"{where} with micro-batch {run.micro_batch_size}, {cannot}; the next start "
                   f"resumes from the last checkpoint with micro-batch {smaller}" +
                   (" (torchrun restarts now)" if restarts_left > 0 else
                    f": relaunch with hydra.run.dir={run.run_dir} (a launcher=slurm job requeues itself), or set "
                    f"launcher.max_restarts>=1"))
    get_error_handler().record_exception(RuntimeError(message))  # the launcher's error line reads it
    if run.background_save is not None:  # this rank's part of the checkpoint the next start may resume from
        run.background_save.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(OUT_OF_MEMORY_EXIT_CODE if smaller else 1)
