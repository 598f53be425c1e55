"""torch.compile of the trained module (train.compile_*), and what it did: graphs, graph breaks, recompiles.

A compiled model that keeps recompiling (shapes or module state that change) or breaks its graph (code
dynamo cannot trace) can be slower than eager without a word from torch until its recompile limit. The
loop reads dynamo's own counters at log steps (host-side Python, no GPU wait), puts them in the metrics,
and says when and why it compiled again. Exercised by: `python -m launcher +exp=bert train.compile=true`.
"""
from __future__ import annotations

import re
import traceback
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException, Unsupported, UserError

from launcher.derived import CUDA_GRAPH_MODES


def compile_module(model: torch.nn.Module, mode: str | None, dynamic: bool | None,
                   fullgraph: bool) -> torch.nn.Module:
    """The module DDP wraps: DDP's gradient hooks stay on the parameters, so gradients are still
    synchronized (compiling ddp.module after wrapping is what breaks it, pytorch#109774)."""
    return torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph)


def compile_failure(error: BaseException) -> bool:
    """Did `error` come from torch.compile? Older torch raises some of its internal errors unwrapped."""
    if isinstance(error, TorchDynamoException):
        return True
    return any(part in frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)
               for part in ("/torch/_dynamo/", "/torch/_inductor/"))


def failure_line(error: BaseException, fullgraph: bool) -> str:
    """torch.compile's many-line report as one line: what went wrong and where in the user's code."""
    text = str(error)
    what = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)[:200]
    places = re.findall(r'File "([^"]+)", line (\d+)', text.split("from user code:")[-1])
    where = f" at {places[-1][0]}:{places[-1][1]}" if places and "from user code:" in text else ""
    if fullgraph and isinstance(error, (Unsupported, UserError)):  # UserError is an Unsupported only in older torch
        return (f"train.compile_fullgraph=true and torch.compile met a graph break{where}: {what}; make that "
                f"code traceable, or drop train.compile_fullgraph (the break then runs that code eagerly)")
    return (f"torch.compile failed{where}: {what}; train without train.compile=true, or set "
            f"TORCHDYNAMO_VERBOSE=1 for torch's whole report")


class CompileWatch:
    """This rank's compile counters since the last log; a no-op without train.compile."""

    def __init__(self, enabled: bool, mode: str | None = None):
        self.enabled, self.cuda_graphs = enabled, mode in CUDA_GRAPH_MODES
        self.graphs, self.breaks, self.failures, self.skips = 0, {}, {}, 0
        self.logs = 0

    def read(self) -> dict[str, Any]:
        """What this rank compiled since the last read: counts so far, and new break/recompile reasons."""
        if not self.enabled:
            return {}
        from torch._dynamo import utils

        graphs, breaks = utils.counters["stats"].get("unique_graphs", 0), dict(utils.counters["graph_break"])
        failures = getattr(utils, "guard_failures", {})  # recompile reasons by code; read leniently
        new_breaks = [reason for reason in breaks if reason not in self.breaks]
        # A recompile appends the reason each older cache entry of that code failed; the last one is enough.
        recompiled = [reasons[-1] for code, reasons in failures.items() if len(reasons) > self.failures.get(code, 0)]
        report = {"compiled_graphs": graphs, "graph_breaks": sum(breaks.values()),
                  "new_graphs": graphs - self.graphs, "new_breaks": new_breaks, "recompiled": recompiled,
                  "first_log": self.logs == 0}
        if self.cuda_graphs:  # graphs that inductor could not capture as CUDA graphs run like mode=default
            skips = utils.counters["inductor"].get("cudagraph_skips", 0)
            report.update(cudagraph_skips=skips, new_skips=skips - self.skips)
            self.skips = skips
        self.graphs, self.breaks = graphs, breaks
        self.failures = {code: len(reasons) for code, reasons in failures.items()}
        self.logs += 1
        return report


def combine(reports: list[dict[str, Any]]) -> tuple[dict[str, int], list[str]]:
    """Every rank's read() as log scalars (the most any rank compiled or broke: one slow rank slows all)
    and warnings, one per new reason."""
    if not reports or not reports[0]:
        return {}, []
    keys = ("compiled_graphs", "graph_breaks", "cudagraph_skips")
    scalars = {key: max(r[key] for r in reports) for key in keys if key in reports[0]}
    warnings, seen = [], set()
    for rank, report in enumerate(reports):
        if report.get("new_skips") and "skips" not in seen:
            seen.add("skips")
            warnings.append(f"warning: torch.compile captured no CUDA graph for {report['new_skips']} graph(s) on rank "
                            f"{rank}, which run like train.compile_mode=default; TORCH_LOGS=perf_hints says why (a "
                            f"CPU device or tensor, an input changed in place, dynamic shapes)")
        for reason in report["new_breaks"]:
            if reason not in seen:
                seen.add(reason)
                warnings.append(f"warning: torch.compile breaks the model's graph on rank {rank} "
                                f"({_first_line(reason)}): each break runs the code between graphs eagerly, "
                                f"and train.compile_fullgraph=true makes it an error; TORCH_LOGS=graph_breaks "
                                f"shows where")
        if report["new_graphs"] and not report["first_log"]:  # the first interval compiles by design
            reason = report["recompiled"][-1] if report["recompiled"] else "a new code path"
            if reason not in seen:
                seen.add(reason)
                warnings.append(f"warning: torch.compile compiled {report['new_graphs']} more graph(s) on rank "
                                f"{rank} since the last log ({report['compiled_graphs']} in all; "
                                f"{_first_line(reason)}): every compile stalls all ranks, and after "
                                f"torch._dynamo.config.recompile_limit recompiles the code runs eagerly; shapes "
                                f"that change recompile once, then train.compile_dynamic=true keeps them "
                                f"dynamic; TORCH_LOGS=recompiles shows each reason")
    return scalars, warnings


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0][:200]
