"""`python -m launcher` end to end in real subprocesses (issue 2 test 5, PITFALLS #8 #9 #22)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import REPO, committed, on_the_cpu_plan, read_metrics, run_cli, subprocess_env
from launcher.derived import config_hash

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.max_steps=20", "train.log_every=1", "train.global_batch_size=16")


def only_run_dir(cwd: Path) -> Path:
    (run_dir,) = (cwd / "runs" / "toy").iterdir()
    return run_dir


def test_toy_two_ranks_writes_a_complete_run_dir(tmp_path: Path) -> None:
    out = run_cli(*TOY, "launcher.nproc_per_node=2", "train.micro_batch_size=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = only_run_dir(tmp_path)  # one run dir for all ranks (hydra#2070)
    assert f"run dir {run_dir}" in out.stdout
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text  # resolved once, in the parent
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    assert config["plan"] == {"nnodes": 1, "nproc_per_node": 2, "world_size": 2, "grad_accum_steps": 2,
                              "device_type": "cpu", "min_nnodes": None, "auto": {"precision": "fp32", "compile": False}}
    assert config["precision"]["name"] == "fp32" and config["train"]["compile"] is False  # as auto chose
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 21))
    for m in steps:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "samples_per_sec", "skipped_steps", "time"} <= m.keys()
    losses = [m["loss"] for m in steps]  # one step's loss depends on its batch: compare five with five
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["world_size"] == 2 and summary["grad_accum_steps"] == 2
    assert summary["config_hash"] == config_hash(config)  # the hash every rank agreed on at start
    weights = load_file(run_dir / "checkpoints" / "20" / "model.safetensors")
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert (run_dir / "checkpoints" / "20" / "COMPLETE").exists()
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["plan"]["world_size"] == 2 and "launcher.nproc_per_node=2" in launch["overrides"]


def test_fp16_and_bf16_runs_log_their_precision(tmp_path: Path) -> None:
    for precision in ("fp16", "bf16"):
        run_dir = tmp_path / precision
        out = run_cli(*TOY, f"precision={precision}", "launcher.nproc_per_node=1", "train.micro_batch_size=4",
                      f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-4000:]
        steps = [m for m in read_metrics(run_dir) if "loss" in m]
        assert ("loss_scale" in steps[-1]) == (precision == "fp16")
        assert json.loads((run_dir / "summary.json").read_text())["precision"] == precision


def test_weights_in_bf16_train_on_the_toy_s_fp32_data(tmp_path: Path) -> None:
    """model.dtype=bfloat16 keeps the weights (and the checkpoint) in bf16; the toy's fp32 inputs follow them."""
    out = run_cli(*TOY, "model.dtype=bfloat16", "launcher.nproc_per_node=1", "train.micro_batch_size=4",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = only_run_dir(tmp_path)
    weights = load_file(run_dir / "checkpoints" / "20" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert sum(losses[-5:]) < sum(losses[:5]), losses


# Hydra's ${now:} in both launches reads one instant, as if they had started in the same microsecond
FROZEN_CLOCK = """import datetime, hydra.core.utils
class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5, 678901)
hydra.core.utils.datetime = Frozen
"""


def test_two_launches_at_once_get_two_run_dirs(tmp_path: Path) -> None:
    """PITFALLS #9: hydra#2925 (same-second dirs), here at one frozen instant, and a fixed rendezvous port
    (EADDRINUSE) cannot bite. Two commands that differ (by a seed): the same command again while its run trains
    continues that run's dir, and is refused while it holds the lock (tests/test_run_lock.py)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(FROZEN_CLOCK)
    env = subprocess_env(PYTHONPATH=f"{shim}:{REPO}")
    cmds = [[sys.executable, "-m", "launcher", *on_the_cpu_plan([*TOY, "launcher.nproc_per_node=2",
                                                                  "train.micro_batch_size=4", f"train.seed={seed}"])]
            for seed in (0, 1)]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in cmds]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
    run_dirs = list((tmp_path / "runs" / "toy").iterdir())
    assert len(run_dirs) == 2
    assert all(d.name.startswith("2026-01-02_03-04-05-678901_") for d in run_dirs)  # the clock was frozen
    assert all((d / "summary.json").exists() for d in run_dirs)


def test_indivisible_batch_fails_in_the_parent_with_one_line(tmp_path: Path) -> None:
    out = run_cli("+exp=toy", "train.global_batch_size=30", "launcher.nproc_per_node=2", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "train.global_batch_size=30" in lines[0] and "train.micro_batch_size=8" in lines[0]
    assert not (tmp_path / "runs").exists()  # nor the runs/toy/ that Hydra made for it
    (tmp_path / "runs" / "toy" / "earlier").mkdir(parents=True)  # what was there before the launch stays
    assert run_cli("+exp=toy", "train.global_batch_size=30", "launcher.nproc_per_node=2", cwd=tmp_path).returncode == 2
    assert [p.name for p in (tmp_path / "runs" / "toy").iterdir()] == ["earlier"]
    # a run dir of Hydra's own values (read once Hydra has set them: no warning of the dirs' callback), `..` in it
    out = run_cli("+exp=toy", "train.global_batch_size=30", "launcher.nproc_per_node=2",
                  "hydra.run.dir=named/../hydra_named/${hydra:job.name}/1", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "hydra_named").exists()


def test_typo_fails_at_compose_time_naming_the_key(tmp_path: Path) -> None:
    out = run_cli("+exp=toy", "train.micro_batchsize=4", cwd=tmp_path)
    assert out.returncode != 0 and "micro_batchsize" in out.stderr
    out = run_cli("+exp=toy", "train.max_steps=abc", cwd=tmp_path)  # what the key takes, in its unit, and its value
    assert (out.returncode, out.stderr.strip()) == (2, "error: train.max_steps=abc is not a whole number: "
                                                       "train.max_steps takes a whole number, e.g. train.max_steps=200")
    out = run_cli("+exp=toy", "launcher=slurm", "launcher.timeout_min=1:00:00", cwd=tmp_path)
    assert out.stderr.strip() == ("error: launcher.timeout_min=1:00:00 is not a whole number: launcher.timeout_min "
                                  "takes a whole number of minutes, e.g. launcher.timeout_min=60")
    assert not (tmp_path / "runs").exists()
    # in a sweep, Hydra makes the sweep dir and its multirun.yaml before the first point's override fails: removed
    out = run_cli("-m", "+exp=toy", "train.lr=1e-3,1e-2", cwd=tmp_path)
    assert out.returncode != 0 and "did you mean optimizer.lr?" in out.stderr
    assert not (tmp_path / "multirun").exists()
    # a value only the launcher's checks refuse, in the last point: point 0 trained to its end before it was found
    out = run_cli("-m", "+exp=toy", "train.global_batch_size=32,30", cwd=tmp_path)
    assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (2, [
        "error: sweep point #1 (train.global_batch_size=30): train.global_batch_size=30 "
        "is not divisible by train.micro_batch_size=8 x world size 2 (= 16); set train.global_batch_size to a multiple "
        "of 16 or change train.micro_batch_size; no point of the sweep ran (fix that value, or leave it out of the "
        "sweep)"]), out.stderr[-2000:]
    assert "worker(s)" not in out.stdout and not (tmp_path / "multirun").exists()
    # Hydra's launcher said "Launching 2 jobs locally" and "#0 : ..." of a point that never started
    assert [line.split("[HYDRA] ")[-1] for line in out.stdout.splitlines()] == [
        "Checking 2 sweep points, then running them here one after the other"], out.stdout


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    """With an override after it too (argparse alone takes none past an option's value)."""
    out = run_cli("+exp=toy", "--cfg", "job", "train.max_steps=5", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = OmegaConf.create(out.stdout)
    assert (job.train.global_batch_size, job.train.max_steps) == (32, 5)


def test_launch_record_has_what_a_bug_report_needs_and_no_secret(tmp_path: Path) -> None:
    """launch.json: packages, the code's git state (a changed tree is marked dirty, its diff in git.diff),
    torch/CUDA versions, the NCCL_/TORCH_ variables; a token, a password, credentials in a URL are not in it."""
    code = tmp_path / "code"
    for part in ("launcher", "jobs", "conf"):
        shutil.copytree(REPO / part, code / part, ignore=shutil.ignore_patterns("__pycache__"))
    revision = committed(code)
    with open(code / "jobs" / "toy.py", "a") as f:
        f.write("# a local change\n")
    secrets = {"TORCH_HF_TOKEN": "hf_abc123", "NCCL_IB_PASSWORD": "pw-456", "SLURM_JWT": "jwt-000",
               "TORCH_STORE_URL": "https://alice:s3cr3t-789@example.org/store",
               "TORCH_CKPT_URL": "https://s3.example.org/b/x?X-Amz-Signature=sig-999&part=1"}
    env = subprocess_env(PYTHONPATH=str(code), NCCL_DEBUG="INFO", **secrets)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "launcher", "+exp=toy", "launcher.device=cpu", "launcher.dry_run=true",
                          "+launcher.additional_parameters.api_key=key-888", f"hydra.run.dir={run_dir}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    text = (run_dir / "launch.json").read_text()
    launch = json.loads(text)
    assert {"torch", "hydra-core", "omegaconf"} <= set(launch["packages"]) and launch["torch"].startswith("2.")
    assert launch["git"] == {"revision": revision, "dirty": True, "diff": "git.diff"}
    assert "+# a local change" in (run_dir / "git.diff").read_text()
    assert launch["job_git"] == {}  # the job's modules (jobs.toy) are the launcher's checkout's
    assert launch["env"]["NCCL_DEBUG"] == "INFO" and launch["env"]["TORCH_HF_TOKEN"] == "<redacted>"
    assert launch["env"]["TORCH_STORE_URL"] == "https://<redacted>@example.org/store"
    assert launch["env"]["TORCH_CKPT_URL"] == "https://s3.example.org/b/x?X-Amz-Signature=<redacted>&part=1"
    assert "+launcher.additional_parameters.api_key=<redacted>" in launch["overrides"]
    for value in ("hf_abc123", "pw-456", "jwt-000", "s3cr3t-789", "sig-999", "key-888"):
        assert value not in text


def test_a_slurm_sweep_over_the_micro_batch_is_one_job_array(tmp_path: Path) -> None:
    """Points that differ only in accumulation share the job's shape: one array (dry run, no cluster needed),
    each point with its own accumulation; auto leaves it to the workers. The -m typed among the overrides (argparse
    alone would take none after it)."""
    out = run_cli("+exp=toy", "launcher=slurm", "-m", "launcher.dry_run=true", "train.micro_batch_size=4,8,auto",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run: would submit a job array of 3" in out.stdout, out.stdout[-2000:]
    # Hydra's own first line ("Launching 3 jobs locally") says what the launch does
    assert "] Checking 3 sweep points, then showing what would be submitted (dry run) as one Slurm job array\n" in \
        out.stdout and "locally" not in out.stdout, out.stdout[-2000:]
    said = [line.split("[HYDRA] ")[-1].split(" : ")[0] for line in out.stdout.splitlines() if "[HYDRA] " in line]
    assert said[1:] == ["\t#0", "\t#1", "\t#2"], out.stdout[-2000:]  # point 0's, held back until every point passed
    assert [OmegaConf.load(tmp_path / "sweep" / str(i) / "config.yaml").plan.grad_accum_steps
            for i in range(3)] == [4, 2, None]


def test_a_slurm_job_of_two_8_gpu_nodes_is_one_task_per_node_and_a_world_of_16(tmp_path: Path) -> None:
    """PITFALLS #20 (Hydra + submitit + DDP used 1 GPU, or spawned again inside srun): the submission rendered
    for launcher.nodes=2 launcher.gpus_per_node=8 asks for one task per node holding 8 GPUs, whose torchrun
    starts 8 workers: world size 16 on CUDA (a dry run: no cluster and no GPU needed)."""
    out = run_cli("+exp=toy", "launcher=slurm", "launcher.device=auto", "launcher.nodes=2", "launcher.gpus_per_node=8",
                  "launcher.dry_run=true",
                  "train.global_batch_size=256", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    params = json.loads(out.stdout.split("executor parameters: ", 1)[1].splitlines()[0])
    assert (params["nodes"], params["ntasks_per_node"], params["gpus_per_node"]) == (2, 1, 8)
    plan = OmegaConf.load(tmp_path / "run" / "config.yaml").plan
    assert (plan.world_size, plan.nproc_per_node, plan.device_type, plan.grad_accum_steps) == (16, 8, "cuda", 2)
    torchrun = [line for line in out.stdout.splitlines() if "python -m torch.distributed.run" in line]
    assert len(torchrun) == 1 and "--nnodes=2 --nproc-per-node=8" in torchrun[0] and "srun" not in torchrun[0]
    assert ",is_host=<1 on the first node, else 0> " in torchrun[0]  # the first node's task serves the rendezvous
    # each node's agent gives the workers an address for rank 0's store, not torch's getfqdn() (tests/test_many_nodes.py)
    assert " --local-addr=<the node's address toward the first node> " in torchrun[0]
    # srun asks for the task's CPUs again: Slurm 22.05-23.02's steps do not inherit sbatch's (tests/test_slurm.py)
    assert params["srun_args"] == [f"--cpus-per-task={params['cpus_per_task']}"] == ["--cpus-per-task=8"]


def test_a_slurm_sweep_launched_again_queues_only_its_unfinished_points(tmp_path: Path) -> None:
    """A sweep's command again (after some points finished, others failed or never ran): the finished points
    start nothing, the rest become the job array (dry run, no cluster needed). Point 0 finished on this host."""
    sweep, four = tmp_path / "sweep", ("+exp=toy", "train.max_steps=4")
    assert run_cli(*four, "train.seed=0", f"hydra.run.dir={sweep / '0'}", cwd=tmp_path).returncode == 0
    config = (sweep / "0" / "config.yaml").read_bytes()
    out = run_cli("-m", *four, "launcher=slurm", "launcher.dry_run=true", "train.seed=0,1",
                  f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"run dir {sweep / '0'} already finished: 4 steps" in out.stdout, out.stdout[-2000:]
    # one point left: still the sweep's job, with its logs in the sweep's slurm/ folder
    assert f"dry run: would submit one job with submitit.SlurmExecutor(folder={sweep / 'slurm'})" in out.stdout
    assert f"run dir {sweep / '1'}: " in out.stdout
    assert f"run dir {sweep / '0'}: " not in out.stdout and (sweep / "0" / "config.yaml").read_bytes() == config


def test_slurm_dependency_and_after_reach_sbatch(tmp_path: Path) -> None:
    """launcher.after=<run dir> reads that run's job id; with launcher.dependency both go to sbatch, and a job
    whose dependency can never be met is cancelled instead of pending forever (dry run: no cluster needed)."""
    first = tmp_path / "first"
    first.mkdir()
    (first / "slurm.json").write_text(json.dumps({"job_id": "4242_1", "log_dir": str(first / "slurm")}))
    no_accounting = tmp_path / "bin"  # a cluster without sacct: job 17 is left to Slurm (test_slurm_hints.py asks)
    no_accounting.mkdir()
    (no_accounting / "sacct").write_text("#!/bin/sh\nexit 1\n")
    (no_accounting / "sacct").chmod(0o755)
    out = run_cli("+exp=toy", "launcher=slurm", "launcher.dry_run=true", f"launcher.after={first}",
                  "launcher.dependency=afterany:17", f"hydra.run.dir={tmp_path / 'second'}", cwd=tmp_path,
                  PATH=f"{no_accounting}:{os.environ['PATH']}")
    assert out.returncode == 0, out.stderr[-3000:]
    params = json.loads(out.stdout.split("executor parameters: ", 1)[1].splitlines()[0])
    assert params["additional_parameters"] == {"dependency": "afterany:17,afterok:4242_1", "kill_on_invalid_dep": "yes",
                                               "requeue": True}  # see test_slurm.py: the test cluster has JobRequeue=0


def test_no_experiment_more_workers_than_cores_or_a_warmup_past_the_end_is_said(tmp_path: Path) -> None:
    """`python -m launcher` alone trained conf/config.yaml's toy MLP without a word, and 64 CPU workers on 2 cores
    were taken as asked, and a warmup longer than the run never reached optimizer.lr, in silence (dry runs: the
    checks and notes of a launch, no worker)."""
    out = run_cli("launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'bare'}", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr.strip() == ("note: no +exp=<name>: training the defaults (model=mlp, "
                                                          "data=toy); the experiments are bench, bert, bert_mlm, toy")
    many = len(os.sched_getaffinity(0)) + 1
    out = run_cli("+exp=toy", f"launcher.nproc_per_node={many}", f"train.global_batch_size={8 * many}",
                  "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'many'}", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr.strip() == (
        f"warning: {many} CPU workers on {many - 1} cores take turns on them; launcher.nproc_per_node={many - 1} or "
        f"fewer trains the same steps faster"), out.stderr
    out = run_cli("+exp=toy", "scheduler.warmup_steps=40", "train.max_steps=10", "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'warm'}", cwd=tmp_path)  # (a warmup as long as the run reaches the lr)
    assert out.returncode == 0 and out.stderr.strip() == (
        "warning: scheduler.warmup_steps=40 > train.max_steps=10: the learning rate warms up for the whole run and "
        "reaches 0.25 of optimizer.lr at its end"), out.stderr
    out = run_cli("+exp=toy", "scheduler.warmup_steps=10", "train.max_steps=10", "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'reached'}", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
