"""A job in a repo of one's own (README's "Adding a job": a package on PYTHONPATH, configs added with -cd), and the
mistakes a new user makes writing one: each is one line naming the part, before a step is trained. The targets are
checked in the parent (launcher/launch/target_check.py), the task's parts in the workers before the first step
(launcher/train/job.py's check_task, launcher/train/evaluation.py's probe_eval)."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, committed, run_cli
from launcher.derived import ConfigError
from launcher.train.job import check_task

pytestmark = pytest.mark.slow
JOB = '''
import torch
from torch import nn


class Blobs:
    """Two Gaussian blobs to tell apart."""

    eval_sum_keys = ("loss_sum", "correct", "count")

    def __init__(self, n: int = 64, eval_n: int = 16, features: int = 4):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(n + eval_n) % 2
        x = torch.randn(n + eval_n, features, generator=g) + 2 * y[:, None]
        samples = [{"x": x[i], "y": y[i]} for i in range(n + eval_n)]
        self.train_set, self.eval_set = samples[:n], samples[n:]

    def collate(self, samples):
        return {"x": torch.stack([s["x"] for s in samples]), "y": torch.stack([s["y"] for s in samples])}

    def count_items(self, batch):
        return torch.tensor(len(batch["y"]))

    def loss_sum(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")

    def eval_sums(self, model, batch):
        logits = model(batch["x"])
        return {"loss_sum": nn.functional.cross_entropy(logits, batch["y"], reduction="sum"),
                "correct": (logits.argmax(1) == batch["y"]).sum(), "count": self.count_items(batch)}

    def eval_metrics(self, sums):
        return {"loss": sums["loss_sum"] / sums["count"], "accuracy": sums["correct"] / sums["count"]}


class WrongEvalKeys(Blobs):
    eval_sum_keys = ("loss_sum", "correct", "n")


class ExtraSums(Blobs):
    def eval_sums(self, model, batch):
        return {**super().eval_sums(model, batch), "margin": torch.tensor(0.5)}


class ExtraSumsAndAMean(ExtraSums):
    def loss_sum(self, model, batch):
        assert isinstance(model.module, nn.Module)  # the DDP-wrapped model, as README says loss_sum is given
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])  # reduction="mean", as torch's default

    def eval_sums(self, model, batch):  # its eval loss a mean too: the eval's would depend on its batches
        return {**super().eval_sums(model, batch), "loss_sum": nn.functional.cross_entropy(model(batch["x"]), batch["y"])}


class TupleCollate(Blobs):
    def collate(self, samples):
        return tuple(super().collate(samples).values())


class TensorMetrics(Blobs):
    def eval_metrics(self, sums):
        return {"accuracy": torch.tensor(sums["correct"] / sums["count"])}


class MisspeltSum(Blobs):
    def eval_metrics(self, sums):
        return {"accuracy": sums["n_correct"] / sums["count"]}


class Streamed(Blobs):
    def __init__(self):
        super().__init__()
        self.train_set = iter(self.train_set)


def Net(features: int = 4, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 2))


class WithASpareHead(nn.Module):
    """A second head that no loss uses (a model trained for one of its tasks)."""

    def __init__(self, features: int = 4):
        super().__init__()
        self.body, self.spare = Net(features), nn.Linear(2, 3)

    def forward(self, x):
        return self.body(x)
'''
CONFIGS = {
    "data/blobs.yaml": "_target_: myjob.cls.Blobs\nn: 64\n",
    "model/net.yaml": "_target_: myjob.cls.Net\nfeatures: 4\n",
    "model/untargeted.yaml": "features: 4\n",
    "exp/myjob.yaml": textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /data: blobs
          - override /model: net
        name: myjob
        train:
          max_steps: 8
          global_batch_size: 16
          micro_batch_size: 4
        """),
}
CONFIGS["exp/unpackaged.yaml"] = CONFIGS["exp/myjob.yaml"].split("\n", 1)[1]  # without its package line
CONFIGS["exp/inline.yaml"] = CONFIGS["exp/myjob.yaml"].replace("  - override /model: net\n", "") + textwrap.dedent("""\
    model:
      _target_: myjob.cls.Net
      features: 4
    """)  # its model written in place: Hydra merges it over the default model=mlp


