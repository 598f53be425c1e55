"""Fast by default (issue 37): precision=auto and train.compile=auto chosen for the hardware in the parent, a
machine that cannot compile training eagerly under auto, and compiled kernels that a restart loads from the run
dir instead of compiling them again. Real launches of the toy job on 2 gloo ranks; the rules as unit tests."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import compose_config, on_the_cpu_plan, run_cli, subprocess_env, write_run_config
from helpers import logged_step, wait_until
from launcher.derived import auto_precision
from launcher.launch.gpus import Gpu, in_cuda_order, visible_gpus, visible_indices
from launcher.launch.plan import make_plan, resolve
from launcher.preempt import REQUEUE_EXIT_CODE
from launcher.rundir import complete_steps
COMPILED_TOY = ("+exp=toy", "train.compile=true", "train.max_steps=60", "train.log_every=10", "train.ckpt_every=10")


@pytest.mark.parametrize(("capabilities", "chosen"), [
    ([(6, 0)], "fp16"), ([(7, 0)], "fp16"), ([(7, 5)], "fp16"),  # P100, V100, T4: no bf16 tensor cores
    ([(8, 0)], "bf16"), ([(8, 6)], "bf16"), ([(8, 9)], "bf16"), ([(9, 0)], "bf16"), ([(10, 0)], "bf16"),
    ([(9, 0), (7, 5)], "fp16"),  # every rank must run the same precision: the oldest GPU decides
])
def test_precision_auto_picks_bf16_from_ampere_on_and_fp16_before(capabilities: list, chosen: str) -> None:
    assert auto_precision("cuda", capabilities) == chosen


def test_the_defaults_resolve_to_fp32_eager_on_the_cpu_and_say_so_in_the_config() -> None:
    cfg = compose_config("+exp=toy")
    plan = make_plan(cfg)
    assert plan.auto == {"precision": "fp32", "compile": False}
    config = resolve(cfg, plan)
    assert config["precision"]["name"] == "fp32" and config["train"]["compile"] is False
    explicit = compose_config("+exp=toy", "precision=bf16", "train.compile=true")
    config = resolve(explicit, make_plan(explicit))  # given, kept; one node: one graph
    assert (config["precision"]["name"], config["train"]["compile"], config["train"]["compile_ddp_split"]) == \
        ("bf16", True, False)


def test_slurm_compiles_on_gpus_as_one_graph_per_node_and_leaves_precision_to_the_nodes() -> None:
    for nodes, split in ((1, False), (2, True)):
        cfg = compose_config("+exp=toy", "launcher=slurm", "launcher.device=auto", "launcher.gpus_per_node=2",
                             f"launcher.nodes={nodes}")
        config = resolve(cfg, make_plan(cfg))
        assert config["precision"]["name"] == "auto"  # the submit host cannot see the cluster's GPUs
        assert config["train"]["compile"] is True and config["train"]["compile_ddp_split"] is split
    cfg = compose_config("+exp=toy", "launcher=slurm", "launcher.gpus_per_node=0")
    assert make_plan(cfg).auto == {"precision": "fp32", "compile": False}


def test_compile_keys_without_compiling_name_what_auto_chose() -> None:
    out = run_cli("+exp=toy", "train.compile_mode=default", "launcher.dry_run=true", cwd=Path.cwd())
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: train.compile_mode=default has no effect: train.compile=auto compiles only "
                                  "on GPUs; add train.compile=true or drop train.compile_mode")


def test_visible_devices_read_as_cuda_reads_them_and_no_nvml_falls_back_to_torch() -> None:
    uuids = ["GPU-aaa1", "GPU-bbb2", "GPU-ccc3"]
    assert visible_indices(None, 3, uuids) == [0, 1, 2]
    assert visible_indices("2,0", 3, uuids) == [2, 0]
    assert visible_indices("1,7,0", 3, uuids) == [1]  # CUDA stops at the first entry that names no GPU
    assert visible_indices("GPU-bbb,GPU-aaa1", 3, uuids) == [1, 0]  # a unique prefix names a GPU
    assert visible_indices("", 3, uuids) == [] and visible_indices("-1", 3, uuids) == []
    assert visible_indices("MIG-1234", 3, uuids) is None  # NVML cannot say: torch answers
    assert visible_indices("0,0", 3, uuids) == [] and visible_indices("1,0,1", 3, uuids) == []  # named twice: none
    assert visible_indices("1gpu,+2", 3, uuids) == [1, 2] and visible_indices("--1", 3, uuids) == []  # strtoul's way
    h100, t4 = Gpu("NVIDIA H100", (9, 0)), Gpu("Tesla T4", (7, 5))
    assert in_cuda_order([h100, h100, h100], uuids, {"CUDA_VISIBLE_DEVICES": "2"}) == [h100]
    # mixed GPUs: CUDA's default order puts the fastest first, NVML's is the PCI bus's; only PCI_BUS_ID makes them one
    assert in_cuda_order([t4, h100, t4], uuids, {}) is None
    assert in_cuda_order([t4, h100, t4], uuids, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,0"}) == [
        h100, t4]
    import torch

    if not torch.cuda.is_available():  # this machine has no NVML: torch's answer, no GPU
        assert visible_gpus() == []


def test_a_cuda_worker_that_sees_no_gpu_says_what_cuda_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's NVML counted GPUs that the worker's torch cannot use (a driver older than its CUDA; here a torch
    built without CUDA, which torch.cuda.device_count() gives 0 for): the error names CUDA's reason, not only
    CUDA_VISIBLE_DEVICES. Raised before any process group starts."""
    import torch

    from launcher.train import dist

    if torch.cuda.is_available():
        pytest.skip("this machine's torch sees a GPU")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError) as raised:
        dist.init("cuda", "auto", 10)
    said, _, why = str(raised.value).partition("; torch.cuda says: ")
    assert said == "local rank 0 has no GPU: this process sees 0 (CUDA_VISIBLE_DEVICES=unset)" and why, raised.value
    if not torch.backends.cuda.is_built():  # this project's CPU wheel; a CUDA build without a driver says so instead
        assert why == "Torch not compiled with CUDA enabled"


