"""Every user mistake: exit 2 before any worker starts, ONE line naming the key and what would be valid,
no traceback, no half-made run dir (issue 6). What only the job's own code can tell (an argument its target
does not take, a task without a part the launcher calls) stops the workers before the first step: one line too
(tests/test_bad_input_in_the_workers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import compose_config, run_cli
from launcher.derived import ConfigError
from launcher.launch.cli import check_inputs, checked_config
from launcher.launch.resume import finished
from launcher.launch.slurm_jobs import active_job


def make_csv(tmp_path: Path) -> str:
    path = tmp_path / "reviews.csv"
    path.write_text("review,stars\ngreat film,5\n")
    return str(path)


def make_run_dir_with_corrupt_config(tmp_path: Path) -> str:
    run_dir = tmp_path / "old_run"
    (run_dir / "checkpoints" / "10").mkdir(parents=True)
    (run_dir / "checkpoints" / "10" / "COMPLETE").write_text("{}")
    (run_dir / "config.yaml").write_text("train: [unclosed\n")
    return str(run_dir)


CASES = {  # name: (overrides, or a function of tmp_path giving them; what the line must say)
    "unknown key": (["+exp=toy", "train.micro_batchsize=4"], "did you mean train.micro_batch_size?"),
    "unknown key of an untyped group": (["+exp=bert", "model.pretrain=x"], "did you mean model.pretrained?"),
    "unknown group option": (["+exp=toy", "precision=fp8"], "Available options in 'precision': auto, bf16, fp16, fp32"),
    "unknown exp": (["+exp=nope"], "Available options in 'exp': bench, bert, bert_mlm, toy; a job's own configs: add "
                                   "their conf dir with -cd <dir> (README: Adding a job)"),
    "unknown logger": (["+exp=toy", "logger=[mlfow]"], "logger=mlfow is not an option of logger/: mlflow, tensorboard, wandb"),
    "unknown option": (["+exp=toy", "--dry-run"], "unrecognized arguments: --dry-run; python -m launcher --help lists"),
    "a torchrun flag": (["+exp=toy", "--nproc_per_node", "2"],
                        "the launcher runs torchrun itself: give launcher.nproc_per_node=<value> (an override, no dashes)"),
    "an experiment as the primary config": (["--config-name", "bert"],
                                            "bert is an experiment: python -m launcher +exp=bert"),
    "wrong type": (["+exp=toy", "train.max_steps=abc"], "train.max_steps=abc"),
    "indivisible batch": (["+exp=toy", "train.global_batch_size=30"],
                          "train.global_batch_size=30 is not divisible by train.micro_batch_size=8"),
    "negative steps": (["+exp=toy", "train.max_steps=-1"], "train.max_steps=-1 must be >= 0"),
    "lr decaying below zero": (["+exp=toy", "scheduler=linear", "scheduler.min_lr_ratio=-1"],
                               "scheduler.min_lr_ratio=-1.0 is not in 0..1 (the final lr is optimizer.lr times it)"),
    "lr decaying upwards": (["+exp=toy", "scheduler=cosine", "scheduler.min_lr_ratio=2"],
                            "scheduler.min_lr_ratio=2.0 is not in 0..1"),
    "a float for an integer": (["+exp=toy", "train.global_batch_size=32.0"],
                               "train.global_batch_size=32.0 is not an integer: write train.global_batch_size=32"),
    "seed out of range": (["+exp=toy", "train.seed=4294967296"], "train.seed=4294967296 is not in 0..4294967295"),
    "zero micro batch": (["+exp=toy", "train.micro_batch_size=0"],
                         "train.micro_batch_size=0 is neither a positive integer nor auto"),
    "micro batch neither a size nor auto": (["+exp=toy", "train.micro_batch_size=big"],
                                            "train.micro_batch_size=big is neither a positive integer nor auto"),
    "auto with uneven rank shares": (["+exp=toy", "train.micro_batch_size=auto", "train.global_batch_size=31"],
                                     "train.global_batch_size=31 is not divisible by the world size 2"),
    "auto with a static graph": (["+exp=toy", "train.micro_batch_size=auto", "dist.static_graph=true"],
                                 "set dist.static_graph=false or a fixed train.micro_batch_size"),
    "zero max micro batch": (["+exp=toy", "train.micro_batch_size=auto", "train.max_micro_batch_size=0"],
                             "train.max_micro_batch_size=0 must be > 0"),
    "unknown sync check": (["+exp=toy", "train.sync_check=strict"],
                           "train.sync_check=strict is not one of null, warn, error"),
    "unknown best mode": (["+exp=toy", "train.best_metric=loss", "train.eval_every=2", "train.best_mode=lowest"],
                          "train.best_mode=lowest is not one of null, max, min"),
    "best mode without a metric": (["+exp=toy", "train.best_mode=min"],
                                   "train.best_mode=min has no effect without train.best_metric"),
    "best metric without evals": (["+exp=toy", "train.best_metric=loss", "train.eval_every=0"],
                                  "train.best_metric=loss needs evals during the run: set train.eval_every (it is 0: "
                                  "only the final eval), or drop train.best_metric"),
    "unknown compile mode": (["+exp=toy", "train.compile=true", "train.compile_mode=fast"],
                             "train.compile_mode=fast is not one of null, default, max-autotune-no-cudagraphs, "
                             "reduce-overhead, max-autotune"),
    "compile key without compile": (["+exp=toy", "train.compile_dynamic=true"],
                                    "train.compile_dynamic=true has no effect: train.compile=auto compiles only on "
                                    "GPUs; add train.compile=true or drop train.compile_dynamic"),
    "ddp split without compile": (["+exp=toy", "train.compile_ddp_split=false"],
                                  "train.compile_ddp_split=false has no effect: train.compile=auto compiles only on "
                                  "GPUs; add train.compile=true or drop train.compile_ddp_split"),
    "unknown compile scope": (["+exp=toy", "train.compile=true", "train.compile_scope=layer"],
                              "train.compile_scope=layer is not one of null, model, block"),
    "compile scope without compile": (["+exp=toy", "train.compile_scope=block"],
                                      "train.compile_scope=block has no effect: train.compile=auto compiles only on "
                                      "GPUs; add train.compile=true or drop train.compile_scope"),
    "compile scope of fsdp left eager": (["+exp=toy", "launcher=slurm", "launcher.device=auto",
                                          "launcher.gpus_per_node=2", "strategy=fsdp", "train.compile_scope=block"],
                                         "train.compile_scope=block has no effect: train.compile=auto leaves "
                                         "strategy=fsdp eager; add train.compile=true or drop train.compile_scope"),
    "ddp split of compiled blocks": (["+exp=toy", "train.compile=true", "train.compile_scope=block",
                                      "train.compile_ddp_split=false"],
                                     "train.compile_ddp_split=false cuts the whole model's graph, and "
                                     "train.compile_scope=block compiles each block"),
    "cuda graphs with accumulation": (["+exp=toy", "train.compile=true", "train.compile_mode=reduce-overhead"],
                                      "(pytorch#169545), and with 2 ranks this run accumulates 2 micro-batches per "
                                      "step; set train.micro_batch_size to global_batch_size / world size"),
    "cuda graphs with elastic nodes": (lambda tmp: [
        "+exp=toy", "train.compile=true", "train.compile_mode=reduce-overhead", "train.micro_batch_size=8",
        "train.global_batch_size=32", "launcher.nnodes=1:2", "launcher.rdzv_endpoint=localhost:29400",
        f"hydra.run.dir={tmp / 'elastic'}"], "with 2 ranks this run accumulates 2 micro-batches per step; use a "
                                             "fixed launcher.nnodes with one micro-batch per step"),
    "cuda graphs with auto": (["+exp=toy", "train.compile=true", "train.compile_mode=max-autotune",
                               "train.micro_batch_size=auto"], "this run accumulates an automatic number of"),
    "negative lr": (["+exp=toy", "optimizer.lr=-1e-3"], "optimizer.lr=-0.001 must be > 0"),
    "nccl without gpus": (["+exp=toy", "dist.backend=nccl"], "dist.backend=nccl needs GPUs"),
    "bf16 compression on cpu": (["+exp=toy", "dist.comm_hook=bf16"], "dist.comm_hook=bf16 needs GPUs with NCCL"),
    "bad signal": (["+exp=toy", "launcher.signal=FOO"], "launcher.signal=FOO is not a signal"),
    "missing data path": (["+exp=bert", "data=files", "data.path=/no/such/train.csv"],
                          "data.path=/no/such/train.csv does not exist"),
    "a file the embedded source leaves unread": (["+exp=bert_mlm", "data.path=corpus.txt"],  # (said before: not there)
                                                 "is read only with data.source=files, and data.source is embedded"),
    "data path not set": (["+exp=bert", "data=files"], "data.path is required (it is ??? in the config); set data.path=..."),
    "wrong columns": (lambda tmp: ["+exp=bert", "data=files", f"data.path={make_csv(tmp)}"],
                      "has no column(s) ['text', 'label'] (its columns: ['review', 'stars'])"),
    "hub id offline": (["+exp=bert", "model.pretrained=bert-base-uncased"],
                       "model.pretrained=bert-base-uncased is a hub id but the hub is off"),
    "model dir missing": (["+exp=bert", "model.pretrained=/no/such/model"],
                          "model.pretrained=/no/such/model is not a directory"),
    "a run dir mistyped, no org/name id": (lambda tmp: [
        "+exp=bert", f"model.pretrained={(tmp / 'runs' / 'pretrain').mkdir(parents=True) or 'runs/pretrian'}"],
        "model.pretrained=runs/pretrian is not a directory (runs/ holds pretrain); give a dir written by "),
    "a model dir mistyped": (lambda tmp: ["+exp=bert", f"model.pretrained={(tmp / 'a').mkdir() or tmp / 'b'}"],
                             "/ holds a); give a dir written by save_pretrained or a hub id"),
    "model path, no org/name id": (["+exp=bert", "model.pretrained=runs/a/b"], "model.pretrained=runs/a/b is not a dir"),
    "resume=must without checkpoint": (["+exp=toy", "resume=must"], "resume=must but"),
    "unknown device": (["+exp=toy", "launcher.device=tpu"], "launcher.device"),
    "cuda plan without slurm gpus": (["+exp=toy", "launcher=slurm", "launcher.device=cuda"],
                                     "launcher.device=cuda but launcher.gpus_per_node=0"),
    "cpu plan asking slurm for gpus": (["+exp=toy", "launcher=slurm", "launcher.device=cpu", "launcher.gpus_per_node=8"],
                                       "launcher.device=cpu but launcher.gpus_per_node=8"),
    "no torch dtype": (["+exp=bert", "model.dtype=float17"],
                       "model.dtype=float17 is not the name of a torch dtype; e.g. float32, bfloat16 or float16"),
    "no torch dtype of the data": (["+exp=toy", "data.dtype=auto"], "data.dtype=auto is not the name of a torch dtype"),
    "a torch dtype with its module": (["+exp=toy", "model.dtype=torch.float64"],
                                      "model.dtype=torch.float64 is not the name of a torch dtype; write "
                                      "model.dtype=float64"),
    "max_length zero": (["+exp=bert", "data.max_length=0"], "data.max_length=0 is not a whole number > 0"),
    "max_length not a number": (["+exp=bert", "data.max_length=abc"], "data.max_length=abc is not a whole number > 0"),
    "dropout over one": (["+exp=bert", "model.dropout=1.5"], "model.dropout=1.5 must be a probability in [0, 1)"),
    "padding to zero tokens": (["+exp=bert_mlm", "data.pad_to_multiple_of=0"],
                               "data.pad_to_multiple_of=0 is not a positive number of tokens; use null"),
    "padding past the model's positions": (["+exp=bert", "data.max_length=512", "data.pad_to_multiple_of=100"],
                                           "data.pad_to_multiple_of=100 pads batches of data.max_length=512 tokens "
                                           "to 600, more than the 512 positions of model.pretrained="),
    "activation checkpointing not a bool": (["+exp=bert_mlm", "model.activation_checkpointing=yes"],
                                            "model.activation_checkpointing=yes must be true or false"),
    "max_length beyond the model": (["+exp=bert", "data.max_length=1000"],
                                    "data.max_length=1000 is more than the 512 positions of model.pretrained="),
    "profile steps reversed": (["+exp=toy", "train.profile=[5,2]"], "train.profile=[5, 2] is not [first, last] steps"),
    "profile rank outside the run": (["+exp=toy", "train.profile=[1,2]", "train.profile_ranks=[3]"],
                                     "train.profile_ranks=[3] must name ranks of this run (0..1)"),
    "slurm dependency typo": (["+exp=toy", "launcher=slurm", "launcher.dependency=afterwards:1"],
                              "launcher.dependency=afterwards:1 is not an sbatch dependency"),
    "slurm after a run never submitted": (lambda tmp: ["+exp=toy", "launcher=slurm", f"launcher.after={tmp}"],
                                          "holds no slurm.json: name the run dir of a run submitted with launcher=slurm"),
    "local nodes on slurm": (["+exp=toy", "launcher=slurm", "launcher.nnodes=2"],
                             "launcher.nnodes and launcher.rdzv_endpoint are for launcher=local on several machines"),
    "elastic range reversed": (["+exp=toy", "launcher.nnodes=3:2", "launcher.rdzv_endpoint=node001:29400"],
                               "launcher.nnodes=3:2 is not a number of nodes N >= 1 or MIN:MAX"),
    "elastic world that does not divide": (["+exp=toy", "launcher.nnodes=1:3", "launcher.rdzv_endpoint=node001:29400",
                                            "train.global_batch_size=48"],
                                           "train.global_batch_size=48 is not divisible by train.micro_batch_size=8 x world size 4"),
    "node rank outside the nodes": (["+exp=toy", "launcher.nnodes=2", "launcher.rdzv_endpoint=node001:29400",
                                     "launcher.node_rank=2"], "launcher.node_rank=2 needs a fixed launcher.nnodes"),
    "endpoint without a port": (["+exp=toy", "launcher.nnodes=2", "launcher.rdzv_endpoint=node001"],
                                "launcher.rdzv_endpoint=node001 is not <host>:<port>"),
    "dependency without slurm": (["+exp=toy", "launcher.dependency=afterok:1"],
                                 "launcher.dependency orders Slurm jobs; add launcher=slurm"),
    "slurm partition without slurm": (["+exp=toy", "launcher.partition=gpu"],
                                      "launcher.partition=gpu is for Slurm, and launcher=local would train on this "
                                      "machine without it; add launcher=slurm, or drop launcher.partition"),
    "slurm nodes without slurm": (["+exp=toy", "launcher.nodes=2"],
                                  "drop launcher.nodes (launcher=local on several machines: launcher.nnodes)"),
    "slurm zero nodes": (["+exp=toy", "launcher=slurm", "launcher.nodes=0"], "launcher.nodes=0 must be > 0"),
    "slurm negative timeout": (["+exp=toy", "launcher=slurm", "launcher.timeout_min=-5"],
                               "launcher.timeout_min=-5 must be > 0"),
    "slurm warning before the job starts": (["+exp=toy", "launcher=slurm", "launcher.timeout_min=2"],
                                            "launcher.signal_delay_s=120 is not below launcher.timeout_min=2 minutes"),
    "slurm requeue on scancel's signal": (["+exp=toy", "launcher=slurm", "launcher.signal=TERM"],
                                          "launcher.signal=TERM on Slurm cannot tell the time limit's warning from a "
                                          "scancel"),
    "run dir cannot be made": (["+exp=toy", "hydra.run.dir=/etc/passwd/run"], "hydra.run.dir (or hydra.sweep.dir) "
                               "cannot be created: NotADirectoryError: [Errno 20] Not a directory: '/etc/passwd/run'; "
                               "give a path this user can create"),
    "run dir under a dir that cannot have one": (  # mkdir raised again in its retry: one error, not two joined
        ["+exp=toy", "hydra.run.dir=/proc/launcher-test"], "cannot be created: FileNotFoundError: [Errno 2] No such "
        "file or directory: '/proc/launcher-test'; give a path"),
    "unreadable run dir": (lambda tmp: ["+exp=toy", f"hydra.run.dir={make_run_dir_with_corrupt_config(tmp)}"],
                           "config.yaml cannot be read"),
}


# Run as `python -m launcher` (5-9 s each), for what only the CLI does: Hydra's own compose errors, which
# launcher/launch/errors.py condenses from Hydra's report once Hydra exits (in this process compose_config raises
# Hydra's exception instead); and a ConfigError's exit 2, `error: ` line and no half-made run dir, once for each
# kind of stage of cli.launch: the plan, the job's inputs, the Slurm branch, a run dir that already holds a run.
THROUGH_THE_CLI = {"unknown key", "unknown key of an untyped group", "unknown group option", "unknown exp",
                   "unknown logger", "wrong type", "unknown device", "run dir cannot be made", "indivisible batch",
                   "run dir under a dir that cannot have one",
                   "missing data path", "slurm after a run never submitted", "unreadable run dir",
                   "unknown option", "a float for an integer",
                   "a torchrun flag", "an experiment as the primary config", "a run dir mistyped, no org/name id"}
assert THROUGH_THE_CLI <= CASES.keys()  # a misspelt name would quietly drop its CLI run


def case(name: str, tmp_path: Path) -> tuple[list[str], Path, str]:
    """A case's overrides, with hydra.run.dir=<tmp_path/run> unless it names one; its run dir; its line's text."""
    overrides, expected = CASES[name]
    if callable(overrides):
        overrides = overrides(tmp_path)
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    run_dir = Path(given[0]) if given else tmp_path / "run"
    return [*overrides, *([] if given else [f"hydra.run.dir={run_dir}"])], run_dir, expected


def parent_refusal(overrides: list[str], run_dir: Path) -> str:
    """cli.launch's checks, in its order, in this process: what it would print after `error: `."""
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as error:
        # (shared_run_dir, for several local nodes, asks only for a hydra.run.dir, which every case has)
        _, config, resume_step = checked_config(cfg, run_dir)
        assert finished(run_dir, config, resume_step) is None and active_job(run_dir) is None  # (no refusal: exit 0)
        check_inputs(config, run_dir)
    return str(error.value)


@pytest.mark.parametrize("name", [name for name in CASES if name in THROUGH_THE_CLI])
def test_bad_input_is_one_line_naming_the_key(name: str, tmp_path: Path) -> None:
    overrides, _, expected = case(name, tmp_path)
    out = run_cli(*overrides, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-1000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "run").exists()  # nothing half-made is left behind


@pytest.mark.parametrize("name", [name for name in CASES if name not in THROUGH_THE_CLI])
def test_the_parents_checks_refuse_in_one_line_naming_the_key(name: str, tmp_path: Path) -> None:
    overrides, run_dir, expected = case(name, tmp_path)
    message = parent_refusal(overrides, run_dir)
    assert "\n" not in message and expected in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: launcher.device=cuda is valid here")
def test_cuda_plan_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    overrides = ["+exp=toy", "launcher.device=cuda", f"hydra.run.dir={tmp_path / 'run'}"]
    assert parent_refusal(overrides, tmp_path / "run") == (
        "launcher.device=cuda but this node has no visible GPU (NVML, or torch.cuda.device_count(), says 0); "
        "use launcher.device=auto or launcher.device=cpu")
