"""A hub id as model.pretrained that this machine cannot load is refused in the parent, in one line: every rank's
transformers retried the hub for over a minute, then failed building the tokenizer with a screen of tracebacks that
blamed data._target_ (launcher/launch/checks.py)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def test_a_hub_id_neither_cached_nor_reachable_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing serves: the hub "does not answer", here and on any CI machine
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    out = run_cli("+exp=bert", "model.pretrained=bert-base-uncased", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                  HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"))  # (an empty cache)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: model.pretrained=bert-base-uncased: not in this machine's Hugging Face cache, and "
                           "the hub does not answer (") and line.endswith(
        "download it where the hub answers (hf download bert-base-uncased), or give a local dir written by "
        "save_pretrained"), line
    assert not (tmp_path / "run").exists()
