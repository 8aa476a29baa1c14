"""The suite's launch budget: every process a test starts is counted and timed, and the suite ends with a table.

A launch of the recipe (`accelerate launch`, `torchrun`, `python train.py`, a worker script, `bash run_peft*.sh`)
costs 10-15 s before its first step on the 2-core machine (imports, the tiny model, data), so the suite's
time is mostly its launches. This plugin (loaded by conftest.py) wraps `subprocess.Popen`, records each child's
command, wall seconds, CPU-seconds (user + sys, its own and its reaped descendants': a launcher's ranks count) and
the test that started it, and prints at the end of the run:

    launches: 41 recipe launches in 612 s (38 distinct), 57 other processes in 40 s
    file                                   launches  seconds    cpu-s
    ...
    CPU-seconds (user + sys): recipe launches 812, other processes 31, the pytest processes themselves 240

The CPU-seconds move less with the machine's hour than the wall seconds do (launches overlap on two workers), and say
what the suite's time is made of: what the launches cost against what the tests do in their own process.

so a new launch is seen the day it is added (docs/testing.md says what one costs and how to avoid one).
`PYTEST_LAUNCH_LOG=path.json` also writes every record, for measuring (bench/suite_launches.py reads it).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

_RECORDS: list[dict] = []
_WORKERS_CPU_SECONDS: list[float] = []
_CURRENT_TEST = {"nodeid": "<collection>"}
# The words that make a child process a launch of the recipe (10-15 s of start-up, docs/testing.md), not a cheap tool.
_RECIPE_WORDS = re.compile(r"(^|/)(train\.py|merge_adapter\.py|[a-z0-9_]+_worker\.py|accelerate|torchrun|"
                           r"accelerate\.commands\.launch|accelerate_launcher\.py|run_peft[a-z0-9_]*\.sh)$")
_PATHISH = re.compile(r"^/(tmp|work|root|home)/")


def is_recipe_launch(argv: list[str]) -> bool:
    """A child that imports the training stack: a launcher, train.py, merge_adapter.py, a worker or a run script
    with the real launcher behind it, or `python -m sft_recipe...`."""
    if any(_RECIPE_WORDS.search(word) for word in argv):
        return True
    return any(a == "-m" and b.startswith("sft_recipe") for a, b in zip(argv, argv[1:]))


def launch_key(argv: list[str]) -> str:
    """What decides a launch's outputs: its words, with the port and output folder left out and every path cut to its
    last name (the tiny bundle of each worker lives elsewhere)."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("--main_process_port", "--master_port", "--rdzv_endpoint", "--output_dir"):
            skip = True  # where it writes and which port it talks on do not change what it computes
            continue
        words.append(Path(word).name if _PATHISH.match(word) else word)
    return " ".join(words)


def recipe_yaml_of(argv: list[str]) -> dict | None:
    """The values of the `--config` recipe YAML a launch names, read as it starts (a test's folder may be gone when
    the log is read); None without one or where it cannot be read."""
    import yaml

    paths = [b for a, b in zip(argv, argv[1:]) if a == "--config"]
    try:
        values = yaml.safe_load(Path(paths[-1]).read_text()) if paths else None
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return values if isinstance(values, dict) else None


class _TimedPopen(subprocess.Popen):
    """Popen that records, once, how long its process lived (from start to the first wait/poll that saw it end)."""

    def __init__(self, args, *rest, **kwargs):
        self._budget_started = time.monotonic()
        self._budget_record = None
        self._budget_cpu_seconds = None
        super().__init__(args, *rest, **kwargs)
        if _CURRENT_TEST["nodeid"] == "<collection>":
            return  # pytest's own processes (xdist's workers, platform's uname), started before any test
        argv = [str(a) for a in ([args] if isinstance(args, str | os.PathLike) else args)]
        self._budget_record = {"test": _CURRENT_TEST["nodeid"], "argv": argv, "recipe": is_recipe_launch(argv),
                               "seconds": None}
        if (values := recipe_yaml_of(argv)) is not None:  # flags a recipe YAML gives count as the command line's
            self._budget_record["recipe_yaml"] = values
        _RECORDS.append(self._budget_record)

    def _try_wait(self, wait_flags):
        """Popen's own blocking wait (os.waitpid, CPython 3.11-3.13), through os.wait4: the same status, and the
        child's resource use with it, read once as it is reaped."""
        try:
            return self._budget_wait4(self.pid, wait_flags)
        except ChildProcessError:  # as Popen's: the child was reaped elsewhere, its status is lost
            return self.pid, 0

    def _internal_poll(self, _deadstate=None, **kwargs):
        """Popen's poll, its waitpid through os.wait4 as in _try_wait."""
        return super()._internal_poll(_deadstate, _waitpid=self._budget_wait4)

    def _budget_wait4(self, pid, flags):
        reaped, status, usage = os.wait4(pid, flags)
        if reaped == self.pid:
            self._budget_cpu_seconds = usage.ru_utime + usage.ru_stime
        return reaped, status

    def _budget_note_end(self):
        if self._budget_record is not None and self.returncode is not None and self._budget_record["seconds"] is None:
            self._budget_record["seconds"] = round(time.monotonic() - self._budget_started, 2)
            cpu = self._budget_cpu_seconds
            self._budget_record["cpu_seconds"] = None if cpu is None else round(cpu, 2)

    def wait(self, timeout=None):
        try:
            return super().wait(timeout)
        finally:
            self._budget_note_end()

    def poll(self):
        code = super().poll()
        self._budget_note_end()
        return code


