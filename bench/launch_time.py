"""What a launch costs around its training: a 1-step `+exp=toy` on 2 CPU ranks, from the command to its exit.

Each line of the launcher's output is stamped as it arrives: the first line (the parent's imports, Hydra's
compose, the checks), `rendezvous done` (the workers started and met), `done` (trained, evaluated, saved) and
the exit (the workers' and the parent's ends). Median of --rounds runs, one after the other.
Run: python bench/launch_time.py [--rounds 5] [--ref <git rev>]  (--ref: the same for a checkout of that rev)
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = {"first line": "run dir ", "rendezvous done": "rendezvous done", "done": "done: "}


def one_launch(repo: Path, run_dir: Path) -> dict[str, float]:
    """Seconds from the command to each mark, and to the exit."""
    began = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "+exp=toy", "train.max_steps=1",
                             f"hydra.run.dir={run_dir}"], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    for line in proc.stdout:
        for mark, start in MARKS.items():
            if mark not in seen and line.startswith(start):
                seen[mark] = time.time() - began
    if proc.wait():
        sys.exit(f"the launch failed in {repo}")
    return {**seen, "exit": time.time() - began}


def rounds_of(repo: Path, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as work:
        runs = [one_launch(repo, Path(work) / f"run{i}") for i in range(rounds)]
    return {mark: statistics.median(run[mark] for run in runs) for mark in [*MARKS, "exit"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ref", help="also time a checkout of this git rev (in a temporary worktree)")
    args = parser.parse_args()
    table = {"this tree": rounds_of(REPO, args.rounds)}
    if args.ref:
        with tempfile.TemporaryDirectory() as work:
            tree = Path(work) / "ref"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.ref], cwd=REPO, check=True,
                           capture_output=True)
            try:
                table[args.ref] = rounds_of(tree, args.rounds)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=True)
    print(f"| tree | {' | '.join(f'{mark} (s)' for mark in [*MARKS, 'exit'])} |")
    print(f"|---|{'---|' * (len(MARKS) + 1)}")
    for name, marks in table.items():
        print(f"| {name} | {' | '.join(f'{seconds:.2f}' for seconds in marks.values())} |")


if __name__ == "__main__":
    main()
