"""torch.compile's work kept with the run, so that a restart, a resume or a requeue onto a node whose own cache is
empty loads the compiled kernels instead of compiling them again (train.compile_cache, on by default).

Inductor's cache is content-addressed (each entry's key holds the graph, the torch and Triton versions and the
device), so an entry is never used for another model or machine: a stale one is a miss. Two ways to keep it:
- artifacts (GPU plans, and any plan with a TORCHINDUCTOR_CACHE_DIR of the user's own): the workers compile into
  the machine's cache (or the user's), which runs on one machine share, and the run dir keeps torch's portable
  artifacts (torch.compiler.save_cache_artifacts, torch 2.7 on: graphs, AOT autograd's joint graphs, Triton kernels,
  autotuning results) in compile_cache/torch-<version>/local<N>.bin per local rank, loaded into the cache at the
  next start. A file that does not load is moved aside with one line, and the rank compiles anew.
- run dir (CPU plans, and GPU plans on a torch without artifacts, where the user set no cache dir): the run dir's
  compile_cache/torch-<version>/ is the workers' TORCHINDUCTOR_CACHE_DIR, all of it: CPU kernels are compiled
  libraries that torch's artifacts do not carry.
Exercised by: tests/test_fast_defaults.py.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import suppress
from pathlib import Path
from typing import Callable

import torch

from launcher.compat import COMPILE_CACHE_ARTIFACTS
from launcher.rundir import write_atomically
from launcher.train import USER_INDUCTOR_CACHE

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
CACHE_DIR = "compile_cache"


def cache_root(run_dir: Path) -> Path:
    """This torch's part of the run's compile cache (a torch upgrade between starts begins a new one)."""
    return run_dir / CACHE_DIR / f"torch-{torch.__version__.replace('+', '_')}"


class CompileCache:
    """Where this rank's compiles are cached, set before the first compile; `keep` after new graphs."""

    def __init__(self, run_dir: Path, local_rank: int, device: torch.device, enabled: bool):
        self.kind: str | None = None  # "run dir", "artifacts" or None (off, or nothing this torch can keep)
        self.graphs = 0  # graphs compiled when the artifacts were last written
        self.failed = False  # a write failed: this rank keeps no more (the summary still names the kind)
        if not enabled:
            return
        root = cache_root(run_dir)
        if COMPILE_CACHE_ARTIFACTS and (device.type == "cuda" or USER_INDUCTOR_CACHE is not None):
            self.kind, self.file = "artifacts", root / f"local{local_rank}.bin"
        elif USER_INDUCTOR_CACHE is None:  # inductor reads the variable at each use: set before the first compile
            root.mkdir(parents=True, exist_ok=True)
            os.environ[CACHE_VARIABLE] = str(root)
            self.kind = "run dir"
            if device.type == "cpu":
                _without_precompiled_header()

    def load(self, warn: Callable[[str], None]) -> None:
        """Before the model compiles: the artifacts an earlier start of this run kept, into the machine's cache."""
        if self.kind != "artifacts" or not self.file.is_file():
            return
        torch_log = logging.getLogger("torch.compiler._cache")  # its report of a damaged file is a traceback
        level, why = torch_log.level, "damaged"
        torch_log.setLevel(logging.ERROR)
        try:
            loaded = torch.compiler.load_cache_artifacts(self.file.read_bytes()) is not None
        except Exception as error:  # another format (a torch that changed it): compile anew
            loaded, why = False, f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        finally:
            torch_log.setLevel(level)
        if not loaded:
            aside = self.file.with_name(self.file.name + ".unusable")
            with suppress(FileNotFoundError):  # the same local rank of another node sharing the run dir moved it
                os.replace(self.file, aside)
            warn(f"warning: the compile cache {self.file} did not load ({why}); moved to {aside.name}, compiling anew")

    def keep(self, graphs: int) -> None:
        """After this rank compiled more `graphs` (at log steps, and at a preemption's stop, which may come before
        the first log): keep its artifacts for the next start. The file is this local rank's, replaced whole: no
        collective, and a reader sees an old or a new one (on several nodes sharing the run dir, the same local rank
        of each writes it: each a whole file of the same graphs). A save that fails (a full disk, an error of
        torch's) is said in one line on stderr (this rank's, as load's) and keeps nothing more: the run trains on,
        its next start compiles anew."""
        if self.kind != "artifacts" or self.failed or graphs <= self.graphs:
            return
        try:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is not None:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self.file, artifacts[0])
        except Exception as error:  # (on one rank: it enters no collective here, the others train on too)
            self.failed = True
            said = (str(error).strip().splitlines() or [""])[0][:200]
            print(f"warning: the compile cache {self.file} could not be written ({type(error).__name__}: {said}); "
                  f"training goes on, and this rank's next start compiles anew", file=sys.stderr, flush=True)
            return
        self.graphs = graphs


def _without_precompiled_header() -> None:
    """CPU kernels compile without inductor's precompiled header: it lives in the machine's temp dir, outside any
    cache that moves with the run (about 150 MB, rebuilt on every new node in about 10 s), and its setting is part of
    every cache key; without it, a start whose graphs are all in the run's cache compiles nothing (a cold compile
    takes longer, once)."""
    from torch._inductor import config

    if hasattr(config, "cpp_cache_precompile_headers"):  # where this torch has one
        config.cpp_cache_precompile_headers = False