def pytest_configure(config):
    subprocess.Popen = _TimedPopen


@pytest.hookimpl(tryfirst=True)  # before the fixtures' setup: a run launched by a fixture is its first test's
def pytest_runtest_setup(item):
    _CURRENT_TEST["nodeid"] = item.nodeid


def pytest_runtest_teardown(item):
    _CURRENT_TEST["nodeid"] = "<between tests>"


def summarise(records: list[dict], pytest_cpu_seconds: float | None = None) -> list[str]:
    """The table printed at the end: recipe launches and their seconds, per test file, costliest first; with
    `pytest_cpu_seconds` (the controller's and the workers' own), where the suite's CPU went."""
    recipe = [r for r in records if r["recipe"]]
    other = [r for r in records if not r["recipe"]]
    seconds = lambda rows: sum(r["seconds"] or 0.0 for r in rows)
    cpu = lambda rows: sum(r.get("cpu_seconds") or 0.0 for r in rows)
    lines = [f"launches: {len(recipe)} recipe launches in {seconds(recipe):.0f} s "
             f"({len({launch_key(r['argv']) for r in recipe})} distinct), "
             f"{len(other)} other processes in {seconds(other):.0f} s"]
    per_file: dict[str, list[dict]] = defaultdict(list)
    for record in recipe:
        per_file[record["test"].split("::")[0]].append(record)
    if per_file:
        lines.append(f"{'file':<48} {'launches':>8} {'seconds':>8} {'cpu-s':>8}")
        for name, rows in sorted(per_file.items(), key=lambda item: -seconds(item[1])):
            lines.append(f"{name:<48} {len(rows):>8} {seconds(rows):>8.0f} {cpu(rows):>8.0f}")
    by_key: dict[str, list[dict]] = defaultdict(list)
    for record in recipe:
        by_key[launch_key(record["argv"])].append(record)
    repeated = {key: rows for key, rows in by_key.items() if len(rows) > 1}
    if repeated:
        lines.append(f"launched more than once ({sum(len(r) - 1 for r in repeated.values())} repeats): the same "
                     "command, flags and paths' names; a shared run (tests/shared_runs.py) may serve them")
        for rows in sorted(repeated.values(), key=lambda rows: -len(rows)):
            lines.append(f"  {len(rows)}x {sorted({r['test'] for r in rows})[:3]}")
    if pytest_cpu_seconds is not None:
        lines.append(f"CPU-seconds (user + sys): recipe launches {cpu(recipe):.0f}, other processes {cpu(other):.0f}, "
                     f"the pytest processes themselves {pytest_cpu_seconds:.0f}")
    return lines


def own_cpu_seconds() -> float:
    """This process's own CPU (user + sys), its children's left out (they are in the records)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker hands its records to the controller, which prints the one table."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launch_records"] = json.dumps(_RECORDS)
        session.config.workeroutput["own_cpu_seconds"] = own_cpu_seconds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    _RECORDS.extend(json.loads(output.get("launch_records", "[]")))
    if "own_cpu_seconds" in output:
        _WORKERS_CPU_SECONDS.append(output["own_cpu_seconds"])


def pytest_terminal_summary(terminalreporter):
    if not _RECORDS:
        return
    terminalreporter.write_sep("=", "launch budget (tests/launch_budget.py, docs/testing.md)")
    for line in summarise(_RECORDS, own_cpu_seconds() + sum(_WORKERS_CPU_SECONDS)):
        terminalreporter.write_line(line)
    if os.environ.get("PYTEST_LAUNCH_LOG"):
        Path(os.environ["PYTEST_LAUNCH_LOG"]).write_text(json.dumps(_RECORDS, indent=1))