def auto_compiling_on_the_cpu(run_dir: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """What the parent writes for a GPU plan (train.compile=auto chose to compile), its 2 workers run on the CPU."""
    config = write_run_config(run_dir, "+exp=toy", "train.max_steps=20", *overrides)
    text = config.read_text()
    assert text.count("compile: false") == 2  # train.compile and plan.auto.compile
    config.write_text(text.replace("compile: false", "compile: true"))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "launcher.train.worker", str(config)], env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_machine_that_cannot_compile_trains_eagerly_under_auto_with_one_line(tmp_path: Path) -> None:
    """With no C++ compiler for inductor: every rank finds it before building the model and trains eagerly."""
    run_dir = tmp_path / "run"
    out = auto_compiling_on_the_cpu(run_dir, CXX=str(tmp_path / "no-compiler"),
                                    TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("train.compile=auto")]
    assert len(said) == 1, said
    assert said[0].startswith("train.compile=auto: training eagerly, as rank 0 cannot compile ("), said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compiled"] is False and summary["steps"] == 20


@pytest.mark.slow
def test_a_model_that_cannot_compile_trains_eagerly_under_auto_with_one_line(tmp_path: Path) -> None:
    """A forward with an op dynamo cannot trace (a custom op without a fake implementation): under auto that code
    trains eagerly (torch's suppress_errors), and where dynamo logs a traceback of about 190 lines on every rank, the
    run says one line. (train.compile=true: a one-line error, tests/test_compile.py.)"""
    run_dir = tmp_path / "run"
    out = auto_compiling_on_the_cpu(run_dir, "model.untraceable=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WON'T CONVERT" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    said = [line for line in (out.stdout + out.stderr).splitlines() if "train.compile=auto" in line]
    assert len(said) == 1, said
    assert re.search(r"step \d+: warning: train\.compile=auto: torch\.compile failed on rank \d in forward at "
                     r"\S+jobs/toy\.py:\d+: There was no fake impl registered for "
                     r"<CustomOpDef\(jobs_toy::untraceable\)>.*; that code trains eagerly; "
                     r"train\.compile=false says so at once", said[0]), said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["compiled_graphs"] == 0, summary


def start(run_dir: Path, *overrides: str, **env: str) -> subprocess.Popen:
    """The compiled toy; with no TORCHINDUCTOR_CACHE_DIR given, none is set (the suite's shared one is not)."""
    args = on_the_cpu_plan([*COMPILED_TOY, *overrides, f"hydra.run.dir={run_dir}"])
    environment = subprocess_env(**env)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        del environment["TORCHINDUCTOR_CACHE_DIR"]
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=run_dir.parent, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def seconds_to_log(run_dir: Path, step: int, began: float) -> float:
    """Seconds from the command's start until `step` is in metrics.jsonl: start-up (imports, build, compile or the
    cache's load) and ten toy steps of milliseconds each, the same measure for both starts."""
    wait_until(lambda: logged_step(run_dir) >= step, timeout=240)
    return time.time() - began


def stopped_after_a_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    """Ctrl-C once step 20 is logged: the run saves a checkpoint and exits with the requeue code."""
    wait_until(lambda: logged_step(run_dir) >= 20, timeout=240)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-2000:] + err[-3000:]


