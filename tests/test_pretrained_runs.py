"""A run's checkpoint is a pretrained model: transformers loads a BERT job's checkpoint without the launcher,
and model.pretrained=<run dir> starts a new run from that run's newest checkpoint (pre-train, then fine-tune,
then evaluate with train.max_steps=0)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import run_cli, subprocess_env
from launcher.derived import ConfigError, config_hash
from launcher.launch.checks import check_job_inputs
from launcher.launch.resume import check_resume
from launcher.train import checkpoint

# Plain transformers in a process of its own, the launcher's code not imported (its attention registration
# included): each checkpoint loads with the Auto class, and every tensor of the model equals the file's, the
# tied ones (the MLM decoder: the word embeddings) equal to the tensor they share.
LOAD = """
import json, sys, torch
from safetensors import safe_open
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer
for auto, checkpoint in ((AutoModelForMaskedLM, sys.argv[1]), (AutoModelForSequenceClassification, sys.argv[2])):
    model = auto.from_pretrained(checkpoint)
    state = model.state_dict()
    with safe_open(checkpoint + "/model.safetensors", "pt") as f:
        saved, tied = {k: f.get_tensor(k) for k in f.keys()}, {k: v for k, v in f.metadata().items() if k != "format"}
    assert state.keys() == saved.keys() | tied.keys(), state.keys() ^ (saved.keys() | tied.keys())
    assert all(torch.equal(state[k], saved[k]) for k in saved) and all(torch.equal(state[k], saved[v]) for k, v in tied.items())
    print(json.dumps({"class": type(model).__name__, "tied": sorted(tied),
                      "ids": AutoTokenizer.from_pretrained(checkpoint)("a short sentence")["input_ids"]}))
