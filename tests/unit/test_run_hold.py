"""One run per output_dir (sft_recipe/artifacts/run_hold.py): the hold is taken and released, refused while its holder
lives, taken over (one warning line) when it is gone -- on this host by pid AND start time, from another host by the
Slurm job's requeue or a stale heartbeat -- each case with its negative control. Hold files are written by hand
naming real processes (a `sleep`) or made-up hosts; tests/e2e/test_second_launch.py runs two real launches."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time

import psutil
import pytest

from sft_recipe.artifacts import run_hold
from sft_recipe.artifacts.checkpoints import mark_complete, move_previous_run_aside, previous_results
from sft_recipe.artifacts.run_hold import HOLD_FILE, STALE_AFTER_S, acquire, release_run_hold, take_run_hold
from sft_recipe.config.args import ConfigError
from sft_recipe.config.launch_env import LaunchEnv

NO_SLURM = {}  # the environment acquire() reads the Slurm job from: none unless a test says


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def _write_hold(folder, pid, start_time_s, host=None, age_s=0.0, **fields):
    """A hold as another launch would have left it, its heartbeat `age_s` old."""
    me = run_hold.this_process(NO_SLURM)
    record = {"host": host or me.host, "pid": pid, "start_time_s": start_time_s, "boot_id": me.boot_id,
              "slurm_job_id": "", "slurm_restart_count": "", "token": "theirs", **fields}
    path = folder / HOLD_FILE
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    touched = time.time() - age_s
    os.utime(path, (touched, touched))
    return path


def _when(epoch_s):
    return run_hold._when(epoch_s)


def _takeover_lines(caplog):
    return [r.getMessage() for r in caplog.records if "taking over the hold" in r.getMessage()]


def test_acquire_names_this_process_and_release_removes_it(tmp_path):
    out = tmp_path / "new" / "out"  # created by the hold
    hold = acquire(out, NO_SLURM, heartbeat_interval_s=None)
    record = json.loads((out / HOLD_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == run_hold.this_process(NO_SLURM).host
    assert abs(record["start_time_s"] - psutil.Process().create_time()) < 1e-3 and hold.taken_over is None
    assert [p.name for p in out.iterdir()] == [HOLD_FILE]  # the temporary file is gone
    hold.release()
    assert not (out / HOLD_FILE).exists()
    acquire(out, NO_SLURM, heartbeat_interval_s=None).release()  # free again


def test_a_live_process_on_this_host_refuses_a_second_run(tmp_path, sleeper):
    started = psutil.Process(sleeper.pid).create_time()
    path = _write_hold(tmp_path, sleeper.pid, started, age_s=3 * STALE_AFTER_S)  # no heartbeat needed on this host
    before = path.read_bytes()
    with pytest.raises(ConfigError) as refused:
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    (message,) = refused.value.problems
    host = run_hold.this_process(NO_SLURM).host
    assert f"--output_dir {tmp_path}: another run is using this folder (host {host}, process {sleeper.pid}, " \
           f"started {_when(started)}; process {sleeper.pid} is running on this host" in message
    assert "Fix: wait until that run ends" in message and "another --output_dir" in message
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [HOLD_FILE]


def test_a_dead_process_is_taken_over_with_one_line(tmp_path, caplog):
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write_hold(tmp_path, gone.pid, time.time() - 5)
    with caplog.at_level(logging.WARNING):
        hold = acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    (line,) = _takeover_lines(caplog)
    assert line.startswith(f"--output_dir {tmp_path}: taking over the hold of a run that is gone (host ")
    assert f"process {gone.pid} is no longer running on " in line and hold.taken_over == line
    assert json.loads((tmp_path / HOLD_FILE).read_text())["pid"] == os.getpid()
    hold.release()


def test_an_exited_unreaped_process_is_gone(tmp_path, caplog):
    zombie = subprocess.Popen(["true"])
    deadline = time.time() + 10
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.01)
    _write_hold(tmp_path, zombie.pid, psutil.Process(zombie.pid).create_time())
    with caplog.at_level(logging.WARNING):
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None).release()
    zombie.wait()
    assert "a zombie not yet reaped" in _takeover_lines(caplog)[0]


def test_a_reused_pid_is_stale(tmp_path, sleeper, caplog):
    """The same pid with another start time is another process: the holder is gone."""
    _write_hold(tmp_path, sleeper.pid, psutil.Process(sleeper.pid).create_time() - 100)
    with caplog.at_level(logging.WARNING):
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None).release()
    (line,) = _takeover_lines(caplog)
    assert f"process id {sleeper.pid} belongs to another process now (started " in line


def test_a_restarted_host_is_stale(tmp_path, sleeper, caplog):
    """Same host name, another boot id: even a live pid with that start time is not the holder."""
    _write_hold(tmp_path, sleeper.pid, psutil.Process(sleeper.pid).create_time(), boot_id="another-boot")
    if not run_hold.this_process(NO_SLURM).boot_id:
        pytest.skip("no boot id on this system")
    with caplog.at_level(logging.WARNING):
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None).release()
    assert "has restarted since (another boot id)" in _takeover_lines(caplog)[0]


def test_another_host_is_judged_by_its_heartbeat(tmp_path, caplog):
    _write_hold(tmp_path, 4321, time.time() - 3600, host="node-7", age_s=30)
    with pytest.raises(ConfigError) as refused:
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    (message,) = refused.value.problems
    assert "(host node-7, process 4321, started " in message and "its heartbeat is 30 s old" in message
    assert f"taken as gone after {STALE_AFTER_S / 60:.1f} minutes without one" in message

    _write_hold(tmp_path, 4321, time.time() - 3600, host="node-7", age_s=STALE_AFTER_S + 60)
    with caplog.at_level(logging.WARNING):
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None).release()
    (line,) = _takeover_lines(caplog)
    assert "(host node-7, process 4321, started " in line and "its heartbeat is 11.0 minutes old" in line


def test_a_requeued_slurm_job_takes_its_own_hold_over(tmp_path, caplog):
    """Another host, fresh heartbeat: the same Slurm job with a new restart count was requeued, so its earlier run
    is over. Negative controls: the same restart count (two launches in one allocation) and another job refuse."""
    def hold(**slurm):
        _write_hold(tmp_path, 4321, time.time() - 60, host="node-7", age_s=5, **slurm)

    hold(slurm_job_id="77", slurm_restart_count="0")
    with caplog.at_level(logging.WARNING):
        acquire(tmp_path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, heartbeat_interval_s=None).release()
    assert "Slurm job 77 has been requeued since (restart 0 -> 1)" in _takeover_lines(caplog)[0]

    for job, restarts in (("77", "0"), ("78", "1")):
        hold(slurm_job_id="77", slurm_restart_count="0")
        with pytest.raises(ConfigError, match="another run is using this folder .host node-7"):
            acquire(tmp_path, {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": restarts}, heartbeat_interval_s=None)
    hold(slurm_job_id="77", slurm_restart_count="0")
    with pytest.raises(ConfigError):  # no Slurm here: the heartbeat decides
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)


def test_an_unreadable_hold_is_judged_by_its_age(tmp_path):
    path = tmp_path / HOLD_FILE
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="an unreadable hold file"):
        acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    old = time.time() - STALE_AFTER_S - 60
    os.utime(path, (old, old))
    acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None).release()


def test_the_heartbeat_refreshes_the_hold_and_release_leaves_another_runs_hold(tmp_path):
    hold = acquire(tmp_path, NO_SLURM, heartbeat_interval_s=0.05)
    path = tmp_path / HOLD_FILE
    old = time.time() - 1000
    os.utime(path, (old, old))
    deadline = time.time() + 10
    while path.stat().st_mtime < old + 500 and time.time() < deadline:
        time.sleep(0.02)
    assert path.stat().st_mtime > old + 500  # refreshed
    hold.release()
    assert not path.exists()

    hold = acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    _write_hold(tmp_path, 4321, time.time(), host="node-7")  # taken over by another launch meanwhile
    hold.release()
    assert json.loads(path.read_text())["host"] == "node-7"  # not ours: left alone


def test_the_hold_is_not_a_previous_run(tmp_path):
    """--overwrite_output_dir moves a previous run's checkpoints aside: the live run's own hold stays, and it never
    counts as a previous run (validate would then ask for --overwrite_output_dir on a fresh folder)."""
    hold = acquire(tmp_path, NO_SLURM, heartbeat_interval_s=None)
    assert previous_results(tmp_path) == []
    (tmp_path / "checkpoint-2").mkdir()
    mark_complete(tmp_path / "checkpoint-2", 2)
    aside = move_previous_run_aside(tmp_path)
    assert (tmp_path / HOLD_FILE).is_file() and not (aside / HOLD_FILE).exists()
    hold.release()


def test_every_rank_learns_the_outcome(tmp_path, sleeper):
    """One process: the main process takes and releases. A refusal is a ConfigError (train.py: exit 2). With ranks
    but no process group, every rank stops alike (none may go on to load the model)."""
    hold = take_run_hold(tmp_path, LaunchEnv())
    assert (tmp_path / HOLD_FILE).is_file() and hold is run_hold._active
    release_run_hold()
    assert not (tmp_path / HOLD_FILE).exists() and run_hold._active is None
    release_run_hold()  # nothing held: a no-op

    _write_hold(tmp_path, sleeper.pid, psutil.Process(sleeper.pid).create_time())
    with pytest.raises(ConfigError, match=f"process {sleeper.pid} is running on this host"):
        take_run_hold(tmp_path, LaunchEnv())
    other = tmp_path / "other"
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
            take_run_hold(other, LaunchEnv(rank=rank, world_size=2))
    assert not (other / HOLD_FILE).exists()  # rank 0 let go of what it took
