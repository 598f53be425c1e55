"""torch features newer than the supported floor (torch 2.6), detected once at import, with their fallbacks.

Every feature is found by looking at the installed torch (a parser's flags, a signature), not by its
version string (but for the flight recorder's environment variables, which Python cannot see), and each
fallback says in one line at launch what the user loses. The fallbacks run on
every CI run with the newer features hidden: tests/test_torch_floor.py. Used by the parent (torchrun's
flags) and the workers (DDP's arguments).

Everything else the launcher calls was checked in torch 2.6.0's own sources and is there: get_total_norm
and clip_grads_with_norm_, init_process_group(device_id=<torch.device>), GradScaler("cpu"/"cuda"),
fused Adam/AdamW/SGD on CPU and CUDA taking found_inf, torch.cuda.get/set_rng_state(device),
set_sync_debug_mode, torch.load(weights_only=True), SignalException(msg, sigval), the agent's
TORCHELASTIC_* variables, _set_pg_timeout. CI also runs the math, CLI and resume tests on 2.6.0 itself.
"""
from __future__ import annotations

import inspect
import os
import signal
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

import torch
import torch.distributed.distributed_c10d
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.nn.parallel import DistributedDataParallel as DDP

TORCHRUN_FLAGS = frozenset(flag for action in torchrun.get_args_parser()._actions for flag in action.option_strings)
# torchrun --signals-to-handle (torch 2.10): which signals the agent relays to the workers. Before it, the
# agent handles exactly these four (PContext.start) and the launcher relays any other one itself.
TORCHRUN_SIGNALS_TO_HANDLE = "--signals-to-handle" in TORCHRUN_FLAGS
TORCHRUN_DEFAULT_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
# torchrun --shutdown-timeout (torch 2.12): how long workers may take after a relayed signal. Before it,
# the agent sends SIGKILL after a fixed 30 s (PContext.close's default), whatever the config says.
TORCHRUN_SHUTDOWN_TIMEOUT = "--shutdown-timeout" in TORCHRUN_FLAGS
TORCHRUN_FIXED_SHUTDOWN_S = 30

# DDP forward_sync_buffers=False (torch 2.13): buffers are broadcast at init, never per forward. The older
# spelling, broadcast_buffers=False, skips the init broadcast too (deprecated from 2.14 on); nothing is lost
# here, since every rank builds its buffers from the same seed, or loads them from the same checkpoint.
DDP_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                              else {"broadcast_buffers": False})

# torch.compiler.save_cache_artifacts / load_cache_artifacts (torch 2.7): compiled graphs and kernels as bytes,
# loadable into any inductor cache. Before it, a run with a TORCHINDUCTOR_CACHE_DIR of the user's own keeps no copy
# in its run dir (launcher/train/compile_cache.py); the run dir's own cache, the default, works on every torch.
COMPILE_CACHE_ARTIFACTS = hasattr(torch.compiler, "save_cache_artifacts")

# NCCL's flight recorder (each rank's last collectives, dumped when one times out) reads C++ environment
# variables, which no Python signature shows: these go by version, as found in each wheel's libtorch. 2.6 and
# 2.7 read TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE; 2.8 on read TORCH_FR_BUFFER_SIZE
# and TORCH_FR_DUMP_TEMP_FILE (and the old names, with a warning). The buffer holds 0 entries unless set
# before 2.11 (2000 from then on): nothing recorded, nothing dumped.
FLIGHT_RECORDER_BUFFER_SIZE, FLIGHT_RECORDER_DUMP_FILE = (
    ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if torch.__version__ >= (2, 8)
    else ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))

# Changing a process group's timeout once it exists (a private helper, in 2.6 through 2.14): start-up gets
# dist.startup_timeout_s, training dist.timeout_s. Without it, dist.timeout_s holds from the start.
SET_PG_TIMEOUT = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)

# FSDP2 on CPU ranks (strategy=fsdp with launcher.device=cpu): fully_shard records events on the CPU's stream, which
# has record_event/wait_event from torch 2.7 on (pytorch#145935); 2.6 fails in the first forward. GPU ranks have it.
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")


def torchrun_signal_args(signals: list[signal.Signals]) -> list[str]:
    """`--signals-to-handle=...` where torchrun has it: the agent then relays `signals` to the workers."""
    if not TORCHRUN_SIGNALS_TO_HANDLE:
        return []
    return [f"--signals-to-handle={','.join(sorted(s.name for s in {*TORCHRUN_DEFAULT_SIGNALS, *signals}))}"]


def torchrun_shutdown_args(shutdown_timeout_s: int) -> list[str]:
    return [f"--shutdown-timeout={shutdown_timeout_s}"] if TORCHRUN_SHUTDOWN_TIMEOUT else []


def fallback_notes(signals: list[signal.Signals], shutdown_timeout_s: int) -> list[str]:
    """One line per torchrun feature this torch lacks: what the run does instead, and what that costs."""
    notes = []
    extra = sorted(s.name for s in set(signals) - TORCHRUN_DEFAULT_SIGNALS)
    if extra and not TORCHRUN_SIGNALS_TO_HANDLE:
        notes.append(f"note: torch {torch.__version__}'s torchrun relays only SIGTERM/SIGINT/SIGHUP/SIGQUIT "
                     f"(--signals-to-handle is torch 2.10+); the launcher relays {'/'.join(extra)} to the "
                     f"workers itself, so preemption works the same")
    if not TORCHRUN_SHUTDOWN_TIMEOUT and shutdown_timeout_s != TORCHRUN_FIXED_SHUTDOWN_S:
        notes.append(f"note: torch {torch.__version__}'s torchrun has no --shutdown-timeout (torch 2.12+): after "
                     f"a preemption signal the workers get its fixed {TORCHRUN_FIXED_SHUTDOWN_S} s to finish two steps and "
                     f"checkpoint, not launcher.shutdown_timeout_s={shutdown_timeout_s}")
    return notes


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    # What torchrun's own handler does: the agent catches it, sends the same signal to every worker and
    # waits for them (their checkpoint), then re-raises it to the caller.
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


@contextmanager
def relay_signals(signals: list[signal.Signals]) -> Iterator[None]:
    """Around torchrun's agent: each of `signals` raises SignalException from the start, as torchrun's handlers
    do once its workers run (the agent installs them only then: a SIGTERM in the rendezvous was the caller's
    to keep or to die of). The agent relays it to the workers; before torch 2.10 its own handlers cover only
    TORCHRUN_DEFAULT_SIGNALS, and this one the rest. Afterwards every handler is as it was before: torchrun's
    outlive its agent, and would raise wherever the process is then (between the points of a local sweep)."""
    previous = {sig: signal.getsignal(sig) for sig in {*signals, *TORCHRUN_DEFAULT_SIGNALS}}
    for sig in signals:
        signal.signal(sig, _raise_signal_exception)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
