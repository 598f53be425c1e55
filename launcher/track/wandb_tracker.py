"""Weights & Biases: one run per training run, its id chosen by the parent and kept in trackers.json, so
every start of the workers (relaunch, torchrun restart, Slurm requeue) continues it; a sweep's points share
a group. Offline by default (files under <run_dir>/wandb/, uploaded later by `wandb sync`).

A start that follows lost steps (a crash after the last checkpoint) rewinds the run to the resumed step
(W&B's resume_from=<id>?_step=<step>), so the steps logged again replace the lost ones; where the server
cannot rewind, the run is resumed as it is and a warning says that W&B keeps the first value of those steps.
Exercised by: `python -m launcher +exp=toy logger=[wandb]`.
"""
from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

from launcher.redact import redact, redacted
from launcher.derived import ConfigError
from launcher.track.protocol import PACKAGES, Resume, Tracker, run_tags, summary_scalars


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"logger=wandb needs the wandb package: pip install {PACKAGES['wandb']} (or pip install "
                          f"-e '.[wandb]'), or drop wandb from logger=[...]") from None
    return wandb


def check_login(settings: dict[str, Any]) -> None:
    """Online needs an API key the server accepts (WANDB_API_KEY or `wandb login`); offline needs nothing."""
    wandb = _wandb()
    if settings["mode"] != "online":
        return
    try:
        ok = wandb.login(prompt=False, verify=True, timeout=20)
    except Exception as err:
        reason = redact("", (str(err).strip().splitlines() or [""])[0][:300])
        raise ConfigError(f"logger.wandb.mode=online but W&B does not accept the login ({type(err).__name__}: "
                          f"{reason}); set WANDB_API_KEY or run `wandb login`, or use logger.wandb.mode=offline"
                          ) from None
    if not ok:
        raise ConfigError("logger.wandb.mode=online but no W&B API key is set; set WANDB_API_KEY or run `wandb "
                          "login`, or use logger.wandb.mode=offline")


def open_run(entry: dict[str, Any] | None, name: str, group: str | None) -> dict[str, Any]:
    """trackers.json's entry: the recorded run id, or a new one (W&B makes the run at rank 0's first start)."""
    return {"id": (entry or {}).get("id") or secrets.token_hex(4), "name": name, "group": group}


class WandbTracker(Tracker):
    """Rank 0's side: init (resume, or rewind after lost steps), log each logged step, finish."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], settings: dict[str, Any], entry: dict[str, Any],
                 resume: Resume):
        wandb = _wandb()
        self.run_dir, self.settings, self.config = run_dir, settings, config
        tags = [f"{k}:{v}"[:64] for k, v in run_tags(run_dir, config).items()]  # W&B's limit on a tag
        # No git or code capture (the tags name the commit; a remote URL may hold a token), no console
        # capture (the run's output is in its log already).
        options = dict(project=settings.get("project") or config["name"], entity=settings.get("entity"),
                       group=entry.get("group"), name=entry["name"], tags=tags, dir=str(run_dir),
                       mode=settings["mode"], job_type="train", config=redacted("", config),
                       allow_val_change=True,  # resume.allow_config_change=true may have changed some
                       settings=wandb.Settings(disable_git=True, save_code=False, console="off", silent=True))
        self.rewound = False
        if resume.lost:
            try:
                self.run = wandb.init(resume_from=f"{entry['id']}?_step={resume.step}", **options)
                self.rewound = True
            except Exception as err:  # a server without rewind: resume the run as it is
                print(f"warning: W&B could not rewind run {entry['id']} to step {resume.step} "
                      f"({type(err).__name__}); it keeps the first value of each step logged again",
                      file=sys.stderr, flush=True)
        if not self.rewound:
            self.run = wandb.init(id=entry["id"], resume="allow", **options)

    def log(self, step: int, scalars: dict[str, float], kind: str) -> None:
        prefix = "" if kind == "train" else f"{kind}/"
        self.run.log({f"{prefix}{k}": v for k, v in scalars.items()}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary_scalars(summary).items()})
        if summary.get("checkpoint"):
            self.run.summary["checkpoint"] = summary["checkpoint"]
        if self.settings.get("artifacts"):
            import wandb
            from omegaconf import OmegaConf

            files = wandb.Artifact(f"run-{self.run.id}", type="model")
            with files.new_file("config.yaml") as f:  # the config without its secrets
                f.write(OmegaConf.to_yaml(OmegaConf.create(redacted("", self.config))))
            files.add_file(str(self.run_dir / "summary.json"))
            if summary.get("checkpoint"):
                files.add_dir(summary["checkpoint"], name="checkpoint")
            self.run.log_artifact(files)
        self.run.finish(exit_code=0)

    def preempted(self, step: int) -> None:
        self.run.mark_preempting()  # requeued: the next start continues this run
        self.run.finish(exit_code=1)

    def close(self) -> None:
        self.run.finish()  # a no-op once finished
