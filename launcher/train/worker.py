"""Worker entry, the same on every rank and every path (local torchrun, Slurm, tests).

Reads only <run_dir>/config.yaml (OmegaConf, no Hydra app) and the env:// variables.
Exercised by: `torchrun --nproc-per-node 2 -m launcher.train.worker <run_dir>/config.yaml`.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Any

from launcher.interrupted import quiet_ctrl_c
from launcher.startup_gc import imports_begin, imports_done

if __name__ == "__main__":  # a rank (not a script that imports it): before torch's import, which takes seconds
    quiet_ctrl_c(None)  # Ctrl-C there is the launcher's to tell, not a traceback
    imports_begin()
import torch  # noqa: E402 (and the imports below)
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.closed_output import output_may_close
from launcher.compat import DDP_NO_FORWARD_BUFFER_SYNC
from launcher.derived import (NODE_CONFIG, ConfigError, auto_precision, compiles_each_block, config_hash,
                              differing_keys, grad_accum_steps, takes_fused)
from launcher.preempt import REQUEUE_EXIT_CODE, StopFlag, preemption_signals
from launcher.process_exit import exit_without_teardown
from launcher.train import checkpoint, meta_init, micro_batch, sharding
from launcher.train import dist as launcher_dist
from launcher.train.background_save import BackgroundSave
from launcher.train.best import best_eval
from launcher.train.compile_cache import CompileCache
from launcher.train.compiled import (CompileWatch, cannot_compile, compile_blocks, compile_module,
                                     eager_where_compiling_fails, failures_in_one_line)
from launcher.train.data import DataPlan, seed_all
from launcher.train.evaluation import probe_eval
from launcher.train.job import build_part, check_task
from launcher.train.loop import train
from launcher.train.loss_check import probe_loss_sum
from launcher.train.memory_trial import out_of_memory_in
from launcher.train.metrics import RunLog
from launcher.train.micro_batch_record import memory_config
from launcher.train.orphan import end_with_the_agent
from launcher.train.phases import phase
from launcher.train.precision import Precision
from launcher.train.profile import StepProfiler
from launcher.train.restore import restore
from launcher.train.run import Run
from launcher.train.schedule import build_scheduler
from launcher.train.sync_check import SyncCheck
from launcher.train.watchdog import Watchdog

if __name__ == "__main__":
    imports_done()

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def build(cfg: DictConfig, run_dir: Path, env: launcher_dist.DistEnv) -> Run:
    """Model, data, optimizer and the rest from the resolved config."""
    train_cfg = cfg.train
    seed_all(train_cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    # model.pretrained / data.tokenizer may name a run dir: a checkpoint of that run, the same on every rank
    sources = checkpoint.pretrained_sources(run_dir, {"model": cfg.model, "data": cfg.data}, cfg.resume.mode != "never",
                                            warn=lambda message: print(message, file=sys.stderr, flush=True))
    task = build_part("data", cfg.data, **sources["data"])
    check_task(task, cfg.data._target_)
    make = partial(build_part, "model", cfg.model, **sources["model"])
    group = sharding.shard_size(cfg.strategy.shard_size, env.world_size, cfg.plan.nproc_per_node) \
        if cfg.strategy.name == "fsdp" else None
    # strategy.meta_init: rank 0 builds the model, the others on the meta device; each receives its rows from rank 0
    model, mine = (meta_init.build(make, env.rank, group, env.device) if meta_init.in_use(cfg.strategy, env.world_size)
                   else (make(), None))
    if cfg.strategy.name != "fsdp":  # fsdp: fully_shard moves each block (then the root's own weights) to the device
        model.to(env.device)  # and cuts it there: one block at a time is whole on a GPU, never the whole model
    model.train()  # dropout on from step 1: HF's from_pretrained returns a model in eval mode
    precision = Precision(node_precision(cfg.precision.name, env), env.device.type, train_cfg.tf32)
    precision.apply_tf32()  # before compile, which reads it
    compile_cache = CompileCache(run_dir, env.local_rank, env.device, train_cfg.compile and train_cfg.compile_cache)
    compile_cache.load(lambda message: print(message, file=sys.stderr, flush=True))  # before anything compiles
    auto_compile = "compile" in (cfg.plan.get("auto") or {})  # train.compile=auto chose to compile
    compiling = train_cfg.compile and not (auto_compile and compile_turned_off(env))
    fallbacks = eager_where_compiling_fails() if compiling and auto_compile else None
    by_block = compiling and compiles_each_block(cfg.strategy.name, train_cfg.compile_scope)
    compile_each = (lambda found: compile_blocks(found, train_cfg, cfg.strategy.name == "fsdp")) if by_block else None
    if cfg.strategy.name == "fsdp":  # (the parent lets no DDP key or graph split through)
        said = "strategy=fsdp: sharded " + sharding.shard(model, cfg.strategy.reshard_after_forward, cfg.strategy.block,
                                                           precision, env.device, env.world_size, group, compile_each)
        if mine is not None:  # (strategy.meta_init)
            if not env.is_main:
                meta_init.receive(model, mine, env.device)
            said += "; built on rank 0 alone, the others' rows sent from it (strategy.meta_init)"
        if cfg.strategy.reduce_every_micro_batch:
            said += "; each micro-batch's gradients reduce-scattered (strategy.reduce_every_micro_batch)"
        if env.world_size > 1:  # (launcher/train/straggler.py)
            said += "; no straggler metrics (every rank waits for the others in each block's gathers)"
        trained = model  # its forward gathers each block's weights
    else:
        said = None
        if compile_each:  # train.compile_scope=block: DDP wraps the model whose blocks are compiled
            found, rule = sharding.blocks(model, cfg.strategy.block)
            compile_each(found)
            said = f"train.compile_scope=block: compiling {rule}"
        trained = wrap_ddp(cfg.dist, env, compile_module(model, train_cfg.compile_mode, train_cfg.compile_dynamic,
                                                     train_cfg.compile_fullgraph, train_cfg.compile_ddp_split)
                       if compiling and not by_block else model)
    seed_all(train_cfg.seed * 1_000_003 + env.rank)  # dropout/augmentation noise differs per rank
    fused = {"fused": True} if takes_fused(cfg.optimizer, cfg.strategy.name) else {}  # (derived.py: why)
    # _convert_: plain lists (betas) in the optimizer's state, so checkpoints load with weights_only=True
    # on every torch (2.6's unpickler refuses omegaconf's ListConfig)
    optimizer = build_part("optimizer", cfg.optimizer, params=trained.parameters(), _convert_="all", **fused)
    scheduler = build_scheduler(optimizer, cfg.scheduler.name, cfg.scheduler.warmup_steps, train_cfg.max_steps,
                                cfg.scheduler.min_lr_ratio)
    data_plan = DataPlan(n_samples=len(task.train_set), global_batch_size=train_cfg.global_batch_size,
                         seed=train_cfg.seed, drop_last=train_cfg.drop_last)
    if data_plan.steps_per_epoch == 0:
        raise ConfigError(f"the train set has {data_plan.n_samples} samples, fewer than train.global_batch_size="
                         f"{train_cfg.global_batch_size} with train.drop_last=true")
    auto = train_cfg.micro_batch_size == "auto"
    run = Run(run_dir=run_dir, env=env, task=task, model=trained, module=model, optimizer=optimizer,
              scheduler=scheduler, scaler=precision.grad_scaler(cfg.precision.init_scale, cfg.precision.growth_interval),
              precision=precision, data_plan=data_plan,
              # auto: 0 until micro_batch.choose, once the model and optimizer hold their memory
              grad_accum_steps=0 if auto else grad_accum_steps(train_cfg.global_batch_size,
                                                                train_cfg.micro_batch_size, env.world_size),
              micro_batch_size=0 if auto else train_cfg.micro_batch_size,
              out_of_memory=micro_batch.OutOfMemoryAgreement(
                  auto, env.device, launcher_dist.startup_timeout_s(cfg.dist.startup_timeout_s, cfg.dist.timeout_s),
                  redoes=cfg.strategy.name != "fsdp"),  # fsdp's forward and backward enter collectives: no step is redone
              reduce_every_micro_batch=bool(cfg.strategy.reduce_every_micro_batch),
              max_steps=train_cfg.max_steps,
              max_grad_norm=train_cfg.max_grad_norm, timeout_s=cfg.dist.timeout_s,
              checkpoint_timeout_s=cfg.dist.checkpoint_timeout_s, log_every=train_cfg.log_every,
              eval_every=train_cfg.eval_every if task.eval_set is not None else 0, ckpt_every=train_cfg.ckpt_every,
              keep_checkpoints=train_cfg.keep_checkpoints, max_bad_steps=train_cfg.max_bad_steps,
              log_samples=train_cfg.log_samples, num_workers=train_cfg.num_workers,
              persistent_workers=train_cfg.persistent_workers, prefetch_factor=train_cfg.prefetch_factor,
              log=RunLog(run_dir, enabled=env.is_main, straggler_ratio=train_cfg.straggler_ratio,
                         config=OmegaConf.to_container(cfg)),
              config_hash=config_hash(OmegaConf.to_container(cfg)),
              memory_config=memory_config(OmegaConf.to_container(cfg), env.world_size, env.device) if auto else {},
              watchdog=Watchdog(run_dir, env.rank, cfg.dist.hang_timeout_s),
              compile_watch=CompileWatch(compiling, train_cfg.compile_mode, fallbacks), compile_cache=compile_cache,
              sync_check=SyncCheck(train_cfg.sync_check, env.device), best=best_eval(task, train_cfg),
              background_save=BackgroundSave(env.device) if train_cfg.ckpt_async else None,
              profiler=StepProfiler(run_dir, env.rank, train_cfg.profile, list(train_cfg.profile_ranks), env.device))
    if said:
        run.log.info(said)
    if data_plan.n_samples < data_plan.global_batch_size and train_cfg.max_steps:  # (drop_last=true: refused above)
        run.log.warn(f"warning: the train set has {data_plan.n_samples} samples, fewer than train.global_batch_size="
                     f"{data_plan.global_batch_size}: every step trains on those {data_plan.n_samples}; lower "
                     f"train.global_batch_size, or use more data")
    if task.eval_set is None and (train_cfg.eval_every or not train_cfg.max_steps):  # (it logged `eval ` alone)
        if not train_cfg.max_steps:  # evaluate only, with nothing to evaluate: it ended "done", exit 0
            raise ConfigError("train.max_steps=0 evaluates only, and the job has no eval set; give it one (e.g. "
                              "data.eval_path), or train.max_steps > 0")
        run.log.warn(f"note: train.eval_every={train_cfg.eval_every}, but the job has no eval set (e.g. data.eval_path): "
                     f"no evals")
    if "pretrained" in sources["model"]:
        run.log.info(f"model.pretrained={cfg.model.pretrained}: from checkpoint {sources['model']['pretrained']}")
    return run


def wrap_ddp(dist_cfg: DictConfig, env: launcher_dist.DistEnv, trained: torch.nn.Module) -> DDP:
    """strategy=ddp: DDP around the (compiled) module, with dist.*'s settings."""
    ddp = DDP(trained, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
              bucket_cap_mb=dist_cfg.bucket_cap_mb, gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view,
              static_graph=dist_cfg.static_graph, find_unused_parameters=dist_cfg.find_unused_parameters,
              # No buffer broadcast per forward: ranks may run different numbers of micro-batches in a
              # short last window, and a per-forward broadcast would pair up mismatched collectives.
              **DDP_NO_FORWARD_BUFFER_SYNC)
    if dist_cfg.comm_hook:  # compress gradients to 16 bits on the wire (and back) before averaging
        ddp.register_comm_hook(dist.group.WORLD, COMM_HOOKS[dist_cfg.comm_hook])
    return ddp


