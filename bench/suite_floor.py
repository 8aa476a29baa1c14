"""Print how much of the suite's launch CPU-seconds is the start-up every process pays before doing anything: the
floor that no merge of test code can lower, only fewer processes.

    PYTEST_LAUNCH_LOG=/tmp/launches.json make test          (tests/launch_budget.py writes the log)
    .venv/bin/python bench/suite_floor.py /tmp/launches.json [--rounds 5]

Start-up is measured here, on this machine, now (run it alone: 2 cores): `train.py --help` (every import train.py
makes, the argument parser, no model: what a refusal before loading costs) and the test launcher's import of
`accelerate.commands.launch` (`tests/accelerate_launcher.py --help`: what `accelerate launch` costs before it starts
its ranks), the median of --rounds fresh processes, user + sys CPU-seconds as the kernel counts them for the child.

A launch through the launcher pays one launcher start plus one train.py start per rank on its machine
(num_processes / num_machines of its accelerate config, or --num_processes); train.py or a test worker (which
imports what train.py does, as bench/train_*.py do) run without it, one train.py start. Bench scripts and
run_peft*.sh start a varying number of processes: shown, not modelled. The share moves with the hour the start-up is
measured at against the hour of the log (2026-12-07: 84 % for run 13's log measured 20 minutes after it at the
day's slow hour, 71-75 % for run 15's measured right after it): measure right after the suite, and read it as a range.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import yaml
from suite_launches import _value  # the last value a flag is given: bench/ is this script's path

REPO = Path(__file__).resolve().parents[1]


def child_cpu_seconds(argv: list[str]) -> float:
    """User + sys CPU-seconds of one fresh process (this process waits for nothing else meanwhile)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def start_up_seconds(rounds: int) -> tuple[float, float]:
    python = sys.executable
    train = [python, "train.py", "--help"]
    launcher = [python, "tests/accelerate_launcher.py", "--help"]
    child_cpu_seconds(train)  # the first start reads files from disk; the suite's starts find them cached
    train_s = statistics.median(child_cpu_seconds(train) for _ in range(rounds))
    launcher_s = statistics.median(child_cpu_seconds(launcher) for _ in range(rounds))
    return train_s, launcher_s


def ranks_per_machine(argv: list[str]) -> int:
    config = yaml.safe_load(Path(_value(argv, "--config_file")).read_text()) or {}
    processes = int(_value(argv, "--num_processes") or config.get("num_processes", 1))
    return max(1, processes // int(_value(argv, "--num_machines") or config.get("num_machines", 1)))


def kind_of(argv: list[str]) -> tuple[str, int | None]:
    """What the launch runs, and its ranks per machine (0: one process without the launcher; None: not modelled)."""
    names = [Path(word).name for word in argv]
    program = next((n for n in names[1:] if n == "train.py" or n.endswith("_worker.py") or (
        n.startswith("train_") and n.endswith(".py"))), None)  # bench/train_*.py: train.py with one thing changed
    if program is None:
        return "other programs (not modelled)", None
    program = "train.py" if program == "train.py" else "a test worker or bench/train_*.py"
    if "--config_file" not in argv:
        return f"{program}, one process", 0
    if not Path(_value(argv, "--config_file")).is_file():  # a test's own YAML, gone with pytest's older tmp folders
        return "under the launcher, its config gone (not modelled: run this soon after the suite)", None
    return f"{program} under the launcher", ranks_per_machine(argv)


def tally(records: list[dict], train_s: float, launcher_s: float) -> dict[str, list[float]]:
    """kind -> [launches, processes, measured CPU-s, start-up floor CPU-s]; processes and floor 0 where not modelled."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
    for record in records:
        kind, ranks = kind_of(record["argv"])
        row = rows[kind]
        row[0] += 1
        row[2] += record["cpu_seconds"]
        if ranks is None:
            continue
        row[1] += ranks + 1 if ranks else 1  # the launcher and its ranks, or the one process
        row[3] += launcher_s + ranks * train_s if ranks else train_s
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the PYTEST_LAUNCH_LOG of a suite run")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per start-up measurement (median)")
    args = parser.parse_args()
    records = [r for r in json.loads(Path(args.log).read_text()) if r.get("cpu_seconds") is not None]
    train_s, launcher_s = start_up_seconds(args.rounds)
    print(f"start-up, median of {args.rounds}: train.py {train_s:.2f} CPU-s, accelerate launcher {launcher_s:.2f} "
          f"CPU-s\n")
    rows = tally(records, train_s, launcher_s)
    print("| launches of | launches | processes | measured CPU-s | start-up floor CPU-s | floor / measured |")
    print("|---|---|---|---|---|---|")
    for kind, (launches, processes, measured, floor) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        modelled = f"{processes} | {measured:.0f} | {floor:.0f} | {floor / measured:.0%}" if floor else \
            f"- | {measured:.0f} | - | -"
        print(f"| {kind} | {launches} | {modelled} |")
    modelled = [row for row in rows.values() if row[3]]  # launches priced above; the rest are shown only
    measured, floor = sum(r[2] for r in modelled), sum(r[3] for r in modelled)
    print(f"\nmodelled launches: start-up {floor:.0f} of {measured:.0f} CPU-s ({floor / measured:.0%}); "
          f"all launches {sum(r[2] for r in rows.values()):.0f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
