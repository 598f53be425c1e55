"""Formulas the parent and every worker compute alike: grad_accum_steps (global / (micro x world), and the
ConfigError it raises), config_hash (of the config's trajectory part; ranks and resumes compare it), and
what several nodes must agree on (node_view).
Exercised by: tests/test_units.py and tests/test_cli.py.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the config or environment; printed as one line, no traceback. Raised in a worker (what only
    the job tells: its eval metrics, its blocks, its data's size), each rank prints none either, and the launcher
    says the line of the first rank that failed (error.txt keeps its traceback)."""

    one_line = True  # (launcher/train/worker.py's exit, as for the job's own one-line errors: launcher/train/job.py)


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """K = global / (micro x world); the one formula the parent and every worker use."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} is not divisible by train.micro_batch_size="
            f"{micro_batch_size} x world size {world_size} (= {per_step}); set train.global_batch_size "
            f"to a multiple of {per_step} or change train.micro_batch_size")
    return global_batch_size // per_step


def auto_precision(device_type: str, capabilities: list[tuple[int, int]]) -> str:
    """precision=auto: bf16 where every GPU has bf16 tensor cores (compute capability 8.0, Ampere, or newer), fp16
    with loss scaling on older GPUs (V100: fp16 tensor cores only), fp32 on the CPU (most CPUs lack bf16
    instructions, and bf16 there runs several times slower than fp32)."""
    if device_type != "cuda":
        return "fp32"
    return "bf16" if capabilities and min(capabilities) >= (8, 0) else "fp16"


def auto_ddp_split(nnodes: int) -> bool:
    """train.compile_ddp_split=null: cut the compiled model at DDP's buckets only across nodes, where each bucket's
    all-reduce, overlapped with the rest of the backward, saves network time; within a node NVLink all-reduces a
    model's gradients in a few ms, and the cuts cost more (fusion stops at each: BERT-base is 14 graphs, and on an
    H200 ran at 0.54x the one graph's speed)."""
    return nnodes > 1


def compiles_each_block(strategy: str, compile_scope: str | None) -> bool:
    """Whether a compiled model compiles each block on its own (strategy=fsdp: FSDP2 gathers the weights between
    them; train.compile_scope=block under ddp) rather than the whole model (DDP's graph, one or cut at buckets)."""
    return strategy == "fsdp" or compile_scope == "block"


FUSED_BY_DEFAULT = {"ddp": ("Adam", "AdamW", "SGD"), "fsdp": ("Adam", "AdamW")}


def takes_fused(optimizer: Any, strategy: str) -> bool:
    """Whether the workers add fused=True: for torch's Adam/AdamW/SGD on every device, unless the config chooses
    (fused or foreach). Fused steps skip a non-finite step on the device (no host sync), and on the CPU AdamW's is
    5-7x faster than torch's default there, the per-tensor loop (bench/optimizer_step.py), so CPU runs take the path
    that GPU runs take. Not SGD under strategy=fsdp: torch's sharded tensors (DTensor) have no rule for its fused
    kernel (aten._fused_sgd_, torch 2.13), so it takes torch's default (foreach on GPUs)."""
    module, _, name = str(optimizer["_target_"]).rpartition(".")  # (another library's AdamW takes no fused)
    return module.startswith("torch.optim") and not {"fused", "foreach"} & set(optimizer) and \
        name in FUSED_BY_DEFAULT[strategy]


def unfused_step_note(optimizer: Any, strategy: str) -> str | None:
    """For a GPU run whose optimizer steps unfused: each step then waits for the GPU, as the host reads the flag
    that says whether to skip it (launcher/train/step.py); what to use to avoid that wait. None for a fused step."""
    if takes_fused(optimizer, strategy) or optimizer.get("fused"):
        return None
    target = optimizer["_target_"]
    chosen = [f"optimizer.{key}={optimizer[key]}" for key in ("fused", "foreach") if key in optimizer]
    why = (", ".join(chosen) if chosen else "torch has no fused SGD for strategy=fsdp" if str(target).endswith(".SGD")
           else "the launcher fuses torch's Adam, AdamW and SGD only")
    return (f"note: {target} steps unfused ({why}): each step waits for the GPU while the host reads whether to skip "
            f"it (inf/nan gradients); fused Adam or AdamW steps without waiting")


# torch.compile's modes (train.compile_mode). The CUDA-graph ones overwrite a graph's outputs at its next
# replay, which breaks gradient accumulation over micro-batches (pytorch#169545): the parent refuses them
# with accumulation.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", *CUDA_GRAPH_MODES)

# Keys that do not change the trajectory: where it runs, how often and where it logs, and the batch's split
# (micro_batch_size only changes accumulation at a fixed global batch).
NOT_TRAJECTORY = {"plan", "launcher", "dist", "strategy", "resume", "name", "logger"}
NOT_TRAJECTORY_TRAIN = {"log_every", "eval_every", "ckpt_every", "ckpt_async", "keep_checkpoints", "num_workers",
                        "persistent_workers", "prefetch_factor", "compile", "compile_mode",
                        "compile_dynamic", "compile_fullgraph", "compile_ddp_split", "compile_scope", "max_bad_steps",
                        "log_samples", "micro_batch_size", "max_micro_batch_size", "profile", "profile_ranks",
                        "straggler_ratio", "best_metric", "best_mode"}


# model.activation_checkpointing (the BERT jobs) recomputes the activations it drops, the same numbers: a run that
# ran out of memory may resume with it on. model.tokenizer (the BERT jobs: ${data.tokenizer}, whose added tokens
# grow the embeddings) repeats a key the hash holds; in it, a run dir from before the key would resume no more
CHECKPOINTING_KEY = "activation_checkpointing"
NOT_TRAJECTORY_MODEL = {CHECKPOINTING_KEY, "tokenizer"}


def trajectory_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved config that decides the trained weights."""
    kept = {k: v for k, v in config.items() if k not in NOT_TRAJECTORY}
    kept["train"] = {k: v for k, v in config.get("train", {}).items() if k not in NOT_TRAJECTORY_TRAIN}
    if isinstance(config.get("model"), dict):
        kept["model"] = {k: v for k, v in config["model"].items() if k not in NOT_TRAJECTORY_MODEL}
    return kept


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(trajectory_config(config), sort_keys=True).encode()).hexdigest()[:16]


def differing_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs."""
    keys = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing_keys(a, b, f"{name}.")
        elif a != b:
            keys.append(name)
    return keys


# Several nodes (launcher=local, launcher.nnodes > 1): each node's launcher hands its workers what it
# resolved, and the workers compare it across nodes before the first step.
NODE_CONFIG = "LAUNCHER_NODE_CONFIG"


def node_view(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """What every node must agree on: the run dir, the plan, the strategy, the micro-batch (auto probes in
    collectives), and everything that shapes the trajectory."""
    train = config.get("train", {})
    return {"run_dir": str(run_dir), "plan": config["plan"], "strategy": config.get("strategy"),
            "micro_batch": [train.get("micro_batch_size"), train.get("max_micro_batch_size")],
            **trajectory_config(config)}