def stopped_before_its_first_log(proc: subprocess.Popen, run_dir: Path) -> None:
    """Ctrl-C once step 10's checkpoint is complete (the first log is step 50's, the steps 0.1 s each: data.sleep_s),
    not in the first step's compile, which a SIGINT would end (2 cores: g++ runs in the workers' process group)."""
    wait_until(lambda: 10 in complete_steps(run_dir), timeout=240)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == REQUEUE_EXIT_CODE and complete_steps(run_dir), out[-2000:] + err[-3000:]
    assert logged_step(run_dir) == 0, out[-2000:]


@pytest.mark.slow
def test_a_compiled_restart_on_an_empty_machine_cache_loads_its_kernels_from_the_run_dir(tmp_path: Path) -> None:
    """A new node's machine cache is empty (a fresh TMPDIR: inductor's default cache and its precompiled header
    live there). The first start compiles, the restart finds every graph in <run_dir>/compile_cache/ and reaches its
    first step in at most 0.6x the first start's time; it trains on as an uninterrupted run does."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "tmp1").mkdir()
    began = time.time()
    first = start(run_dir, TMPDIR=str(tmp_path / "tmp1"))
    cold = seconds_to_log(run_dir, 10, began)
    stopped_after_a_checkpoint(first, run_dir)
    resumed = complete_steps(run_dir)[-1]  # the stop's checkpoint: a few steps after step 20's log
    (tmp_path / "tmp2").mkdir()
    began = time.time()
    second = start(run_dir, TMPDIR=str(tmp_path / "tmp2"))
    warm = seconds_to_log(run_dir, (resumed // 10 + 1) * 10, began)  # its first log
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, out[-2000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == resumed and summary["compile_cache"] == "run dir", summary
    assert summary["compile_cache_hits"] >= 2 and summary["compiled_graphs"] == 1, summary
    print(f"first log: cold start {cold:.1f} s, restart {warm:.1f} s")  # pytest -s shows it
    from torch._functorch import config as aot_config

    # torch 2.6 (the floor run) keeps inductor's graphs but has AOT autograd's cache off: a restart traces the joint
    # graph again (2.6 under load: 93 s against 143 s); where that cache is on (2.13 here) a restart compiles nothing
    if aot_config.enable_autograd_cache:
        assert warm <= 0.6 * cold, (warm, cold)  # both count the start-up too: 0.51 seen under the suite's load
    assert not (tmp_path / "tmp2" / "torchinductor_root" / "fxgraph").exists()  # nothing went to the machine cache


@pytest.mark.slow
def test_a_user_s_own_inductor_cache_is_used_and_the_run_dir_keeps_torch_s_artifacts(tmp_path: Path) -> None:
    """With TORCHINDUCTOR_CACHE_DIR set, the workers compile into it, and the run dir keeps each local rank's
    portable artifacts (torch.compiler.save_cache_artifacts), also at a stop before the first log; the next start
    loads them into an empty cache of the user's: hits. A damaged file is moved aside with one line, the run trains."""
    from launcher.compat import COMPILE_CACHE_ARTIFACTS

    if not COMPILE_CACHE_ARTIFACTS:
        pytest.skip("this torch has no torch.compiler.save_cache_artifacts (torch 2.7 on)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = start(run_dir, "data.sleep_s=0.05", "train.log_every=50", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache1"))
    stopped_before_its_first_log(first, run_dir)  # (the artifacts were written at log steps only)
    kept = sorted(p.name for p in (run_dir / "compile_cache").glob("torch-*/local*.bin"))
    assert kept == ["local0.bin", "local1.bin"] and (tmp_path / "cache1" / "fxgraph").is_dir()
    damaged = run_dir / "compile_cache" / next((run_dir / "compile_cache").iterdir()).name / "local1.bin"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # rank 1's, cut short: rank 0's still loads
    second = start(run_dir, "data.sleep_s=0.05", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache2"))
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, out[-2000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compile_cache"] == "artifacts" and summary["compile_cache_hits"] >= 2, summary
    said = [line for line in err.splitlines() if "did not load" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: the compile cache {damaged} did not load (damaged)"), err
    assert damaged.with_name("local1.bin.unusable").is_file() and damaged.is_file()  # and a new one, from this start


@pytest.mark.slow
def test_a_compile_cache_that_cannot_be_written_is_said_in_one_line_and_training_goes_on(tmp_path: Path) -> None:
    """Rank 1's artifacts file cannot be written (a directory at its path; as a full disk): it says so once, keeps
    nothing more, and the run trains on; rank 0 keeps its own. (It once ended the run at the first log.)"""
    from launcher.compat import COMPILE_CACHE_ARTIFACTS
    from launcher.train.compile_cache import cache_root

    if not COMPILE_CACHE_ARTIFACTS:
        pytest.skip("this torch has no torch.compiler.save_cache_artifacts (torch 2.7 on)")
    run_dir = tmp_path / "run"
    blocked = cache_root(run_dir) / "local1.bin"
    blocked.mkdir(parents=True)
    proc = start(run_dir, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    said = [line for line in err.splitlines() if "could not be written" in line]
    assert len(said) == 1 and f"warning: the compile cache {blocked} could not be written (IsADirectoryError" in \
        said[0] and said[0].endswith("training goes on, and this rank's next start compiles anew"), err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 60
    assert [p.name for p in sorted(blocked.parent.iterdir()) if p.is_file()] == ["local0.bin"]  # and no temp file


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_sees_the_gpus_torch_sees_without_a_cuda_context() -> None:
    """The parent's reading (launcher/launch/gpus.py) against torch.cuda's, in a process of its own: NVML's names
    and compute capabilities, in CUDA's numbering, and no CUDA context made for them."""
    probe = ("import torch\nfrom launcher.launch.gpus import visible_gpus, driver_version\n"
             "gpus = visible_gpus()\nassert not torch.cuda.is_initialized()\n"
             "assert driver_version()\n"
             "assert [(g.name, g.capability) for g in gpus] == [(torch.cuda.get_device_name(i), "
             "torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())], gpus\n")
    for visible in (None, "0"):
        env = subprocess_env() if visible is None else subprocess_env(CUDA_VISIBLE_DEVICES=visible)
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]


def test_a_log_interval_s_rates_leave_out_the_host_work_of_logging_the_one_before() -> None:
    """The loop reads the interval, then logs inside meter.left_out() (trackers, the compile counters, first-time
    imports): the next interval's samples/s are those of its own steps. One rank on the CPU: no collective."""
    import torch

    from launcher.train.meter import Meter

    meter = Meter(torch.device("cpu"), 1.0, None, rank=0, world_size=1)
    time.sleep(0.2)  # a step of 0.2 s
    meter.add(8, torch.tensor(1.0), None, 0.0)
    first = meter.read()["samples_per_sec"]
    with meter.left_out():  # what the loop does after the read: log
        time.sleep(0.6)
    time.sleep(0.2)
    meter.add(8, torch.tensor(1.0), None, 0.0)
    second = meter.read()["samples_per_sec"]
    assert 8 / 0.3 < first <= 8 / 0.2 and 8 / 0.3 < second <= 8 / 0.2, (first, second)  # not 8 / 0.8