@pytest.fixture
def own_repo(tmp_path: Path) -> Path:
    """~/myjobs: the package myjob (myjob/cls.py, and myjob/broken.py that does not parse) and its conf/."""
    repo = tmp_path / "myjobs"
    (repo / "myjob").mkdir(parents=True)
    (repo / "myjob" / "__init__.py").write_text("")
    (repo / "myjob" / "cls.py").write_text(JOB)
    (repo / "myjob" / "broken.py").write_text("class Blobs\n    pass\n")
    for name, text in CONFIGS.items():
        (repo / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "conf" / name).write_text(text)
    return repo


def launch(repo: Path, *overrides: str, path: bool = True):
    """From the launcher's repo, as README's command runs it (with PYTHONPATH unless `path` is false)."""
    env = {"PYTHONPATH": f"{repo}:{REPO}"} if path else {}
    return run_cli("-cd", str(repo / "conf"), "+exp=myjob", *overrides, f"hydra.run.dir={repo / 'run'}", cwd=REPO,
                   **env)


def test_a_job_of_one_s_own_trains_from_its_own_repo(own_repo: Path) -> None:
    """launch.json records the job repo's git state beside the launcher's, its uncommitted change in job.git.diff.
    Its eval_sums returns a sum its eval_sum_keys do not name, and its loss_sum is a mean (torch's default
    reduction): each said once before the first step, as the one is neither added up nor logged and the other
    trains with a learning rate that shrinks with the micro-batch."""
    revision = committed(own_repo)
    with open(own_repo / "myjob" / "cls.py", "a") as f:
        f.write("# tried this afternoon\n")
    out = launch(own_repo, "data._target_=myjob.cls.ExtraSumsAndAMean")
    assert out.returncode == 0, out.stderr[-3000:]
    job = "warning: data._target_=myjob.cls.ExtraSumsAndAMean"
    assert out.stderr.count(f"{job}: its eval_sums returned margin, which its eval_sum_keys do not name: not added up, "
                            f"not reported") == 1, out.stderr
    assert len(re.findall(rf"{job}: its loss_sum gave [\d.]+ for train samples 0 and 1 together and [\d.]+ for each "
                          rf"alone, added up: a mean\? Return the sum", out.stderr)) == 1, out.stderr
    assert out.stderr.count(f"{job}: its eval_sums' 'loss_sum' for eval samples 0 and 1 together is about half the two "
                            f"alone, added up: a mean?") == 1, out.stderr
    assert (own_repo / "run" / "checkpoints" / "8" / "COMPLETE").is_file()
    record = json.loads((own_repo / "run" / "launch.json").read_text())  # what the same command needs again
    assert record["env"]["PYTHONPATH"] == f"{own_repo}:{REPO}" and "-cd" in record["command"], record
    assert record["job_git"] == {str(own_repo.resolve()): {"revision": revision, "dirty": True, "diff": "job.git.diff"}}, record
    assert "+# tried this afternoon" in (own_repo / "run" / "job.git.diff").read_text()


@pytest.mark.parametrize("overrides, path, line", [
    ((), False, "error: data._target_=myjob.cls.Blobs: no module named 'myjob' on this Python's path (a job of your "
                "own: PYTHONPATH=<the dir that holds myjob/>, see README's 'Adding a job')"),
    (("data._target_=myjob.cls.Blob",), True, "error: data._target_=myjob.cls.Blob: {repo}/myjob/cls.py defines no "
                                              "Blob; did you mean Blobs?"),
    (("data._target_=myjob.clss.Blobs",), True, "error: data._target_=myjob.clss.Blobs: no module named myjob.clss "
                                                "(myjob is {repo}/myjob/)"),
    (("data._target_=myjob.broken.Blobs",), True, "error: data._target_=myjob.broken.Blobs: {repo}/myjob/broken.py "
                                                  "does not parse: expected ':' (line 1)"),
    (("model=untargeted",), True, "error: model has no _target_ (the function or class that builds it, as "
                                  "package.module.Name): add one to conf/model/<name>.yaml, or choose model=<name>"),
], ids=["no PYTHONPATH", "a misspelt class", "a misspelt module", "a module that does not parse", "no _target_"])
def test_a_target_that_names_nothing_is_refused_in_the_parent(own_repo: Path, overrides: tuple, path: bool,
                                                              line: str) -> None:
    """These failed each worker after the rendezvous (or the parent with Hydra's traceback, for a module that does
    not parse), and passed a dry run; now exit 2 before any process starts, and no run dir."""
    out = launch(own_repo, *overrides, path=path)
    assert (out.returncode, out.stderr.strip()) == (2, line.format(repo=own_repo)), out.stderr[-3000:]
    assert not (own_repo / "run").exists()