def node_precision(name: str, env: launcher_dist.DistEnv) -> str:
    """precision=auto still open (a Slurm job: the submit host cannot see the nodes' GPUs) is chosen here, by every
    rank alike, from every rank's GPU (launcher/derived.py); any other precision is the config's."""
    if name != "auto":
        return name
    capability = torch.cuda.get_device_capability(env.device) if env.device.type == "cuda" else None
    return auto_precision(env.device.type, [c for c in launcher_dist.all_gather_objects(capability) if c])


def compile_turned_off(env: launcher_dist.DistEnv) -> bool:
    """train.compile=auto chose to compile: a machine that cannot (no Triton, no C++ compiler) trains eagerly, said
    in one line, every rank alike; what dynamo fails to compile in the model runs eagerly too, one line saying why
    (compiled.eager_where_compiling_fails). train.compile=true keeps every failure an error."""
    reasons = launcher_dist.all_gather_objects(cannot_compile(env.device))
    rank, reason = next(((r, why) for r, why in enumerate(reasons) if why), (None, None))
    if reason:
        if env.is_main:
            print(f"train.compile=auto: training eagerly, as rank {rank} cannot compile ({reason}); "
                  f"train.compile=false says so at once, train.compile=true makes it an error", flush=True)
        return True
    return False


