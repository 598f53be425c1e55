"""Instrumented worker for tests/test_distributed_math.py; run under torchrun, one JSON file per rank.

It builds the run exactly as launcher.train.worker does, then drives launcher.train.step.train_step while recording
what a test needs: comm-hook calls, gradients after each micro-step, grad norms, param hashes,
loss scale and LR-scheduler position; mode `eval` runs only the launcher's evaluation.
Usage: torchrun ... probe_worker.py <config.yaml> <sync|fp16|eval|knobs|syncfree|timeouts> [inf_step]; writes
probe_rank<r>.pt
"""
from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from launcher.train import dist as launcher_dist
from launcher.train.data import StepWindows, window_loader
from launcher.train.dist import training_timeout
from launcher.train.ledger import Progress
from launcher.train.evaluation import evaluate
from launcher.train.loop import step_ledger
from launcher.train.meter import Meter
from launcher.train.step import train_step
from launcher.train.straggler import ComputeTimer
from launcher.train.worker import build


def params_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def main(config_path: str, mode: str, inf_step: int = -1) -> None:
    cfg = OmegaConf.load(config_path)
    env = launcher_dist.init(cfg.plan.device_type, cfg.dist.backend,  # as the worker: the start-up's timeout first
                             launcher_dist.startup_timeout_s(cfg.dist.startup_timeout_s, cfg.dist.timeout_s))
    out = observe(cfg, env, config_path, mode, inf_step)  # the run and its DDP model end with this call
    torch.save(out, Path(config_path).with_name(f"probe_rank{env.rank}.pt"))
    launcher_dist.shutdown()


def timeouts(run) -> dict:
    """Each group's timeout in seconds (gloo's: the CPU backend's options) at start-up, and once training_timeout
    ran as the loop runs it after the first step: the main group and the mesh's replica and shard groups."""
    mesh = next(p for p in run.model.parameters() if hasattr(p, "device_mesh")).device_mesh
    groups = {"main": dist.group.WORLD, **{name: mesh.get_group(name) for name in mesh.mesh_dim_names}}

    def read() -> dict[str, float]:
        return {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, group in groups.items()}
    startup = read()
    training_timeout(run.timeout_s, run.out_of_memory.group)
    return {"startup": startup, "training": read()}


