"""How a launch ends on a signal when the save it asks for does not come: the agent killed the workers first
(launcher.shutdown_timeout_s), a person pressed Ctrl-C twice, or the signal came before the workers started.
The launcher still exits with the requeue code and names the checkpoint a relaunch resumes from. Exercised
with real launches of the toy job on 2 ranks."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, on_the_cpu_plan, subprocess_env
from helpers import finish, free_port, logged_step, node, start, store, wait_until
from launcher.compat import TORCHRUN_SHUTDOWN_TIMEOUT
from launcher.preempt import REQUEUE_EXIT_CODE
from launcher.rundir import complete_steps

pytestmark = pytest.mark.slow
# Steps of 6 s (2 micro-batches of 3 s), a checkpoint after each: a stop asked for early in step 2 cannot be
# saved before the end of step 2, seconds later
SLOW = ("data.sleep_s=3", "train.ckpt_every=1", "train.max_steps=3")
# A stop waits for step 1's complete checkpoint, not its metrics line: that line comes first, and a stop in between
# kills the background write that would have made the checkpoint (a relaunch then starts over, rightly)


@pytest.mark.skipif(not TORCHRUN_SHUTDOWN_TIMEOUT, reason="torchrun before 2.12 waits a fixed 30 s, not shutdown_timeout_s")
def test_a_preemption_whose_checkpoint_never_came_still_exits_with_the_requeue_code(tmp_path: Path) -> None:
    """A step of 6 s cannot end within launcher.shutdown_timeout_s=1: the agent kills the workers before
    their save. The launcher exited 143 without a word, and a requeue script that
    waits for 75 gave the job up; now the run resumes from its newest checkpoint."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *SLOW, "launcher.shutdown_timeout_s=1")
    wait_until(lambda: 1 in complete_steps(run_dir))
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, REQUEUE_EXIT_CODE)
    assert (f"preempted by SIGTERM before the workers saved a checkpoint (stopped while they started, stopped a "
            f"second time, or their save failed or took longer than launcher.shutdown_timeout_s); run the same "
            f"command again (it continues in {run_dir}; or add hydra.run.dir={run_dir}) to resume from step 1 (exit "
            f"code 75)") in out
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": 1, "signal": 15, "saved": False,
                                                                    "started": True}
    resumed = finish(start(run_dir, "data.sleep_s=0", "train.ckpt_every=1", "train.max_steps=3",
                           "resume.allow_config_change=true"), 0)
    assert "resumed from step 1" in resumed


def test_ctrl_c_twice_stops_at_once_without_the_save(tmp_path: Path) -> None:
    """The first Ctrl-C asks for a checkpoint at the end of the step; the second (the agent relays it as SIGTERM)
    ends the workers at once. Without that, the launcher waited launcher.shutdown_timeout_s (120 s here)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *SLOW)
    wait_until(lambda: 1 in complete_steps(run_dir))
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)  # a repeat within REPEAT_S is Slurm's own delivery, not a person's second Ctrl-C
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    out = finish(proc, REQUEUE_EXIT_CODE)
    assert time.monotonic() - began < 3  # the rest of the step alone takes longer
    assert "stopped by SIGINT before the workers saved a checkpoint" in out and "to resume from step 1" in out


def test_ctrl_c_after_the_last_step_lets_the_run_end(tmp_path: Path) -> None:
    """Ctrl-C in the final eval: there is no step left to stop at, and the workers go on to the final checkpoint
    and summary. The launch said "stopped ... before the workers saved a checkpoint" (exit 75), and left a
    preempted.json and a KILLED tracker run behind a run that was complete."""
    run_dir = tmp_path / "run"
    # rank 0's 13th loss computation is its first eval batch (the eval's probes and loss_sum's at the start, 1 + 4 +
    # 3, 2 steps of 2 micro-batches): 4 s there
    proc = start(run_dir, "train.max_steps=2", "data.stall_rank=0", "data.stall_at_call=13", "data.stall_s=4")
    wait_until(lambda: logged_step(run_dir) >= 2)
    proc.send_signal(signal.SIGINT)
    out = finish(proc, 0)
    assert "the run ended before SIGINT could stop it: nothing to resume" in out
    assert not (run_dir / "preempted.json").exists()
    assert json.loads((run_dir / "summary.json").read_text())["eval"]["loss"] > 0


def test_ctrl_c_in_a_fresh_start_over_an_earlier_summary_still_stops_with_a_save(tmp_path: Path) -> None:
    """An evaluate-only run (train.max_steps=0) left a summary.json and no checkpoint; the training run started
    there deletes it as it starts from step 0, which is no end of the run: its Ctrl-C saves and exits 75."""
    run_dir = tmp_path / "run"
    finish(start(run_dir, "train.max_steps=0"), 0)
    proc = start(run_dir, "train.max_steps=20", "data.sleep_s=0.3")
    wait_until(lambda: logged_step(run_dir) >= 1)
    proc.send_signal(signal.SIGINT)
    assert "stopped by SIGINT: checkpoint saved at step" in finish(proc, REQUEUE_EXIT_CODE)


# sitecustomize of the launcher's process: SIGTERM as soon as the launcher keeps it, in the seconds of its imports
TERM_ONCE_KEPT = """import os, signal, threading, time
if os.environ.pop("TERM_ONCE_KEPT", None):  # this process only, not the workers it would start
    def term():
        while signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=term, daemon=True).start()