@record  # the agent reports this worker's traceback in its failure summary
def main(config_path: str) -> None:
    end_with_the_agent()
    output_may_close()  # `python -m launcher ... | head` must not end the run at rank 0's next line
    path = Path(config_path).resolve()
    cfg = OmegaConf.load(path)
    stop = StopFlag(preemption_signals(cfg.launcher.signal))  # first: a signal during start-up is kept
    env = launcher_dist.init(cfg.plan.device_type, cfg.dist.backend,
                             launcher_dist.startup_timeout_s(cfg.dist.startup_timeout_s, cfg.dist.timeout_s))
    phase(path.parent, env.is_main, f"rendezvous done: world size {env.world_size}; building the job (data, model)")
    try:
        summary = build_and_train(cfg, path, env, stop)  # the run and its DDP model end with this call
    finally:
        launcher_dist.shutdown()
    if summary["preempted"]:
        sys.exit(REQUEUE_EXIT_CODE)


def same_config_on_every_rank(cfg: DictConfig, env: launcher_dist.DistEnv) -> str:
    """The config's hash, once every rank has shown it read the same (hydra#2070) and, where each node has its own
    launcher, every node resolved the same; checked before the collectives whose pairing the config decides."""
    hashes = launcher_dist.all_gather_objects(config_hash(OmegaConf.to_container(cfg)))
    if len(set(hashes)) != 1:
        raise RuntimeError(f"ranks read different configs: {hashes}")
    if NODE_CONFIG in os.environ:  # several nodes, each with its own launcher: did they resolve the same?
        nodes = launcher_dist.all_gather_objects(json.loads(os.environ[NODE_CONFIG]))
        rank, other = next(((r, view) for r, view in enumerate(nodes) if view != nodes[0]), (None, None))
        if other is not None:
            raise RuntimeError(f"the node of rank {rank} resolved another {', '.join(differing_keys(nodes[0], other))} "
                               f"than the node of rank 0; run the same command, with the same hydra.run.dir, on every node")
    return hashes[0]