def observe(cfg: DictConfig, env: launcher_dist.DistEnv, config_path: str, mode: str, inf_step: int) -> dict:
    run = build(cfg, Path(config_path).parent, env)
    if mode == "timeouts":  # strategy=fsdp with hybrid sharding: its mesh's groups' timeouts
        return timeouts(run)
    out: dict = {"rank": env.rank, "init_params": params_hash(run.model.module),
                 "random_draw": torch.rand(1).item(), "steps": []}
    if mode == "eval":
        out["eval"] = evaluate(run)
        return out
    if mode == "syncfree":  # issue 11: a steady step (no log, eval or checkpoint) never waits for the GPU
        ledger = step_ledger(run, Progress())
        windows = StepWindows(run.task, run.data_plan, env.rank, env.world_size, run.grad_accum_steps)
        loader = window_loader(windows, range(run.max_steps), num_workers=0, pin_memory=True)  # as the loop's
        meter = Meter(env.device, 1.0, None, env.rank, env.world_size)
        for step, window in enumerate(loader):
            if step == 3:  # after the warm-up: first allocations, DDP's bucket rebuild, optimizer state
                torch.cuda.set_sync_debug_mode("error")
            result = train_step(run.model, run.task, window, run.optimizer, ledger, run.scaler, run.precision,
                                run.max_grad_norm, env.device, meter.timer, run.out_of_memory)
            meter.add(window.step_samples, result.loss, window.n_tokens, 0.0)
        try:  # the control: a read of a GPU value does raise here
            result.loss.item()
            out["control_raised"] = False
        except RuntimeError:
            out["control_raised"] = True
        torch.cuda.set_sync_debug_mode("default")
        ledger.settle()
        out["steps_without_sync"] = run.max_steps - 3
        out["compiled_pieces"] = run.compile_watch.read().get("compiled_pieces")  # None without train.compile
        return out
    if mode == "knobs":  # what DDP, the optimizer and torch report after two real steps
        calls, comm_hook = {"n": 0}, run.model._get_ddp_logging_data().get("comm_hook")  # as the worker built it
        if not cfg.dist.comm_hook:  # count the all-reduces, one per bucket (a configured hook stays as it is)
            def counting_hook(state, bucket):  # unannotated: DDP rejects the string annotations of __future__
                state["n"] += 1
                return allreduce_hook(None, bucket)
            run.model.register_comm_hook(calls, counting_hook)
        windows = StepWindows(run.task, run.data_plan, env.rank, env.world_size, run.grad_accum_steps)
        ledger = step_ledger(run, Progress())
        for step in range(2):  # DDP rebuilds its buckets in grad-ready order after the first step
            calls["n"] = 0
            train_step(run.model, run.task, windows[step], run.optimizer, ledger, run.scaler, run.precision,
                       run.max_grad_norm, env.device, ComputeTimer(env.device, env.rank, env.world_size), run.out_of_memory)
        ddp = run.model._get_ddp_logging_data()
        out["knobs"] = {"bucket_cap_bytes": ddp["bucket_cap_bytes"], "comm_hook": comm_hook,
                        "buckets": calls["n"],  # all-reduces in the second step
                        "gradient_as_bucket_view": ddp["gradient_as_bucket_view"],
                        "static_graph": int(run.model.static_graph),
                        "find_unused_parameters": int(run.model.find_unused_parameters),
                        "fused": run.optimizer.defaults.get("fused"), "tf32": torch.backends.cuda.matmul.allow_tf32,
                        "compiled": type(run.model.module).__name__}
        return out

    hook_state = {"calls": 0, "micro_at_call": []}
    micro = {"index": -1, "step": -1, "snapshots": [], "items": []}

    def counting_hook(state, bucket):  # unannotated: DDP rejects the string annotations of __future__
        state["calls"] += 1
        state["micro_at_call"].append(micro["index"])
        return allreduce_hook(None, bucket)

    run.model.register_comm_hook(hook_state, counting_hook)
    task_loss = run.task.loss_sum

    def observed_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        micro["index"] += 1
        if micro["index"] > 0:  # gradients accumulated so far, before this micro-batch's backward
            micro["snapshots"].append(grads_of(run.model.module))
        micro["items"].append(int(run.task.count_items(batch)))
        loss = task_loss(model, batch)
        if micro["step"] == inf_step and env.rank == env.world_size - 1 and micro["index"] == 0:
            loss = loss * float("inf")  # an overflow on one rank only (the last: rank 1 of 2, or the only one)
        return loss

    run.task.loss_sum = observed_loss
    synced: list = []
    run.optimizer.register_step_pre_hook(lambda opt, args, kwargs: synced.append(grads_of(run.model.module)))

    windows = StepWindows(run.task, run.data_plan, env.rank, env.world_size, run.grad_accum_steps)
    progress = Progress()
    ledger = step_ledger(run, progress)
    timer = ComputeTimer(env.device, env.rank, env.world_size)
    with warnings.catch_warnings(record=True) as caught:  # PITFALLS #7: a skipped step warns of nothing
        warnings.simplefilter("always")
        for step in range(run.max_steps):
            micro.update(index=-1, step=step, snapshots=[], items=[])
            hook_state.update(calls=0, micro_at_call=[])
            synced.clear()
            scale_before, sched_before = run.scaler.get_scale(), run.scheduler.last_epoch
            window = windows[step]
            skipped_before = progress.skipped_steps
            result = train_step(run.model, run.task, window, run.optimizer, ledger, run.scaler, run.precision,
                                run.max_grad_norm, env.device, timer, run.out_of_memory)
            ledger.settle()  # what the loop does at its log steps: the step's skip and scheduler step are read
            out["steps"].append({
                "micro_batches": len(window.micro_batches), "sample_ids": window.sample_ids,
                "comm_hook_calls": hook_state["calls"], "micro_at_call": hook_state["micro_at_call"],
                "items_per_micro_batch": micro["items"], "unsynced_grads": micro["snapshots"],
                "synced_grads": synced[0] if synced else None,
                "grad_norm": result.grad_norm.item(), "loss": result.loss.item(),
                "stepped": progress.skipped_steps == skipped_before, "optimizer_state": len(run.optimizer.state),
                "params": params_hash(run.model.module), "scale_before": scale_before,
                "scale_after": run.scaler.get_scale(), "sched_before": sched_before,
                "sched_after": run.scheduler.last_epoch, "lr": run.scheduler.get_last_lr()[0]})
    out["warnings"] = [str(w.message) for w in caught]
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else -1)
