"""launcher/process_exit.py: a process that ends without the module teardown still finishes what sys.exit finishes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