"""


def test_a_preemption_before_the_workers_start_exits_with_the_requeue_code(tmp_path: Path) -> None:
    """A scheduler's SIGTERM while the launcher imports, composes and checks ended it with 143 and no word; it is
    kept, the workers never start, and the exit code asks for the requeue. The MLflow run the launcher opened
    ends KILLED, as after a preemption with a save (no rank 0 is there to say so)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(TERM_ONCE_KEPT)
    run_dir = tmp_path / "run"
    proc = start(run_dir, "logger=[tensorboard,mlflow]",
                 env=subprocess_env(TERM_ONCE_KEPT="1", PYTHONPATH=f"{shim}:{REPO}"))
    out = finish(proc, REQUEUE_EXIT_CODE)
    assert (f"preempted by SIGTERM before the workers started; run the same command again (it continues in {run_dir}; or add "
            f"hydra.run.dir={run_dir}) to start over (exit code 75)") in out
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": 0, "signal": 15, "saved": False,
                                                                    "started": False}
    assert not (run_dir / "metrics.jsonl").exists()
    client = store(tmp_path)  # the launcher's embedded default, under its cwd
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert run.info.status == "KILLED"


def test_a_launch_that_starts_no_workers_here_lets_a_kept_signal_act() -> None:
    """launcher=slurm submits (and with launcher.wait, waits): the kept SIGTERM ends the process then, as it
    would have at once; `kill` must still stop a waiting launcher."""
    code = ("import os, signal; from launcher.preempt import early_signal, keep_early_signals, release_early_signals\n"
            "keep_early_signals(); os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('kept', early_signal(), flush=True); release_early_signals(); print('not ended')")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGTERM and out.stdout == "kept 15\n", (out.returncode, out.stdout, out.stderr)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_preemption_while_the_nodes_meet_ends_the_launch(tmp_path: Path) -> None:
    """The first of two nodes waits in the rendezvous (torchrun's handlers come only with the workers): a
    SIGTERM there was kept and the launch went on waiting, then trained. It ends the launch now, as preempted."""
    run_dir, port = tmp_path / "shared", free_port()
    proc = node(run_dir, port)  # the other node never comes
    try:
        # the rendezvous store listens: the agent runs, past the launcher's own check of a kept signal
        wait_until(lambda: listening(port))
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=30)[1]  # (rather than launcher.rdzv_timeout_s, 60 s)
    finally:
        proc.kill()
        proc.communicate()
    code = proc.returncode
    assert code == REQUEUE_EXIT_CODE and "preempted by SIGTERM before the workers saved a checkpoint" in text, text[-2000:]


