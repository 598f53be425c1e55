"""Every config in conf/ composes, and every exp composes and builds on CPU (issue 2 test 6)."""
from __future__ import annotations


import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF, compose_config
from launcher.derived import ConfigError
from launcher.launch import plan as plan_module
from launcher.launch.gpus import Gpu
from launcher.launch.known_keys import check_known_keys
from launcher.launch.plan import make_plan, resolve

GROUPS = ["model", "optimizer", "scheduler", "precision", "data", "launcher", "strategy", "logger"]
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]
EXPS = sorted(path.stem for path in (CONF / "exp").glob("*.yaml"))


JOB_GROUPS = {"model", "data"}  # options that belong to a job: they pair with that job's exp
REQUIRED = {("data", "files"): ("data.path=train.csv",)}  # `???` keys a user must set


def resolves(*overrides: str) -> bool:
    try:
        cfg = compose_config(*overrides)
        check_known_keys(cfg)  # every key of every option is one its schema or target takes, as the parent checks
        resolve(cfg, make_plan(cfg))
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes(group: str, option: str) -> None:
    """Generic options (optimizer, precision, ...) compose with every exp; job options with their job's."""
    extra = REQUIRED.get((group, option), ())
    results = [resolves(f"+exp={exp}", f"{group}={option}", *extra) for exp in EXPS]
    assert any(results) if group in JOB_GROUPS else all(results), dict(zip(EXPS, results))


@pytest.mark.parametrize("exp", EXPS)
def test_every_exp_composes_and_builds_on_cpu(exp: str) -> None:
    cfg = compose_config(f"+exp={exp}")
    config = resolve(cfg, make_plan(cfg))
    assert "${" not in str(config)
    task = instantiate(cfg.data)
    model = instantiate(cfg.model)
    instantiate(cfg.optimizer, params=model.parameters())
    batch = task.collate([task.train_set[i] for i in range(2)])
    loss = task.loss_sum(model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert int(task.count_items(batch)) > 0


def test_exp_group_is_not_in_the_defaults() -> None:
    """`exp` is only ever appended with +exp=, so the base config must not name it."""
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    assert all("exp" not in (d if isinstance(d, str) else d.keys()) for d in defaults)
    assert "exp" not in compose_config()  # without +exp=, nothing of conf/exp/ is composed
    assert compose_config("+exp=toy").name == "toy"


def test_bf16_is_refused_where_a_gpu_is_older_than_ampere_and_auto_picks_for_the_oldest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent reads each GPU's compute capability through NVML (launcher/launch/gpus.py): torch.cuda's
    is_bf16_supported() says yes on a V100 (emulated), after putting a tensor on it. This host's GPUs are stood
    in for: two, the second a V100. precision=auto takes fp16 there, bf16 where every GPU has it."""
    gpus = [Gpu("NVIDIA H100 80GB HBM3", (9, 0)), Gpu("Tesla V100-SXM2-16GB", (7, 0))]
    monkeypatch.setattr(plan_module, "visible_gpus", lambda: list(gpus))
    bf16_on_gpus = ("+exp=toy", "launcher.device=cuda", "precision=bf16")
    with pytest.raises(ConfigError, match=r"^precision=bf16 needs an Ampere or newer GPU; use precision=fp16 here, "
                                          r"or precision=auto$"):
        make_plan(compose_config(*bf16_on_gpus))
    assert make_plan(compose_config(*bf16_on_gpus, "launcher.nproc_per_node=1")).device_type == "cuda"  # the H100 alone
    assert make_plan(compose_config("+exp=toy", "launcher.device=cuda")).auto == {
        "precision": "fp16", "compile": True, "compile_ddp_split": False}
    gpus[1] = Gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    assert make_plan(compose_config(*bf16_on_gpus)).nproc_per_node == 2
    assert make_plan(compose_config("+exp=toy", "launcher.device=cuda")).auto["precision"] == "bf16"


def test_slurm_runs_a_worker_per_gpu_unless_launcher_nproc_per_node_asks_for_fewer() -> None:
    """launcher.nproc_per_node on Slurm: null is one worker per GPU of launcher.gpus_per_node; a smaller number is
    kept (it was overridden by gpus_per_node); more than the GPUs is refused in one line."""
    on_gpus = ("+exp=toy", "launcher=slurm", "launcher.device=auto", "launcher.gpus_per_node=8", "launcher.nodes=2",
               "train.global_batch_size=128", "train.micro_batch_size=8")
    per_gpu = make_plan(compose_config(*on_gpus))
    assert (per_gpu.nproc_per_node, per_gpu.world_size) == (8, 16)
    fewer = make_plan(compose_config(*on_gpus, "launcher.nproc_per_node=4"))
    assert (fewer.nproc_per_node, fewer.world_size, fewer.device_type) == (4, 8, "cuda")
    assert make_plan(compose_config("+exp=toy", "launcher=slurm")).nproc_per_node == 2  # CPU workers
    with pytest.raises(ConfigError, match=r"^launcher.nproc_per_node=16 but launcher.gpus_per_node=8: a worker per GPU "
                                          r"at most; set launcher.nproc_per_node<=8 \(null: one per GPU\)$"):
        make_plan(compose_config(*on_gpus, "launcher.nproc_per_node=16"))


@pytest.mark.parametrize("given, sbatch", [(None, "requeue"), ("no_requeue=true", "no_requeue"),
                                           ("no-requeue=true", "no-requeue"), ("requeue=true", "requeue"),
                                           ("requeue=false", "no_requeue")])
def test_slurm_jobs_are_requeueable_unless_the_user_says_otherwise(given: str | None, sbatch: str) -> None:
    """sbatch --requeue by default (a site's JobRequeue=0 would make the job's own requeue fail: test_slurm.py
    runs on such a cluster); the user's own requeue choice in launcher.additional_parameters, either spelling, wins,
    and requeue=false becomes --no-requeue (sbatch refuses --requeue=False)."""
    from launcher.launch.slurm_submit import executor_parameters
    own = [f"+launcher.additional_parameters.{given}"] if given else []
    cfg = compose_config("+exp=toy", "launcher=slurm", *own)
    params = executor_parameters(OmegaConf.to_container(cfg.launcher), make_plan(cfg), "toy")
    assert params["additional_parameters"] == {sbatch: True}
