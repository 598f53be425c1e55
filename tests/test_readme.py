"""Every `python -m launcher ...` command the README shows runs as written: each one in dry-run form
(composed, checked and resolved by the real CLI, the torchrun command or Slurm submission printed, nothing
started), in a folder holding the files the commands name."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env


def readme_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[3:] for line in lines if line.startswith("python -m launcher ")]


COMMANDS = readme_commands()


def test_the_readme_shows_commands() -> None:
    assert len(COMMANDS) >= 8 and any("launcher=slurm" in c for c in COMMANDS)


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_readme_command_runs_as_written(args: list[str], tmp_path: Path, tiny_bert: Path) -> None:
    (tmp_path / "my_bert").symlink_to(tiny_bert)  # a dir written by save_pretrained
    (tmp_path / "train.csv").write_text("sentence,label\na fine film,1\na dull film,0\n")
    (tmp_path / "dev.jsonl").write_text('{"sentence": "a fine film", "label": 1}\n')
    (tmp_path / "corpus.txt").write_text("one line of text\nanother line\n")
    for name in ("pretrain", "finetune"):  # runs that trained (pretrain was submitted with launcher=slurm, for
        run = tmp_path / "runs" / name     # launcher.after); model.pretrained=<run dir>: its newest checkpoint
        if f"hydra.run.dir=runs/{name}" in args:  # the command makes it (its slurm.json would cost a Slurm query)
            continue
        (run / "checkpoints" / "4").mkdir(parents=True)
        (run / "slurm.json").write_text('{"job_id": "1234", "log_dir": "slurm"}\n')
        (run / "launch.json").write_text("{}\n")
        for kept in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # (what its job's checkpoint holds)
            (run / "checkpoints" / "4" / kept).write_text((tiny_bert / kept).read_text())
        (run / "checkpoints" / "4" / "COMPLETE").write_text("{}\n")
    args = [arg.replace("=/shared/", f"={tmp_path}/shared/") for arg in args]  # the nodes' shared storage
    flags = 1 if args[:1] == ["-m"] else 0  # Hydra's own options (`--cfg job`) must stay last
    dry = [*args[:flags], "launcher.dry_run=true", *args[flags:]]
    # the hub may be named (model.pretrained=bert-base-uncased): the parent checks, it never downloads
    out = subprocess.run([sys.executable, "-m", "launcher", *dry], cwd=tmp_path, env=subprocess_env(HF_HUB_OFFLINE="0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--cfg" in args or "dry run: would" in out.stdout, out.stdout[-2000:]
