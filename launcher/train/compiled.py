"""torch.compile of the trained module (train.compile_*), and what it did: graphs, graph breaks, recompiles.

A compiled model that keeps recompiling (shapes or module state that change) or breaks its graph (code
dynamo cannot trace) can be slower than eager without a word from torch until its recompile limit. The
loop reads dynamo's own counters at log steps (host-side Python, no GPU wait), puts them in the metrics,
and says when and why it compiled again; under train.compile=auto, also the code it failed to compile, which
trains eagerly (EagerFallbacks). Exercised by: `python -m launcher +exp=bert train.compile=true`.
"""
from __future__ import annotations

import logging
import os
import re
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._dynamo.exc import TorchDynamoException, Unsupported, UserError

from launcher.derived import CUDA_GRAPH_MODES, ConfigError

CONVERT_FRAME = os.path.join("torch", "_dynamo", "convert_frame.py")  # where dynamo turns a frame into graphs
TORCH_DIR = os.path.dirname(torch.__file__)


def compile_module(model: torch.nn.Module, mode: str | None, dynamic: bool | None, fullgraph: bool,
                   ddp_split: bool | None = None) -> torch.nn.Module:
    """The module DDP wraps: DDP's gradient hooks stay on the parameters, so gradients are still
    synchronized (compiling ddp.module after wrapping is what breaks it, pytorch#109774).

    ddp_split=False compiles one graph where dynamo's DDPOptimizer would cut it at every gradient bucket
    (14 pieces for BERT-base): fusion then spans the whole model, and DDP's C++ reducer all-reduces the
    buckets as the one backward finishes. The cuts exist for overlap across ranks; one GPU has nothing to
    overlap. dynamo reads the setting when it compiles the first forward; it is global in this process, as
    the one model it trains."""
    if ddp_split is not None:
        torch._dynamo.config.optimize_ddp = ddp_split  # a bool on every torch since 2.0
    return torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph)


def compile_blocks(found: list[torch.nn.Module], train: Any, sharded: bool) -> None:
    """Each block's forward compiled in place (strategy=fsdp; train.compile_scope=block under DDP), the regional
    compilation of torch's recipes and torchtitan: the layers of a stack run one code, and their weights are the
    graph's inputs (dynamo inlines torch.nn modules), so dynamo traces and inductor compiles one layer, which every
    layer then runs: a cold compile and a restart's trace cost one layer's time, not the stack's. Names and
    state_dict keys stay. Inside DDP's forward dynamo would also cut each block at DDP's buckets (DDPOptimizer):
    here the block is the unit, and DDP all-reduces its buckets as the blocks' backwards end. dynamo leaves
    torch's own modules (the each-Linear rule of launcher/train/sharding.py) eager: such blocks are refused."""
    builtin = sorted({type(m).__name__ for m in found if type(m).__module__.startswith("torch.")})
    if builtin:
        why, other = (("strategy=fsdp", "use train.compile=false") if sharded else
                      ("train.compile_scope=block", "drop train.compile_scope (the whole model compiles)"))
        raise ConfigError(f"train.compile=true with {why} compiles each block, and {'/'.join(builtin)} is torch's own "
                         f"module, which torch.compile leaves eager; name a block class of the model with "
                         f"strategy.block=<class name>, or {other}")
    torch._dynamo.config.optimize_ddp = False
    for module in found:  # (train: the config's train.compile_* keys)
        module.compile(mode=train.compile_mode, dynamic=train.compile_dynamic, fullgraph=train.compile_fullgraph)


def cannot_compile(device: torch.device) -> str | None:
    """train.compile=auto: why this machine cannot compile, or None. A small function's forward and backward
    compiled on the device finds a toolchain inductor lacks (Triton for a GPU, a C++ compiler for the CPU) in a
    second or two, then cached. The counters are cleared after it: they count the model's compiles only."""
    from torch._dynamo import utils

    try:
        probe = torch.ones(8, device=device, requires_grad=True)
        torch.compile(lambda t: (t.sin() * 2).sum(), fullgraph=True)(probe).backward()
        return None
    except Exception as error:
        cause, what = what_failed(error)
        return f"{type(cause).__name__}: {what}"
    finally:
        utils.counters.clear()


@contextmanager
def failures_in_one_line(compiling: bool, fullgraph: bool) -> Iterator[None]:
    """torch.compile's report spans a screen, and the launcher shows the last line of a rank's error: make
    that line say what failed and where. Other errors pass through as they are."""
    try:
        yield
    except Exception as error:
        if not (compiling and compile_failure(error)):
            raise
        raise RuntimeError(failure_line(error, fullgraph)) from error


