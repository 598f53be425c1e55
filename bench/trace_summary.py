"""A torch.profiler Chrome trace in a few lines: per step, the GPU's busy time and kernels, and the kernels
that took the most time (on the CPU, the ops). For comparing the launcher's profiled steps
(`train.profile=[a,b]`) with the raw loop's (`bench/raw_ddp.py --profile FILE`, which writes FILE.json too)
kernel by kernel: the same busy time and a longer step means the host, not the GPU work, differs.
Run: python bench/trace_summary.py TRACE.json [--top 25]
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP = re.compile(r"step \d+$")  # the launcher's and raw_ddp.py's record_function around each profiled step


def summary(trace: Path, top: int = 25) -> str:
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and STEP.match(e.get("name", ""))]
    if not steps:
        raise SystemExit(f"{trace}: no 'step N' marks; profile with train.profile or bench/raw_ddp.py --profile")
    n = len(steps)
    wall = sum(e["dur"] for e in steps) / n / 1e3
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    rows = device or [e for e in events if e.get("cat") == "cpu_op"]  # no GPU: the ops (time with children)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in rows:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    lines = [f"{trace.name}: {n} steps, {wall:.1f} ms per step on the host (step start to end, as recorded)"]
    if device:
        busy = covered(device) / n / 1e3
        span = (max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)) / n / 1e3
        lines.append(f"GPU: busy {busy:.1f} ms per step in {len(device) / n:.0f} kernels and copies; from the first "
                     f"to the last kernel {span:.1f} ms per step ({100 * busy / span:.0f}% busy)")
    lines.append(f"{'ms/step':>9} {'calls/step':>10}  {'kernel' if device else 'CPU op (with what it calls)'}")
    for name, (total, calls) in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"{total / n / 1e3:9.2f} {calls / n:10.1f}  {name[:110]}")
    return "\n".join(lines)


def covered(events: list[dict]) -> float:
    """Microseconds in which at least one of `events` ran: kernels of several streams at once (NCCL beside
    the backward) count once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summary(args.trace, args.top))


if __name__ == "__main__":
    main()