def build_and_train(cfg: DictConfig, path: Path, env: launcher_dist.DistEnv, stop: StopFlag) -> dict[str, Any]:
    """Build the run, restore it from the latest checkpoint (unless resume=never), train; the summary."""
    plan = cfg.plan  # elastic (min_nnodes): any whole number of nodes from min_nnodes to nnodes
    worlds = [n * plan.nproc_per_node for n in range(plan.get("min_nnodes") or plan.nnodes, plan.nnodes + 1)]
    if env.world_size not in worlds:
        raise RuntimeError(f"WORLD_SIZE={env.world_size} but the plan in {path} says "
                           f"{' or '.join(map(str, worlds))}; relaunch with python -m launcher")
    config = same_config_on_every_rank(cfg, env)  # before build: precision=auto, compile=auto and DDP enter collectives
    run = build(cfg, path.parent, env)
    if run.task.eval_set is not None:  # every rank: a mistake in the job's eval parts is told now, not after training
        probe_eval(run, cfg.data._target_)
    probe_loss_sum(run, cfg.data._target_)  # every rank: a loss_sum that is a mean trains, wrongly
    state = None
    if cfg.resume.mode != "never":
        if checkpoint.complete_steps(path.parent):
            phase(path.parent, env.is_main, "loading the latest checkpoint")
        state = checkpoint.load_latest(path.parent, run.module, run.log.warn)
    progress = restore(run, state, cfg.train.seed, cfg.resume.allow_config_change)
    run.log.start_at(progress.step, run.max_steps)
    with failures_in_one_line(run.compile_watch.enabled, cfg.train.compile_fullgraph):  # the probe compiles first
        try:
            if run.out_of_memory.enabled:  # micro_batch_size=auto: the model, and any resumed optimizer state, are in place
                run.watchdog.at(micro_batch.PROBE, progress.step)
                phase(path.parent, env.is_main, "train.micro_batch_size=auto: finding the largest that fits")
                micro_batch.choose(run, cfg.train.max_micro_batch_size, state)
            run.log.info(f"world size {env.world_size} | grad accum "  # (the launcher's first line names the run dir)
                         f"{run.grad_accum_steps} | precision {run.precision.name} | "
                         f"{'compiled' if run.compile_watch.enabled else 'eager'} | {cfg.strategy.name} | config {config}")
            if progress.step >= run.max_steps:  # an evaluation without training, or the end of a run that ended
                phase(path.parent, env.is_main, f"no step to train (train.max_steps={run.max_steps})")
            elif run.compile_watch.enabled:
                phase(path.parent, env.is_main, "first step, compiling the model (minutes for a large one)")
            else:
                phase(path.parent, env.is_main, "first step")
            summary = train(run, progress, stop, state and state.get("final_eval"))
        except Exception as error:  # running out where a step (or an fsdp trial) cannot be redone: exit for a restart
            out_of_memory = out_of_memory_in(error)  # (also one that torch.compile wrapped: memory_trial.py)
            if out_of_memory is None:
                raise
            micro_batch.exit_out_of_memory(run, out_of_memory)
        finally:  # a run that ends in an error still writes its save in flight, before the exit takes down the
            if run.background_save is not None:  # process groups that strategy=fsdp's writers use
                run.background_save.finish()
    run.watchdog.close()  # done or preempted: what comes now (shutdown) is no hang of the loop
    run.profiler.close()  # a preemption inside train.profile's steps keeps what was recorded
    run.log.close()
    return summary


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as error:
        # a failure to build the job (launcher/train/job.py), a ConfigError, a run that diverged (train/ledger.py)
        one_line = getattr(error, "one_line", None)
        if one_line is None:
            raise
        if not one_line and os.environ.get("RANK") == "0":  # a fault in the job's code: where, once (every rank
            traceback.print_exc()                              # builds the same)
        sys.exit(1)  # @record keeps the error for the launcher's one line
    exit_without_teardown(0)  # (a preempted run exits 75 in main: what is rare may take the slow way)
