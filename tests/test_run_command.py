"""tests.helpers.run_command, which every synchronous launch of the suite goes through: a command that outlives its
timeout is killed with every process it started, so a hung launch cannot leave ranks running under the rest of the
suite."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import run_command

# A stand-in for a launcher: it starts a "rank" that would run for a minute, says its pid, and waits for it.
LAUNCHER = ("import subprocess, sys; rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('rank', rank.pid, flush=True); rank.wait()")


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:  # killed; its new parent has not reaped it
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_command_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        run_command([sys.executable, "-c", LAUNCHER], tmp_path, timeout=3)
    # at once: a rank left running would hold the output pipe open, and reading it to its end would wait for it
    assert time.monotonic() - started < 30
    rank_pid = int(stopped.value.output.split()[-1])  # the output is kept for the failure message
    assert _gone(rank_pid), f"the launcher's child {rank_pid} outlived the timeout"


def test_a_command_that_ends_in_time_gives_its_exit_status_and_output(tmp_path):
    result = run_command([sys.executable, "-c", "print('done'); raise SystemExit(3)"], tmp_path, timeout=60)
    assert (result.returncode, result.output.strip(), result.output_dir) == (3, "done", tmp_path)
