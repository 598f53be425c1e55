"""What only the job's own code can tell (an argument its target does not take, a task without a part the launcher
calls, a fault in its code): the workers stop before the first step, in one line, and a fault of the job's own code
keeps rank 0's traceback (the parent's refusals: tests/test_bad_input.py)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_cli
from jobs.toy import ToyRegression
from launcher.derived import ConfigError
from launcher.train.best import Best, best_eval
from launcher.train.evaluation import probe_eval
from launcher.train.loss_check import probe_loss_sum
from launcher.train.job import build_part, check_task
from launcher.train.precision import Precision


# A key the target does not take (+data.seq_lenn=16) and a target that is not there no longer get this far: the
# parent refuses them (tests/test_known_keys.py, tests/test_own_job.py)
@pytest.mark.parametrize("override, expected", [
    ("~model.hidden", "model._target_=jobs.toy.MLP failed: TypeError: MLP() missing 1 required positional argument"),
    ("data.in_features=-1", "data._target_=jobs.toy.ToyRegression failed: RuntimeError: Trying to create tensor with "
                            "negative dimension -1")], ids=["model argument", "fault in the job"])
def test_what_only_the_job_can_tell_is_one_line_from_the_workers(tmp_path: Path, override: str, expected: str) -> None:
    """Hydra's error ends in `full_key: data`, which was all of the launcher's line. Above it every rank printed
    its traceback (about 100 lines for 2 ranks), which for a config mistake says nothing more; a fault in the
    job's own code keeps it, from rank 0 only: where in the code."""
    out = run_cli("+exp=toy", override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank ") and f"failed: ValueError: {expected}" in line, line
    if override == "data.in_features=-1":  # one traceback, through the job's line
        assert out.stderr.count('jobs/toy.py", line') == 1, out.stderr
    else:  # nor torchrun's lines on the failed rank (the SIGTERM it sent the other, its exit code and binary)
        assert out.stderr.strip().splitlines() == [line], out.stderr


class WithoutEvalSums:
    """A task whose eval set the launcher would evaluate with parts it does not have."""

    def __init__(self) -> None:
        toy = ToyRegression(n_samples=64, in_features=4)
        self.train_set, self.eval_set, self.collate = toy.train_set, toy.eval_set, toy.collate
        self.count_items, self.loss_sum = toy.count_items, toy.loss_sum


def test_a_task_without_a_part_the_launcher_calls_fails_before_the_first_step() -> None:
    with pytest.raises(ValueError) as error:
        check_task(WithoutEvalSums(), "my.Task")
    assert str(error.value) == ("data._target_=my.Task built a WithoutEvalSums without eval_sum_keys, eval_sums, "
                                "eval_metrics: a task has what launcher/task.py's Task lists (the eval parts only "
                                "with an eval_set)")
    task = WithoutEvalSums()
    task.eval_set = None
    check_task(task, "my.Task")  # no eval set: no eval parts needed


def test_a_slurm_sweep_point_refused_at_launch_leaves_no_point_behind(tmp_path: Path) -> None:
    """train.micro_batch_size=7 does not divide: the point before it was written and queued, then neither
    submitted nor removed (its run dir listed by status as a run)."""
    sweep = tmp_path / "sweep"
    out = run_cli("-m", "+exp=toy", "launcher=slurm", "train.global_batch_size=16", "train.micro_batch_size=8,7",
                  f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 2 and "train.micro_batch_size=7" in out.stderr, out.stderr
    assert "submitted job" not in out.stdout and not sweep.exists()


def raises_a_data_error() -> None:
    from jobs.text import DataError
    raise DataError("data.path=x.csv row 3: no label in column 'label' (data.label_field)")


def unpacks_wrongly() -> None:
    first, second = [1, 2, 3]  # noqa: F841  (a fault of the job's own code)


@pytest.mark.parametrize("target, one_line", [
    ("test_bad_input_in_the_workers.raises_a_data_error", True), ("jobs.toy.NoSuchTask", True),
    ("no_such_module.Task", True), ("test_bad_input_in_the_workers.unpacks_wrongly", False), ("brokenjob.Task", False)])
def test_only_a_config_mistake_or_a_message_of_the_job_goes_without_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, one_line: bool) -> None:
    """A job's message about its input (an error with a true one_line: jobs.text.DataError) and a target or
    argument Hydra cannot use are their one line; a fault in the job's code, a ValueError included, or in its
    module as it is imported (Hydra passes that on as its own ImportError), keeps rank 0's traceback."""
    (tmp_path / "brokenjob.py").write_text("class Task:\n    pass\n\n\nundefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as error:
        build_part("data", OmegaConf.create({"_target_": target}))
    assert error.value.one_line is one_line, str(error.value)


def test_a_job_without_an_eval_set_is_told_where_evals_were_asked(tmp_path: Path) -> None:
    """train.max_steps=0 (evaluate only) of a job without an eval set ended 'done: evaluated without training, eval
    none', exit 0; train.eval_every logged a bare `eval ` at each eval step. Now the first stops in one line, the
    second says once that no eval comes, and trains."""
    out = run_cli("+exp=toy", "data.n_eval=0", "train.max_steps=0", f"hydra.run.dir={tmp_path / 'only'}", cwd=tmp_path)
    assert out.returncode == 1 and re.match(  # (whichever rank the agent reports first: each finds it)
        r"error: rank \d failed: ConfigError: train\.max_steps=0 evaluates only, and the job has no eval set; give it "
        r"one \(e\.g\. data\.eval_path\), or train\.max_steps > 0", out.stderr.strip().splitlines()[-1]), \
        out.stderr[-2000:]
    run_dir = tmp_path / "evals"
    out = run_cli("+exp=toy", "data.n_eval=0", "train.max_steps=4", "train.eval_every=2", "train.log_every=1",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "note: train.eval_every=2, but the job has no eval set (e.g. data.eval_path): no evals" in out.stderr
    assert [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line] == []


class AgreeingSums(ToyRegression):
    """Metrics that check their sums agree: all-ones sums fail it (a count of 1 and a loss that is no mean of it),
    the samples' own do not."""

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        assert sums["count"] == 2, sums  # the probe's two samples, the eval's whole set
        return {"loss": sums["loss_sum"] / sums["count"]}


class MisspeltSum(ToyRegression):
    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss_sum"] / sums["n"]}


def test_the_eval_probe_refuses_only_metrics_that_fail_on_the_samples_own_sums() -> None:
    """A fault on the all-ones sums alone (metrics that check their sums agree) was refused: it trains. A misspelt
    sum fails on both, and is refused before the first step, in one line."""
    task = AgreeingSums(n_samples=16, n_eval=4, in_features=4)
    run = SimpleNamespace(task=task, env=SimpleNamespace(device=torch.device("cpu")), module=torch.nn.Linear(4, 2),
                          precision=Precision("fp32", "cpu"), compile_watch=SimpleNamespace(enabled=False),
                          log=SimpleNamespace(warn=print), best=Best(None, None))
    probe_eval(run, "my.Task")
    run.task = MisspeltSum(n_samples=16, n_eval=4, in_features=4)
    with pytest.raises(ConfigError, match=r"^data._target_=my.Task: its eval_metrics failed on the sums of its first "
                                          r"eval samples: KeyError: 'n'$"):
        probe_eval(run, "my.Task")


class OverCountLessOne(ToyRegression):
    """A metric over count - 1 (as a sample variance's): all-ones sums divide by 0."""

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss_sum"] / sums["count"], "unbiased": sums["loss_sum"] / (sums["count"] - 1)}


@pytest.mark.parametrize("metric", ["unbiased", "accuracy"])
def test_best_metric_is_checked_on_the_samples_own_sums_where_all_ones_fail(metric: str) -> None:
    """train.best_metric learnt the metric names from all-ones sums alone: such a job failed at build with a
    ZeroDivisionError's traceback on every rank. Now the eval probe's real sums name them: a metric of the job is
    taken, another refused before the first step, and an eval that lacks it is told so, not a KeyError."""
    task = OverCountLessOne(n_samples=16, n_eval=4, in_features=4)
    best = best_eval(task, OmegaConf.create({"best_metric": metric, "best_mode": None}))
    run = SimpleNamespace(task=task, env=SimpleNamespace(device=torch.device("cpu")), module=torch.nn.Linear(4, 2),
                          precision=Precision("fp32", "cpu"), compile_watch=SimpleNamespace(enabled=False),
                          log=SimpleNamespace(warn=print), best=best)
    refusal = (rf"^train\.best_metric={metric} is not an eval metric of this job \(loss, unbiased\); name one of "
               rf"them, or null$")
    if metric == "unbiased":
        probe_eval(run, "my.Task")
        assert best.improved(2, {"loss": 1.0, "unbiased": 0.5}) and best.state()["value"] == 0.5
        with pytest.raises(ConfigError, match=r"^train\.best_metric=unbiased is not an eval metric of this job "
                                              r"\(loss, other\)"):
            best.improved(4, {"loss": 1.0, "other": 0.5})
    else:
        with pytest.raises(ConfigError, match=refusal):
            probe_eval(run, "my.Task")


class SeesAutocast(ToyRegression):
    """Eval sums that note whether autocast was on: a count of argmax hits in bf16 may flip between two samples
    together and each alone (a fresh head's logits are near ties), which the probe would take for a mean."""

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().eval_sums(model, batch)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The inputs as they come (the toy's own casts them to the weights' dtype): bf16 weights on fp32 inputs run
        only under autocast, as in a job of that kind."""
        return ((model(batch["x"]) - batch["y"]) ** 2).mean(dim=1).sum()


def test_the_eval_sums_probe_runs_at_the_weights_own_precision() -> None:
    """precision=bf16: the mean-or-sum probe of eval_sums compares its four forwards at fp32 (the weights'), not
    in bf16 autocast, where a count of argmax hits could flip and warn of a mean that is none."""
    task = SeesAutocast(n_samples=16, n_eval=4, in_features=4, out_features=2)
    task.autocast = []
    model = torch.nn.Linear(4, 2)
    run = SimpleNamespace(task=task, env=SimpleNamespace(device=torch.device("cpu")), module=model, model=model,
                          precision=Precision("bf16", "cpu"), compile_watch=SimpleNamespace(enabled=False),
                          log=SimpleNamespace(warn=print))
    probe_loss_sum(run, "my.Task")
    assert task.autocast == [False] * 4
    task.autocast = []  # bf16 weights (model.dtype=bfloat16), fp32 inputs: only autocast runs them, as the eval does
    run.module = run.model = model.to(torch.bfloat16)
    probe_loss_sum(run, "my.Task")
    assert task.autocast == [False] + [True] * 4