def compile_failure(error: BaseException) -> bool:
    """Did `error` come from compiling? torch 2.6 raises some internal errors unwrapped: those still pass
    through dynamo's frame conversion. (eval_frame.py alone is on the stack of every compiled call, and of
    torch functions that turn dynamo off: an error there is the code's, not the compiler's.)"""
    if isinstance(error, TorchDynamoException):
        return True
    return any(frame.f_code.co_filename.endswith(CONVERT_FRAME) for frame, _ in traceback.walk_tb(error.__traceback__))


def what_failed(error: BaseException) -> tuple[BaseException, str]:
    """The inner error, where torch wraps one, and the first line of what it says (its type where it says nothing)."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip() and not line.strip().endswith("raised:")]
    return cause, (lines[0] if lines else type(cause).__name__)[:200]


def user_place(error: BaseException) -> str:
    """ at <file>:<line>: the line of the user's code that dynamo names in its error, or ''."""
    text = str(error)
    user_code = text.split("from user code:")[-1] if "from user code:" in text else ""
    places = [(f, n) for f, n in re.findall(r'File "([^"]+)", line (\d+)', user_code) if not f.startswith(TORCH_DIR)]
    return f" at {places[-1][0]}:{places[-1][1]}" if places else ""


def failure_line(error: BaseException, fullgraph: bool) -> str:
    """What went wrong (the inner error, where torch wraps one) and where in the user's code."""
    _, what = what_failed(error)
    where = user_place(error)
    if fullgraph and isinstance(error, (Unsupported, UserError)):  # UserError is an Unsupported only in older torch
        return (f"train.compile_fullgraph=true and torch.compile met a graph break{where}: {what}; make that "
                f"code traceable, or drop train.compile_fullgraph (the break then runs that code eagerly)")
    return (f"torch.compile failed{where}: {what}; train without train.compile=true, or set "
            f"TORCHDYNAMO_VERBOSE=1 for torch's whole report")


class EagerFallbacks(logging.Filter):
    """train.compile=auto: what dynamo fails to compile runs eagerly (torch._dynamo.config.suppress_errors), and
    dynamo logs each such failure with its whole traceback (about 190 lines for an op it cannot trace), on every
    rank. Each is kept as one line for the next log's warnings (CompileWatch); TORCHDYNAMO_VERBOSE=1 keeps torch's."""

    LOGGER = "torch._dynamo.convert_frame"  # where dynamo says "WON'T CONVERT <code> <file> line <n>"

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        # (below WARNING: a graph break's code that dynamo skips, told as a graph break; verbose: torch's report)
        if record.levelno < logging.WARNING or not record.exc_info or torch._dynamo.config.verbose:
            return True
        try:  # (an error in a filter would escape dynamo's suppression: the record then goes out as torch wrote it)
            said = re.match(r"WON'T CONVERT (\S+) (.+) line (\d+)", record.getMessage())
            if not said:
                return True
            error = record.exc_info[1]
            where = user_place(error) or f" at {said[2]}:{said[3]}"  # the line in the code dynamo gave up on
            self.failures.append(f"{said[1]}{where}: {what_failed(first_cause(error))[1]}")
            return False
        except Exception:
            return True

    def take(self) -> list[str]:
        """The failures kept since the last take."""
        taken, self.failures = self.failures, []
        return taken


def first_cause(error: BaseException) -> BaseException:
    """The first error that is not dynamo's, inside dynamo's: those say little ("RuntimeError when making fake tensor
    call" where an op has no fake implementation, which the error they were raised while handling names)."""
    for _ in range(8):  # (a few deep at most)
        inner = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
        if not isinstance(error, TorchDynamoException) or inner is None:
            break
        error = inner
    return error


def eager_where_compiling_fails() -> EagerFallbacks:
    """train.compile=auto chose to compile: code that dynamo fails to compile trains eagerly, said in one line."""
    torch._dynamo.config.suppress_errors = True
    fallbacks = EagerFallbacks()
    logging.getLogger(EagerFallbacks.LOGGER).addFilter(fallbacks)
    return fallbacks


def compiled_graphs() -> int:
    """The graphs dynamo compiled in this process so far (what the compile cache keeps, what the metrics count)."""
    from torch._dynamo import utils

    return utils.counters["stats"].get("unique_graphs", 0)