def test_slurm_s_own_sigint_and_the_agent_s_relay_are_one_ctrl_c() -> None:
    """Slurm gives every process of the step its SIGINT (scancel --signal=INT), the agent relays it too: the two
    a moment apart are one stop with a save; a signal after REPEAT_S is a person's second Ctrl-C."""
    code = ("import os, signal, time; from launcher.preempt import REPEAT_S, StopFlag\n"
            "flag = StopFlag([signal.SIGINT, signal.SIGTERM])\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT)\n"
            "print('one stop', flag.signum, flush=True); time.sleep(REPEAT_S + 0.2)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('not ended')")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + signal.SIGINT and out.stdout == "one stop 2\n", (out.returncode, out.stdout, out.stderr)


def test_ctrl_c_in_a_local_sweep_names_the_sweep_s_command_which_resumes_it(tmp_path: Path) -> None:
    """Ctrl-C in a point of a local -m sweep said `relaunch with hydra.run.dir=<that point's dir>`, which resumes that
    point alone: the sweep's command with its hydra.sweep.dir resumes it, then runs the points after it."""
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "launcher", "-m", *on_the_cpu_plan([
        "+exp=toy", "train.max_steps=30", "train.log_every=1", "train.eval_every=0", "data.sleep_s=0.05",
        "train.seed=0,1", f"hydra.sweep.dir={sweep}"])]
    proc = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_until(lambda: logged_step(sweep / "0") >= 2)
    proc.send_signal(signal.SIGINT)
    out = finish(proc, REQUEUE_EXIT_CODE)
    assert re.search(rf"stopped by SIGINT: checkpoint saved at step \d+; relaunch the sweep's command with "
                     rf"hydra.sweep.dir={sweep} \(its finished points are skipped\) to resume \(exit code 75\)", out), out
    assert not (sweep / "1").exists()
    again = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stdout
    assert [json.loads((sweep / point / "summary.json").read_text())["steps"] for point in "01"] == [30, 30]


def test_ctrl_c_while_the_launcher_or_a_worker_starts_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C in the first seconds (torch's import) printed a KeyboardInterrupt traceback through torch's modules, and
    the workers', if they were importing, interleaved: now the launcher's line, and no run dir. A worker interrupted
    while it imports prints nothing (the launcher says what stopped). Both end by SIGINT. The interrupt comes where
    it did, deterministically: a sitecustomize whose finder raises it at `import torch`."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n\nclass CtrlC:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n            raise KeyboardInterrupt\n\nsys.meta_path.insert(0, CtrlC())\n")
    env = subprocess_env(PYTHONPATH=f"{shim}:{REPO}")
    run_dir = tmp_path / "run"
    for module, said in (("launcher", "stopped by SIGINT before any worker started\n"), ("launcher.train.worker", "")):
        out = subprocess.run([sys.executable, "-m", module, "+exp=toy", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout, out.stderr) == (-signal.SIGINT, "", said), out.stderr[-2000:]
    assert not run_dir.exists()


def test_ctrl_c_on_one_node_is_named_there(tmp_path: Path) -> None:
    """Ctrl-C on the node without rank 0: the run stops with a save, and that node's line said it was preempted by
    "a signal to another rank" (rank 0's record: rank 0 got none). It names the Ctrl-C there, and the other node's
    line still says the stop came from elsewhere."""
    run_dir, port = tmp_path / "shared", free_port()
    slow = ("train.max_steps=400", "train.log_every=1", "data.sleep_s=0.02")
    first, second = node(run_dir, port, "launcher.node_rank=0", *slow), node(run_dir, port, "launcher.node_rank=1", *slow)
    try:
        wait_until(lambda: logged_step(run_dir) >= 2)
        second.send_signal(signal.SIGINT)
        texts = [proc.communicate(timeout=120)[1] for proc in (first, second)]
    finally:
        for proc in (first, second):
            proc.kill()
            proc.communicate()
    assert (first.returncode, second.returncode) == (REQUEUE_EXIT_CODE,) * 2, texts
    assert "preempted by a signal to another rank: checkpoint saved at step" in texts[0], texts[0][-2000:]
    assert "stopped by SIGINT: checkpoint saved at step" in texts[1], texts[1][-2000:]
