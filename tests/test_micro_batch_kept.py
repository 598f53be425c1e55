"""train.micro_batch_size=auto's size is kept by the run's next start only where it was found under the same
settings (launcher/train/micro_batch_record.py), with real torchrun + gloo ranks.

The toy job stands in for a device's memory (data.oom_*: rank 1 raises torch.OutOfMemoryError for batches over
data.oom_max_items samples): raising that limit is the run's requeue onto a GPU with more memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch
import torch.distributed as dist

from conftest import read_metrics, run_cli
from launcher.train.micro_batch import MICRO_BATCH_FILE
from launcher.train.micro_batch_record import changed, memory_config

AUTO = ("+exp=toy", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=4", "train.global_batch_size=32",
        "train.micro_batch_size=auto", "train.max_micro_batch_size=8", "data.oom_rank=1",
        "resume.allow_config_change=true")  # (max_steps grows from launch to launch)


def launch(run_dir: Path, *overrides: str) -> str:
    out = run_cli(*AUTO, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def sizes(run_dir: Path) -> list[int]:
    return [m["micro_batch_size"] for m in read_metrics(run_dir) if "eval" not in m]


def test_what_a_size_was_found_under_compares_as_its_record_reads_back(tmp_path: Path) -> None:
    """A config's int keys (a label map) read back from micro_batch.json as strings: no change, and no crash; seven
    changed settings are named four and a count."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        config = {"model": {"id2label": {0: "neg", 1: "pos"}, "hidden": 8}, "train": {"compile": False},
                  "strategy": {"name": "fsdp"}, "data": {"max_length": 128}}
        now = memory_config(config, 2, torch.device("cpu"))
        assert changed(json.loads(json.dumps(now)), now) == "" and (now["devices"], now["world_size"]) == (["cpu"], 2)
        other = memory_config({**config, "model": {"id2label": {0: "no"}, "hidden": 4}, "data": {"max_length": 512},
                               "train": {"compile": True}, "precision": {"name": "bf16"}}, 4, torch.device("cpu"))
        assert changed(now, other) == "data.max_length, model.hidden, model.id2label.0, model.id2label.1 and 3 more"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_size_found_under_other_settings_is_probed_again(tmp_path: Path) -> None:
    """Rank 1 holds 4: the probe takes 4. The same settings keep it (a restart does not probe again); once rank 1
    holds 8, neither micro_batch.json's size nor the checkpoint's is kept, each says why, and the probe takes 8."""
    run_dir = tmp_path / "run"
    log = launch(run_dir, "data.oom_max_items=4", "train.max_steps=4")
    assert "micro-batch 4, accumulation 4 (train.micro_batch_size=auto: tried rank 0: 8 fits; rank 1: 8 out of " \
           "memory, 4 fits" in log
    found_under = json.loads((run_dir / MICRO_BATCH_FILE).read_text())["found_under"]
    assert (found_under["data"]["oom_max_items"], found_under["devices"], found_under["world_size"]) == (4, ["cpu"], None)

    log = launch(run_dir, "data.oom_max_items=4", "train.max_steps=8")
    assert "resumed from step 4" in log and f"micro-batch 4, accumulation 4 (train.micro_batch_size=auto: kept from " \
                                            f"{MICRO_BATCH_FILE}: tried rank 0" in log and "trying the sizes again" not in log

    log = launch(run_dir, "data.oom_max_items=8", "train.max_steps=12")
    assert "resumed from step 8" in log
    assert "train.micro_batch_size=auto: trying the sizes again: micro-batch 4 of micro_batch.json was found before " \
           "data.oom_max_items changed; micro-batch 4 of the checkpoint was found before data.oom_max_items changed\n" in log
    assert "micro-batch 8, accumulation 2 (train.micro_batch_size=auto: tried rank 0: 8 fits; rank 1: 8 fits" in log
    assert sizes(run_dir) == [4] * 8 + [8] * 4
    record = json.loads((run_dir / MICRO_BATCH_FILE).read_text())
    assert (record["micro_batch_size"], record["found_under"]["data"]["oom_max_items"]) == (8, 8)