def test_eval_parts_that_do_not_fit_fail_before_the_first_step(own_repo: Path) -> None:
    """A sum that eval_sums does not return failed at the first eval (KeyError: 'n'), which with
    train.eval_every=0 comes after the last step and before its checkpoint: the whole run was lost."""
    out = launch(own_repo, "data._target_=myjob.cls.WrongEvalKeys")
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]  # (either rank's: each finds it)
    assert re.match(r"error: rank \d failed: ConfigError: data._target_=myjob.cls.WrongEvalKeys: its eval_sums "
                    r"returned no 'n' \(its eval_sum_keys: loss_sum, correct, n; it returned loss_sum, correct, "
                    r"count\)", line) and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "step 1/" not in out.stdout and not (own_repo / "run" / "checkpoints").exists()


@pytest.mark.parametrize("task, message", [
    ("TupleCollate", "its collate returned a tuple; return a dict of CPU tensors (its loss_sum reads them by name)"),
    ("Streamed", "its train_set is a list_iterator without len() and indexing; give a map-style dataset"),
])
def test_a_task_s_parts_are_checked_as_it_is_built(own_repo: Path, monkeypatch: pytest.MonkeyPatch, task: str,
                                                   message: str) -> None:
    monkeypatch.syspath_prepend(str(own_repo))
    from myjob import cls

    with pytest.raises(ConfigError) as error:
        check_task(getattr(cls, task)(), f"myjob.cls.{task}")
    assert str(error.value).startswith(f"data._target_=myjob.cls.{task}: {message}"), str(error.value)
    check_task(cls.Blobs(), "myjob.cls.Blobs")


@pytest.mark.parametrize("task, message", [
    ("TensorMetrics", "its eval_metrics' 'accuracy' is a Tensor of shape (); return Python numbers (float(...) of a "
                      "tensor)"),
    # its KeyError was taken for metrics that need real sums: all steps trained, then the final eval failed, unsaved
    ("MisspeltSum", "its eval_metrics failed on the sums of its first eval samples: KeyError: 'n_correct'")])
def test_eval_metrics_that_are_tensors_or_fail_fail_before_the_first_step(own_repo: Path, task: str,
                                                                           message: str) -> None:
    out = launch(own_repo, f"data._target_=myjob.cls.{task}", "launcher.nproc_per_node=1")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: rank 0 failed: ConfigError: data._target_=myjob.cls.{task}: {message}"), out.stderr[-3000:]
    assert "step 1/" not in out.stdout, out.stdout[-2000:]


def test_an_experiment_without_its_package_line_is_told_the_fix(own_repo: Path) -> None:
    out = run_cli("-cd", str(own_repo / "conf"), "+exp=unpackaged", cwd=REPO, PYTHONPATH=f"{own_repo}:{REPO}")
    assert (out.returncode, out.stderr.strip()) == (2, (
        "error: In 'exp/unpackaged': Could not override 'data@exp.data'; Did you mean to override data?; an experiment "
        "sets keys of the whole config: make `# @package _global_` the first line of exp/unpackaged.yaml"))


