"""No silent keys (issue 39): a key that no schema or `_target_` takes is refused in the parent, added with `+` or
not, with the "did you mean" the other typos get, before any worker starts and with no run dir left behind. Real
launches (dry runs) of the CLI; every config option's keys are checked in tests/test_configs.py."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from omegaconf import OmegaConf

from conftest import run_cli
from launcher import schema
from launcher.launch.known_keys import CONF_DIR, PEER_NAMES, target_parameters

NOTHING_READS = "is a key nothing reads (a typo, or one added with + that no schema or target takes): "


@pytest.mark.parametrize(("override", "fix"), [
    ("+train.max_step=20", "did you mean train.max_steps?"),  # Hydra's own message suggested this + once
    ("+launcher.nprocs=1", "did you mean launcher.nproc_per_node?"),
    ("+data.n_sampels=3", "did you mean data.n_samples?"),  # a _target_ group: ToyRegression's signature
    ("+optimizer.lrr=0.1", "did you mean optimizer.lr?"),  # torch.optim.AdamW's
    ("+train.lr=0.1", "did you mean optimizer.lr?"),  # a key of another group, by its name
    ("+train.precision=bf16", "did you mean precision=bf16?"),  # a group's choice
    ("+logger.tensorboard.dir=tb", "logger.tensorboard takes no keys"),
    # a peer's name for a key of ours (HF Trainer, Lightning, nanoGPT): by meaning, where the spelling is no guide
    ("+train.gradient_accumulation_steps=4", "did you mean train.global_batch_size (accumulation steps = "
                                             "global_batch_size / (micro_batch_size x ranks))?"),
    ("+epochs=3", "did you mean train.max_steps (a run counts optimizer steps, not epochs)?"),
    ("+seeds=1", "the config has data, dist, launcher, logger, model, name, optimizer, precision, resume, scheduler, "
                 "strategy, train"),
])
def test_a_key_nothing_reads_is_refused_in_one_line(tmp_path: Path, override: str, fix: str) -> None:
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", override, "launcher.dry_run=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    key = override.lstrip("+").split("=")[0]
    assert out.returncode == 2 and out.stderr.strip() == f"error: {key} {NOTHING_READS}{fix}", out.stderr
    assert not run_dir.exists()


def test_hydra_s_own_refusal_no_longer_suggests_adding_the_key_with_plus(tmp_path: Path) -> None:
    out = run_cli("+exp=toy", "train.max_step=20", "launcher.dry_run=true", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean train.max_steps?" in out.stderr and "+train" not in out.stderr


@pytest.mark.parametrize(("override", "fix"), [
    ("train.lr=0.1", "Key 'lr' not in 'TrainConfig'; did you mean optimizer.lr?"),  # a typed group
    ("model.max_steps=3", "Key 'max_steps' is not in struct; did you mean train.max_steps?"),  # a _target_ group
    ("train.precision=bf16", "Key 'precision' not in 'TrainConfig'; did you mean precision=bf16?"),
    ("optimizer.name=sgd", "Key 'name' is not in struct; did you mean optimizer=sgd?"),  # a group's choice
    ("train.path=x", "Key 'path' not in 'TrainConfig'; did you mean data.path?"),  # (data=files: a ??? key)
    ("hydra.run.name=x", "Key 'name' not in 'RunDir'"),  # Hydra's own: no guess
    ("train.grad_clip=0.5", "Key 'grad_clip' not in 'TrainConfig'; did you mean train.max_grad_norm=0.5?"),  # a peer's
    ("optimizer.learning_rate=3e-4", "Key 'learning_rate' is not in struct; did you mean optimizer.lr=3e-4?"),
    ("train.fp16=true", "Key 'fp16' not in 'TrainConfig'; did you mean precision=fp16 (or bf16, fp32, auto)?"),
    # a key of another option of the same group: of model and data only those of the same job (data=files builds
    # the TextClassification data=sentiment builds; data=corpus, which has a path too, the MLM's), of a logger under
    # its package, before a key of that name in another group (resume.mode)
    ("data.path=x.csv", "Key 'path' is not in struct; did you mean data=files data.path=x.csv?"),
    ("optimizer.momentum=0.9", "Key 'momentum' is not in struct; did you mean optimizer=sgd optimizer.momentum=0.9?"),
    ("logger.mode=online", "Key 'mode' not in 'LoggerConfig'; did you mean logger.wandb.mode=online?"),
    # (model=bert_bench has layers: the benchmark's model, not offered; the closest of the chosen model's is)
    ("model.layers=4", "Key 'layers' is not in struct; did you mean model.num_labels?"),
])
def test_a_key_put_in_the_wrong_group_names_the_group_it_belongs_to(tmp_path: Path, override: str, fix: str) -> None:
    data = [] if override.startswith(("data.", "model.")) else ["data=files"]
    out = run_cli("+exp=bert", *data, override, "launcher.dry_run=true", cwd=tmp_path)
    key = override.split("=")[0]
    assert out.returncode == 2 and out.stderr.strip() == f"error: Could not override '{key}'; {fix}", out.stderr


def test_a_target_s_parameters_come_from_its_source_without_importing_it() -> None:
    """jobs.bert would import transformers (seconds): its signature is read from the file; a function taking
    **kwargs takes any key; a name the module does not define itself cannot be told, so it is not checked."""
    import sys

    sys.modules.pop("jobs.toy", None)
    assert {"n_samples", "lazy", "seed"} <= target_parameters("jobs.toy.ToyRegression")
    assert "jobs.toy" not in sys.modules
    assert "lr" in target_parameters("torch.optim.AdamW") and target_parameters("jobs.nowhere.Thing") is None
    assert target_parameters("launcher.launch.known_keys.check_known_keys") == {"cfg", "configs"}


def test_a_peer_s_name_is_no_key_of_ours_and_leads_to_one_that_is() -> None:
    """A name of ours in PEER_NAMES would be answered as a peer's only where nothing else is found (known_keys'
    elsewhere); still, none is: every schema's field, every config option's key and its _target_'s parameters."""
    def fields(cls: type, prefix: str) -> set[str]:
        found = set()
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typed = next((t for t in (hints[f.name], *get_args(hints[f.name])) if dataclasses.is_dataclass(t)), None)
            found |= {f"{prefix}{f.name}"} | (fields(typed, f"{prefix}{f.name}.") if typed else set())
        return found

    ours = fields(schema.Config, "")
    for path in CONF_DIR.glob("*/*.yaml"):
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        ours |= {f"{path.parent.name}.{key}" for key in node}
        ours |= {f"{path.parent.name}.{key}" for key in target_parameters(node.get("_target_", "")) or ()}
    assert not {key.rpartition(".")[2] for key in ours} & PEER_NAMES.keys()
    for key, _ in PEER_NAMES.values():
        group, _, choice = key.partition("=")
        assert (CONF_DIR / group / f"{choice}.yaml").is_file() if choice else key in ours | {"hydra.run.dir"}, key
