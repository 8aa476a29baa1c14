"""scripts/lib/launch_common.sh's run_and_exit, sourced as the run_peft_*.sh scripts source it, around a stand-in for
the launcher: a launch that fails after writing a checkpoint (a rank killed by the out-of-memory killer) ends with the
resume line; one that fails before writing any (a refusal) adds nothing to the recipe's own message."""

from __future__ import annotations

import subprocess

from tests.helpers import REPO


def _run_and_exit(tmp_path, launcher: str) -> subprocess.CompletedProcess:
    script = (f'MODEL=m DATASET=d OUTPUT_DIR={tmp_path}; source scripts/lib/launch_common.sh; '
              f'run_and_exit bash -c \'{launcher}\'')
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_launch_failing_after_a_checkpoint_says_how_to_resume(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "checkpoint_complete.json").write_text("{}")  # an earlier run's: not this one's
    subprocess.run(["touch", "-d", "2020-01-01", str(tmp_path / "checkpoint-2" / "checkpoint_complete.json")],
                   check=True)
    launcher = (f"mkdir -p {tmp_path}/checkpoint-4 {tmp_path}/checkpoint-6 && "
                f"echo {{}} > {tmp_path}/checkpoint-4/checkpoint_complete.json && exit 1")  # 6: unfinished
    result = _run_and_exit(tmp_path, launcher)
    assert result.returncode == 1
    assert (f"run_peft: the launch failed (exit 1) after writing checkpoints. torch's report above names the rank that "
            f"failed first ('Root Cause') and how (exitcode -9, SIGKILL: usually the out-of-memory killer). Newest "
            f"checkpoint: {tmp_path}/checkpoint-4. Resume: run the same command with --resume_from_checkpoint "
            f"latest.") in result.stderr, result.stderr


def test_a_launch_failing_before_any_checkpoint_adds_nothing(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "checkpoint_complete.json").write_text("{}")
    subprocess.run(["touch", "-d", "2020-01-01", str(tmp_path / "checkpoint-2" / "checkpoint_complete.json")],
                   check=True)
    result = _run_and_exit(tmp_path, "echo 'error: 1 configuration problem(s)' >&2; exit 2")
    assert result.returncode == 2 and "run_peft:" not in result.stderr, result.stderr