def test_parameters_no_loss_uses_are_told_by_the_key_that_allows_them(own_repo: Path) -> None:
    """DDP's error names its own argument (find_unused_parameters=True) and the parameters' indices."""
    out = launch(own_repo, "model._target_=myjob.cls.WithASpareHead")
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank \d failed: the model has parameters that no loss used in the last step \(DDP: "
                    r"Parameter indices which did not receive grad for rank \d: 4 5\); set "
                    r"dist.find_unused_parameters=true", line), out.stderr[-3000:]
    fixed = launch(own_repo, "model._target_=myjob.cls.WithASpareHead", "dist.find_unused_parameters=true")
    assert fixed.returncode == 0, fixed.stderr[-3000:]  # (the same run dir: the failed start left no checkpoint)
    assert "a mean?" not in fixed.stderr  # Blobs' loss_sum sums


def test_a_model_written_in_place_over_the_default_is_told_where_its_extra_keys_come_from(own_repo: Path) -> None:
    """It was `model.out_features is a key nothing reads ... did you mean data.out_features?`: keys the user never
    wrote, from model=mlp underneath. Told so for a sweep's later point too, whose own option the check reads (it read
    point 0's: model=net)."""
    line = ("model.in_features comes from model=mlp (conf/model/mlp.yaml), the option under the model._target_ your "
            "config sets (myjob.cls.Net takes no in_features): write yours as a model option of its own and choose it "
            "(model=<name>, or `- override /model: <name>` in an experiment's defaults)")
    out = run_cli("-cd", str(own_repo / "conf"), "+exp=inline", cwd=REPO, PYTHONPATH=f"{own_repo}:{REPO}")
    assert (out.returncode, out.stderr.strip()) == (2, f"error: {line}")
    sweep = run_cli("-m", "-cd", str(own_repo / "conf"), "+exp=myjob,inline", f"hydra.sweep.dir={own_repo / 'sweep'}",
                    cwd=REPO, PYTHONPATH=f"{own_repo}:{REPO}")
    refused = f"error: sweep point #1 (+exp=inline): {line}; no point of the sweep ran (fix that value, or leave it " \
              f"out of the sweep)"
    assert (sweep.returncode, sweep.stderr.strip()) == (2, refused)


def test_a_config_of_one_s_own_named_like_the_launcher_s_is_told_to_be_renamed(own_repo: Path) -> None:
    """Hydra reads conf/model/mlp.yaml before ~/myjobs/conf/model/mlp.yaml: the launcher's mlp trained, in silence.
    Now exit 2 before any process starts, for a list group's config too (logger) and for a sweep's later point (its
    first one trained before); the same text in both (a copied conf/) changes nothing and trains."""
    conf, run_dir = own_repo / "conf", own_repo / "run"
    toy = ("-cd", str(conf), "+exp=toy", "train.max_steps=1", f"hydra.run.dir={run_dir}")
    for name, old, new in (("model/mlp", "hidden: 32", "hidden: 7"), ("logger/tensorboard", "\n", "\n# mine\n"),
                           ("precision/fp32", "name: fp32", "name: fp32  # mine")):
        ours, yours = REPO / "conf" / f"{name}.yaml", conf / f"{name}.yaml"
        yours.parent.mkdir(exist_ok=True)
        yours.write_text(ours.read_text().replace(old, new, 1))
        group = name.split("/")[0]
        line = (f"{yours} is not what this run reads: Hydra reads {ours}, which comes first on its search path; give "
                f"yours a name of its own ({group}/<name>.yaml) and choose {group}=<name>")
        if group == "precision":  # a sweep whose point 0 (precision=auto) reads none of it
            sweep = run_cli("-m", *toy[:-1], f"hydra.sweep.dir={own_repo / 'sweep'}", "precision=auto,fp32", cwd=REPO)
            refused = (f"error: sweep point #1 (precision=fp32): {line}; no point of the sweep ran (fix that value, or "
                       f"leave it out of the sweep)")
            assert (sweep.returncode, sweep.stderr.strip()) == (2, refused), sweep.stderr[-3000:]
            assert not (own_repo / "sweep" / "0").exists()
        else:
            out = run_cli(*toy, cwd=REPO)
            assert (out.returncode, out.stderr.strip()) == (2, f"error: {line}"), out.stderr[-3000:]
            assert not run_dir.exists()
        yours.write_text(ours.read_text())
    out = run_cli(*toy, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