assert not {"launcher", "jobs"} & set(sys.modules)
"""


# fine-tunes on 2 ranks: rank 0 picks the checkpoint, the other takes its choice
FINE_TUNE = ("+exp=bert", "launcher.nproc_per_node=2", "train.global_batch_size=8", "train.micro_batch_size=4",
             "data.n_train=32", "data.n_eval=16", "train.max_steps=2")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> tuple[Path, str]:
    """A folder with `pretrain` (+exp=bert_mlm, checkpoints 2 and 4, dropout 0.05) and `from_run` (+exp=bert
    given that run dir, 2 steps); and from_run's output."""
    tmp_path = tmp_path_factory.mktemp("chain")
    pretrain = tmp_path / "pretrain"
    out = run_cli("+exp=bert_mlm", "launcher.nproc_per_node=1", "train.global_batch_size=8", "train.micro_batch_size=8",
                  f"model.pretrained={tiny_bert}", "model.dropout=0.05", "data.n_train=64", "data.n_eval=0",
                  "train.max_steps=4", "train.ckpt_every=2", f"hydra.run.dir={pretrain}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    from_run = run_cli(*FINE_TUNE, f"model.pretrained={pretrain}", f"hydra.run.dir={tmp_path / 'from_run'}", cwd=tmp_path)
    assert from_run.returncode == 0, from_run.stdout[-2000:] + from_run.stderr[-3000:]
    return tmp_path, from_run.stdout


@pytest.mark.slow
def test_checkpoints_are_save_pretrained_dirs(chain: tuple[Path, str], tiny_bert: Path) -> None:
    """What differs by transformers version (CI's floor runs it with 4.45.2): the MLM checkpoint and the
    fine-tuned classifier's load with plain transformers, every tensor as saved."""
    tmp_path, _ = chain
    checkpoints = tmp_path / "pretrain" / "checkpoints"
    config = json.loads((checkpoints / "4" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["hidden_dropout_prob"] == 0.05
    fine_tuned = tmp_path / "from_run" / "checkpoints" / "2"
    config = json.loads((fine_tuned / "config.json").read_text())  # model.dropout=null: the pre-training run's
    assert config["architectures"] == ["BertForSequenceClassification"] and config["hidden_dropout_prob"] == 0.05

    load = subprocess.run([sys.executable, "-c", LOAD, str(checkpoints / "4"), str(fine_tuned)], cwd=tmp_path,
                          env={**subprocess_env(), "PYTHONPATH": ""}, capture_output=True, text=True, timeout=120)
    assert load.returncode == 0, load.stderr[-3000:]
    mlm, classifier = (json.loads(line) for line in load.stdout.splitlines())
    assert mlm["class"] == "BertForMaskedLM" and "cls.predictions.decoder.weight" in mlm["tied"]
    assert classifier["class"] == "BertForSequenceClassification"
    from transformers import AutoTokenizer

    assert mlm["ids"] == classifier["ids"] == AutoTokenizer.from_pretrained(tiny_bert)("a short sentence")["input_ids"]


@pytest.mark.slow
def test_a_run_dir_stands_for_its_pinned_checkpoint_then_max_steps_0_evaluates(
        chain: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Changes the pre-training run's checkpoints: runs after test_checkpoints_are_save_pretrained_dirs."""
    tmp_path, from_run_out = chain
    pretrain = tmp_path / "pretrain"
    checkpoints = pretrain / "checkpoints"
    newest = load_file(checkpoints / "4" / "model.safetensors")
    assert not torch.equal(newest["bert.encoder.layer.0.output.dense.weight"],
                           load_file(checkpoints / "2" / "model.safetensors")["bert.encoder.layer.0.output.dense.weight"])
    assert f"model.pretrained={pretrain}: from checkpoint {checkpoints / '4'}" in from_run_out
    pin = {"run": str(pretrain), "checkpoint": str(checkpoints / "4")}
    assert json.loads((tmp_path / "from_run" / "pretrained.json").read_text()) == {  # (model.tokenizer: the BERT
        "model.pretrained": pin, "data.tokenizer": pin, "model.tokenizer": pin}  # models' ${data.tokenizer})
    # (given also recomputes its activations in the backward: on 2 ranks, with dropout, that changes no bit either)
    given = run_cli(*FINE_TUNE, f"model.pretrained={checkpoints / '4'}", "model.activation_checkpointing=true",
                    f"hydra.run.dir={tmp_path / 'given'}", cwd=tmp_path)
    assert given.returncode == 0, given.stdout[-2000:] + given.stderr[-3000:]
    # The same start, so the same two steps, bit for bit: the run dir stood for its newest checkpoint
    a, b = (load_file(tmp_path / run / "checkpoints" / "2" / "model.safetensors") for run in ("from_run", "given"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["bert.embeddings.word_embeddings.weight"], newest["bert.embeddings.word_embeddings.weight"])
    # So the key is no part of the trajectory: given resumes with it off, or with a config from before the key, as
    # the parent's check and the worker's config hash see it (dropout is, the control)
    config = OmegaConf.to_container(OmegaConf.load(tmp_path / "given" / "config.yaml"))
    saved = torch.load(tmp_path / "given" / "checkpoints" / "2" / "train_state.pt", weights_only=True)["config_hash"]
    model = {k: v for k, v in config["model"].items() if k != "activation_checkpointing"}
    for other in ({**model, "activation_checkpointing": False}, model):
        assert check_resume(tmp_path / "given", {**config, "model": other}) == 2
        assert config_hash({**config, "model": other}) == saved
    with pytest.raises(ConfigError, match=r"\(model\.dropout was null, now 0\.2\)"):
        check_resume(tmp_path / "given", {**config, "model": {**model, "dropout": 0.2}})

    # The pre-training run has a newer checkpoint: a relaunch of the fine-tune still builds from the pinned one, the
    # same for a key its first start did not pin (a run dir from before model.tokenizer was a key: it took the newest)
    shutil.copytree(checkpoints / "4", checkpoints / "6")
    pins = tmp_path / "from_run" / "pretrained.json"
    pins.write_text(json.dumps({"model.pretrained": pin, "data.tokenizer": pin}))
    relaunch = (*FINE_TUNE, f"model.pretrained={pretrain}", f"hydra.run.dir={tmp_path / 'from_run'}",
                "resume.allow_config_change=true")
    again = run_cli(*relaunch, "train.max_steps=3", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"model.pretrained={pretrain}: from checkpoint {checkpoints / '4'}" in again.stdout
    assert "resumed from step 2" in again.stdout
    assert json.loads(pins.read_text()) == {"model.pretrained": pin, "data.tokenizer": pin, "model.tokenizer": pin}
    # a key that now names another run gives up its pin, not the run's checkpoint the other keys have (the parent
    # reads the pins as the run dir has them): the tokenizer stays at 4, the newest (6) being no choice of this run's
    following = tmp_path / "following"
    following.mkdir()
    (following / "pretrained.json").write_text(json.dumps({"model.pretrained": pin}))
    sections = {"model": {"pretrained": str(tmp_path / "from_run")}, "data": {"tokenizer": str(pretrain)}}
    assert checkpoint._choose_pretrained(following, sections, True, print)["data"]["tokenizer"] == pin["checkpoint"]
    # a restart reads the pinned checkpoint whole once, for the three keys that name its run (it did once each)
    hashed = []
    monkeypatch.setattr(checkpoint, "_sha256", lambda path, real=checkpoint._sha256: hashed.append(path) or real(path))
    sections = {"model": {"pretrained": str(pretrain), "tokenizer": str(pretrain)}, "data": {"tokenizer": str(pretrain)}}
    chosen = checkpoint._choose_pretrained(tmp_path / "from_run", sections, True, print)
    assert chosen == {"model": {"pretrained": pin["checkpoint"], "tokenizer": pin["checkpoint"]},
                      "data": {"tokenizer": pin["checkpoint"]}}
    assert hashed and len(hashed) == len(set(hashed)), hashed

    # A fresh run takes the newest usable checkpoint: here none (6 corrupt, 4 and 2 gone). Rank 0 finds out, and
    # every rank stops with its line, in the workers (the parent reads no checksum)
    shutil.rmtree(checkpoints / "4")
    shutil.rmtree(checkpoints / "2")
    (checkpoints / "6" / "model.safetensors").write_bytes(b"not the weights")
    bad = run_cli(*FINE_TUNE, f"model.pretrained={pretrain}", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert bad.returncode == 1 and f"checkpoint {checkpoints / '6'} is unusable" in bad.stderr, bad.stderr[-3000:]
    last = bad.stderr.strip().splitlines()[-1]  # the launcher's line, from whichever rank it heard of first
    assert last.startswith("error: rank ") and f"model.pretrained={pretrain} is a run dir without a usable checkpoint" in last
    assert "Traceback" not in bad.stderr and "ConfigError: " in last  # every rank's error is rank 0's one line

    # The pinned checkpoint is gone: a relaunch resumes, built from the fine-tune's own newest checkpoint (the
    # parent does not check again what the first start pinned)
    again = run_cli(*relaunch, "train.max_steps=4", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"model.pretrained={pretrain}: from checkpoint {tmp_path / 'from_run' / 'checkpoints' / '3'}" in again.stdout
    assert "resumed from step 3" in again.stdout

    # Then evaluate: train.max_steps=0 trains nothing and evaluates the fine-tuned checkpoint, exactly as the
    # fine-tune's own final eval did with the same weights in memory
    evaluate = run_cli(*FINE_TUNE, f"model.pretrained={tmp_path / 'from_run'}", "train.max_steps=0",
                       f"hydra.run.dir={tmp_path / 'evaluate'}", cwd=tmp_path)
    assert evaluate.returncode == 0, evaluate.stdout[-2000:] + evaluate.stderr[-3000:]
    summary, trained = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("evaluate", "from_run"))
    assert summary["steps"] == 0 and summary["checkpoint"] is None and not (tmp_path / "evaluate" / "checkpoints").exists()
    assert summary["eval"] == trained["eval"] and trained["steps"] == 4 and set(trained["eval"]) == {"loss", "accuracy", "f1"}
    assert "done: evaluated without training, eval loss=" in evaluate.stdout


def test_a_run_dir_named_as_pretrained_is_checked_in_the_parent(tmp_path: Path) -> None:
    run_dir = tmp_path / "pretrain"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text("{}")
    config = {"model": {"pretrained": str(run_dir)}, "data": {"tokenizer": str(run_dir)}, "launcher": {"after": None}}
    with pytest.raises(ConfigError, match=r"^model\.pretrained=.*/pretrain is a run dir without a complete checkpoint; "
                                          r"train it first, or \(launcher=slurm\) add launcher.after="):
        check_job_inputs(config, pinned={})
    # queued after that run's job (launcher.after), which loads a pretrained model: its checkpoints will do
    (run_dir / "config.yaml").write_text("model:\n  _target_: jobs.bert.masked_lm_model\n  pretrained: x\n")
    check_job_inputs({**config, "launcher": {"after": str(run_dir)}}, pinned={})
    (run_dir / "config.yaml").write_text("model:\n  _target_: jobs.toy.MLP\n  hidden: 4\n")
    with pytest.raises(ConfigError, match=r"^model\.pretrained=.*: that run's model \(jobs\.toy\.MLP\) loads no pretrained"):
        check_job_inputs({**config, "launcher": {"after": str(run_dir)}}, pinned={})
    # a later start of a run whose first start pinned the checkpoints: not checked again (they may be gone)
    pin = {"run": str(run_dir), "checkpoint": "gone"}
    check_job_inputs(config, pinned={"model.pretrained": pin, "data.tokenizer": pin})
    other = {"run": str(tmp_path / "another_run"), "checkpoint": "gone"}  # pinned for another value: a new choice
    with pytest.raises(ConfigError, match=r"^model\.pretrained=.* is a run dir without a complete checkpoint"):
        check_job_inputs(config, pinned={"model.pretrained": other, "data.tokenizer": other})
    step = run_dir / "checkpoints" / "3"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    with pytest.raises(ConfigError, match=r"^data\.tokenizer=.*: its newest checkpoint .*/checkpoints/3 has no config.json: "
                                          r"a run dir stands for a save_pretrained dir, .*or the checkpoint itself "
                                          r"\(data\.tokenizer=.*/checkpoints/3\) to a builder that reads it"):
        check_job_inputs({**config, "model": {}}, pinned={})
    (step / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (step / "tokenizer_config.json").write_text("{}")  # (a text job's checkpoint holds its tokenizer too)
    check_job_inputs(config, pinned={})
    with pytest.raises(ConfigError, match=r"data\.max_length=128 is more than the 64 positions of model\.pretrained="):
        check_job_inputs({**config, "data": {"tokenizer": str(run_dir), "max_length": 128}}, pinned={})