class CompileWatch:
    """This rank's compile counters since the last log; a no-op without train.compile. `fallbacks`: under
    train.compile=auto, the code that trains eagerly as dynamo failed to compile it."""

    def __init__(self, enabled: bool, mode: str | None = None, fallbacks: EagerFallbacks | None = None):
        self.enabled, self.cuda_graphs, self.fallbacks = enabled, mode in CUDA_GRAPH_MODES, fallbacks
        self.graphs, self.breaks, self.failures, self.skips = 0, {}, {}, 0
        self.first_log = True  # the first interval compiles by design

    def read(self) -> dict[str, Any]:
        """What this rank compiled since the last read: counts so far, and new break/recompile reasons."""
        if not self.enabled:
            return {}
        from torch._dynamo import utils

        graphs, breaks = compiled_graphs(), dict(utils.counters["graph_break"])
        pieces = utils.counters["aot_autograd"].get("total", 0)  # graphs after DDPOptimizer's cuts, each compiled
        failures = getattr(utils, "guard_failures", {})  # recompile reasons by code; read leniently
        new_breaks = [reason for reason in breaks if reason not in self.breaks]
        # A recompile appends the reason each older cache entry of that code failed; the last one is enough.
        recompiled = [reasons[-1] for code, reasons in failures.items() if len(reasons) > self.failures.get(code, 0)]
        # graph_breaks: distinct reasons (dynamo counts a break again each time it compiles that code)
        # graphs and joint graphs found in inductor's and AOT autograd's caches (launcher/train/compile_cache.py)
        hits = utils.counters["inductor"].get("fxgraph_cache_hit", 0) + utils.counters["aot_autograd"].get(
            "autograd_cache_hit", 0)
        report = {"compiled_graphs": graphs, "compiled_pieces": pieces, "graph_breaks": len(breaks),
                  "compile_cache_hits": hits,
                  "new_graphs": graphs - self.graphs, "new_breaks": new_breaks, "recompiled": recompiled,
                  "first_log": self.first_log,
                  "new_fallbacks": self.fallbacks.take() if self.fallbacks else []}
        if self.cuda_graphs:  # graphs that inductor could not capture as CUDA graphs run like mode=default
            skips = utils.counters["inductor"].get("cudagraph_skips", 0)
            report.update(cudagraph_skips=skips, new_skips=skips - self.skips)
            self.skips = skips
        self.graphs, self.breaks = graphs, breaks
        self.failures = {code: len(reasons) for code, reasons in failures.items()}
        self.first_log = False
        return report


def combine(reports: list[dict[str, Any]]) -> tuple[dict[str, int], list[str]]:
    """Every rank's read() as log scalars (the most any rank compiled or broke: one slow rank slows all)
    and warnings, one per new reason."""
    if not reports or not reports[0]:
        return {}, []
    keys = ("compiled_graphs", "compiled_pieces", "graph_breaks", "compile_cache_hits", "cudagraph_skips")
    scalars = {key: max(r[key] for r in reports) for key in keys if key in reports[0]}
    warnings, seen = [], set()
    for rank, report in enumerate(reports):
        if report.get("new_skips") and "skips" not in seen:
            seen.add("skips")
            warnings.append(f"warning: torch.compile captured no CUDA graph for {report['new_skips']} graph(s) on rank "
                            f"{rank}, which run like train.compile_mode=default; TORCH_LOGS=perf_hints says why (a "
                            f"CPU device or tensor, an input changed in place, dynamic shapes)")
        for failure in report["new_fallbacks"]:
            code_and_line = failure.split(": ", 1)[0]  # (what failed may name the rank's own GPU)
            if code_and_line not in seen:
                seen.add(code_and_line)
                warnings.append(f"warning: train.compile=auto: torch.compile failed on rank {rank} in {failure}; "
                                f"that code trains eagerly; train.compile=false says so at once, train.compile=true "
                                f"makes it an error, TORCHDYNAMO_VERBOSE=1 shows torch's report")
        for reason in report["new_breaks"]:
            if reason not in seen:
                seen.add(reason)
                warnings.append(f"warning: torch.compile breaks the model's graph on rank {rank} "
                                f"({_first_line(reason)}): each break runs the code between graphs eagerly, "
                                f"and train.compile_fullgraph=true makes it an error; TORCH_LOGS=graph_breaks "
                                f"shows where")
        # The first interval compiles by design; a new break's graphs are told by its own warning.
        if report["new_graphs"] and not report["first_log"] and (report["recompiled"] or not report["new_breaks"]):
            reason = report["recompiled"][-1] if report["recompiled"] else "a new code path"
            if reason not in seen:
                seen.add(reason)
                warnings.append(f"warning: torch.compile compiled {report['new_graphs']} more graph(s) on rank "
                                f"{rank} since the last log ({report['compiled_graphs']} in all; "
                                f"{_first_line(reason)}): every compile stalls all ranks, and past dynamo's "
                                f"recompile limit (8 per function by default) that code runs eagerly; for shapes "
                                f"that change, train.compile_dynamic=true compiles them dynamic from the start, "
                                f"and a text job's data.pad_to_multiple_of (64, or '${{data.max_length}}') makes "
                                f"fewer of them; train.compile=false trains eagerly; TORCH_LOGS=recompiles shows "
                                f"each reason")
    return scalars, warnings


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0][:200]
