"""A launcher or worker process's start and end: its imports pay for no garbage collection (launcher/startup_gc.py),
and its exit skips the module teardown yet finishes what sys.exit finishes (launcher/process_exit.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from launcher.process_exit import exit_without_teardown

out = Path(sys.argv[1])
pool = ThreadPoolExecutor(1)  # its worker waits for work until the pools' exit hook ends it (MLflow's async log)
pool.submit(lambda: (time.sleep(0.3), (out / "pooled").write_text("done")))
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
atexit.register(lambda: (out / "atexit").write_text("done"))
print("unflushed", end="")
exit_without_teardown(3)
"""


def test_an_exit_without_teardown_waits_for_threads_runs_exit_handlers_and_flushes(tmp_path: Path) -> None:
    """A thread pool's pending task and a thread that is no daemon finish, the exit handlers run, what was printed
    comes out, and the exit code is the one asked for (an exit that skipped these lost tracker writes)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "unflushed"
    assert {p.name for p in tmp_path.iterdir()} == {"pooled", "thread", "atexit"}


# Runs a module as `python -m` would, counting the full collections before the start-up's objects were frozen
START = """
import atexit, gc, runpy, sys
before_freeze = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and not gc.get_freeze_count()
                    and before_freeze.append(info))
atexit.register(lambda: print("gc:", len(before_freeze), gc.get_freeze_count(), gc.isenabled()))
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except BaseException:
    pass
"""


@pytest.mark.parametrize("argv", [["launcher", "--help"], ["launcher.train.worker", "/nonexistent/config.yaml"]],
                         ids=["launcher", "worker"])
def test_start_up_imports_run_no_full_collection_and_are_frozen_then_collection_resumes(argv: list[str]) -> None:
    """torch's and dynamo's imports ran five full collections in each worker (0.7 s of its start, freeing a few
    hundred objects) and made each later one scan them all (0.3 s): 25% of a 2-rank toy launch's CPU time here.
    Now none runs before the imported objects are frozen, and the collector is on again after."""
    out = subprocess.run([sys.executable, "-c", START, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    full_collections, frozen, enabled = out.stdout.split("gc:")[-1].split()
    assert (int(full_collections), int(frozen) > 100_000, enabled) == (0, True, "True"), out.stdout + out.stderr
