"""The step-end decisions (sft_recipe/train/divergence.py, preemption.py) without a launch: what counts as
divergence, which step is cancelled, what the message says, and that the log is no longer filtered."""

from __future__ import annotations

import math
import signal
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from sft_recipe.train.divergence import StepHealth, divergence_message
from sft_recipe.train.preemption import INTERRUPTED_EXIT_CODE, Preempted, StopAtStepEnd


def _trainer(fp16=False, num_processes=1):
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=num_processes, process_index=0,
                                  is_main_process=True, optimizer_step_was_skipped=False)
    args = SimpleNamespace(fp16=fp16, bf16=False, learning_rate=1e-4, max_grad_norm=1.0)
    return SimpleNamespace(accelerator=accelerator, args=args, state=None)


def _step(stopper, step, *, save=False, max_steps=100):
    state = TrainerState()
    state.global_step, state.max_steps = step, max_steps
    stopper.trainer.state = state
    control = TrainerControl()
    control.should_save = save
    stopper.on_step_end(None, state, control)
    return control


def test_health_flags_the_first_non_finite_value_and_keeps_it():
    health = StepHealth(scaler_in_use=False)
    for loss in (torch.tensor(2.0), torch.tensor(float("nan")), torch.tensor(float("inf"))):
        health.observe_loss(loss)
    health.observe_grad_norm(torch.tensor(3.0))
    assert health.step_flags("cpu").tolist() == [1, 0]
    loss, grad_norm = health.values()
    assert math.isnan(loss) and grad_norm is None  # the first non-finite loss, not the inf after it
    assert health.step_flags("cpu").tolist() == [0, 0]  # reset at every step end
    health.observe_grad_norm(float("inf"))  # DeepSpeed's float
    assert health.step_flags("cpu").tolist() == [0, 1]


def test_fp16_gradients_are_the_scalers_business():
    health = StepHealth(scaler_in_use=True)
    health.observe_grad_norm(torch.tensor(float("inf")))
    assert health.step_flags("cpu").tolist() == [0, 0]
    health.observe_loss(torch.tensor(float("nan")))
    assert health.step_flags("cpu").tolist() == [1, 0]


def test_a_diverged_step_is_stopped_and_never_saved():
    trainer = _trainer()
    health = StepHealth(scaler_in_use=False)
    stopper = StopAtStepEnd(trainer, health)
    health.observe_loss(torch.tensor(1.5))
    control = _step(stopper, 1, save=True)
    assert control.should_save and not control.should_training_stop  # healthy: the planned save happens
    health.observe_loss(torch.tensor(float("nan")))
    control = _step(stopper, 2, save=True)
    assert not control.should_save and control.should_training_stop and control.should_log
    epoch_end = TrainerControl()
    epoch_end.should_save = epoch_end.should_evaluate = True  # --save_strategy epoch would save now
    stopper.on_epoch_end(None, trainer.state, epoch_end)
    assert not epoch_end.should_save and not epoch_end.should_evaluate
    assert stopper.diverged[0] == 2


def test_fp16_skipped_step_is_not_divergence():
    trainer = _trainer(fp16=True)
    health = StepHealth(scaler_in_use=True)
    stopper = StopAtStepEnd(trainer, health)
    health.observe_loss(torch.tensor(float("nan")))
    trainer.accelerator.optimizer_step_was_skipped = True
    assert not _step(stopper, 1).should_training_stop
    health.observe_loss(torch.tensor(float("nan")))
    trainer.accelerator.optimizer_step_was_skipped = False  # not skipped: the weights took it
    assert _step(stopper, 2).should_training_stop


def test_stop_on_nonfinite_false_trains_on():
    trainer = _trainer()
    stopper = StopAtStepEnd(trainer, None)
    assert not _step(stopper, 1).should_training_stop


def test_ctrl_c_checkpoints_and_a_second_aborts(tmp_path):
    trainer = _trainer()
    stopper = StopAtStepEnd(trainer, StepHealth(scaler_in_use=False), launcher_shutdown_timeout_s=600)
    previous = signal.getsignal(signal.SIGINT)
    try:
        stopper.on_train_begin(None, None, None)
        stopper._on_signal(signal.SIGINT, None)
        control = _step(stopper, 7)
        assert control.should_save and control.should_training_stop and stopper.stopped_at_step == 7
        try:
            stopper._on_signal(signal.SIGINT, None)
            raise AssertionError("the second Ctrl-C did not abort")
        except KeyboardInterrupt:
            pass
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        stopper.raise_if_stopped(str(tmp_path), lambda folder: [])
        raise AssertionError("not raised")
    except Preempted as e:
        assert e.exit_code == INTERRUPTED_EXIT_CODE and "Ctrl-C (SIGINT) after step 7" in str(e)
    assert '"signal": "SIGINT"' in (tmp_path / "preempted.json").read_text()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])  # a background job's Ctrl-C; nohup's SIGHUP
def test_an_ignored_sigint_or_sighup_is_left_ignored(signum):
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        stopper = StopAtStepEnd(_trainer(), None)
        stopper.on_train_begin(None, None, None)
        assert signal.getsignal(signum) is signal.SIG_IGN
        stopper.on_train_end(None, None, None)
    finally:
        signal.signal(signum, previous)


def test_sighup_at_its_default_is_caught_and_stops_like_sigterm(tmp_path):
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        stopper = StopAtStepEnd(_trainer(), None)
        stopper.on_train_begin(None, None, None)
        assert signal.getsignal(signal.SIGHUP) == stopper._on_signal
        stopper._terminal_fds = []  # pytest's own output is no terminal to leave
        stopper._on_signal(signal.SIGHUP, None)
        stopper.on_train_end(None, None, None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert stopper.signal_name == "SIGHUP"
    control = _step(stopper, 7)
    assert control.should_save and control.should_training_stop  # the step ends, a checkpoint is written
    stopper.trainer.state.global_step = 7
    with pytest.raises(Preempted) as stop:
        stopper.raise_if_stopped(str(tmp_path), lambda folder: [])
    assert stop.value.exit_code == 75 and "stopped by SIGHUP after step 7" in str(stop.value)
    assert '"signal": "SIGHUP"' in (tmp_path / "preempted.json").read_text()


def test_the_message_names_step_value_rank_checkpoint_and_fix():
    args = SimpleNamespace(fp16=True, bf16=False, learning_rate=2e-4, max_grad_norm=0.0)
    text = divergence_message(12, None, float("nan"), "rank 3", args, "/out/checkpoint-10")
    assert text.startswith("training diverged at step 12: a non-finite loss on rank 3 and gradient norm nan (fp16)")
    assert "--resume_from_checkpoint /out/checkpoint-10" in text
    assert "a lower --learning_rate (now 0.0002)" in text and "--max_grad_norm 1.0 (clipping is off)" in text
    assert "--bf16 True rather than --fp16" in text
    fresh = divergence_message(1, float("inf"), None, "", SimpleNamespace(fp16=False, bf16=True, learning_rate=1.0,
                                                                          max_grad_norm=1.0), None)
    assert "loss inf (bf16)" in fresh and "--overwrite_output_dir True" in fresh and "--fp16" not in fresh


@pytest.mark.parametrize("intact,named,passed_over", [
    (["checkpoint-4", "checkpoint-2"], "checkpoint-2", "checkpoint-4"),  # 4's weights made step 5's NaN
    (["checkpoint-3", "checkpoint-2"], "checkpoint-3", None),  # 3's weights trained step 4 finitely
    (["checkpoint-4"], None, "checkpoint-4"),  # nothing usable: start again
])
def test_the_checkpoint_named_is_one_whose_weights_trained_a_finite_step(intact, named, passed_over, tmp_path):
    from sft_recipe.train.divergence import Diverged

    stopper = StopAtStepEnd(_trainer(), StepHealth(scaler_in_use=False))
    stopper.diverged = (5, float("nan"), float("nan"), "")
    with pytest.raises(Diverged) as stop:
        stopper.raise_if_stopped(str(tmp_path), lambda folder: [f"{folder}/{name}" for name in intact])
    text = str(stop.value)
    if named:
        assert f"the newest checkpoint to resume from is {tmp_path}/{named}: resume from it with the fix " \
               f"(--resume_from_checkpoint {tmp_path}/{named})" in text
    else:
        assert "no earlier checkpoint was written before it: start again with the fix" in text
    assert (f"{tmp_path}/{passed_over} is intact but holds the weights that produced this step's non-finite value"
            in text) == bool(passed_over)


def test_the_log_shows_nan_losses_by_default(tiny):
    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import LaunchEnv

    base = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), "--output_dir", "x"]
    assert parse_args(base, LaunchEnv())[3].logging_nan_inf_filter is False
    assert parse_args([*base, "--logging_nan_inf_filter", "True"], LaunchEnv())[3].logging_nan_inf_filter is True
    assert parse_args(base, LaunchEnv())[2].stop_on_nonfinite is True


def test_the_exit_code_table_is_the_codes_train_py_returns():
    """docs/reliability.md's table lists every exit code train.py has, and only those (1: Python's own, for an
    exception the recipe does not name), and README's list of them is the same."""
    import re

    from sft_recipe.artifacts.adapter import ADAPTER_CHECK_EXIT_CODE
    from sft_recipe.artifacts.disk_full import DISK_FULL_EXIT_CODE
    from sft_recipe.train.divergence import DIVERGED_EXIT_CODE
    from sft_recipe.train.preemption import PREEMPTED_EXIT_CODE
    from tests.helpers import REPO

    text = (REPO / "docs" / "reliability.md").read_text()
    table = text.split("## Exit codes of `train.py`")[1].split("\n## ")[0]
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    assert documented == {0, 1, 2, 3, DIVERGED_EXIT_CODE, ADAPTER_CHECK_EXIT_CODE, DISK_FULL_EXIT_CODE,
                          PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE}
    (listed,) = re.findall(r"the exit codes \(([\d, ]+)\)", (REPO / "README.md").read_text())
    assert {int(code) for code in listed.split(",")} == documented


def _lagged_stopper():
    """The CUDA path (each step's flags read one step late), run on CPU: `read_lagged` forces it."""
    health = StepHealth(scaler_in_use=False)
    stopper = StopAtStepEnd(_trainer(), health)
    stopper.read_lagged = True
    return stopper, health


def test_lagged_a_signal_then_a_nan_on_the_next_step_saves_nothing():
    """SIGTERM during step 5, NaN at step 6: step 5's flags are read at step 6, and step 6's own must be read before
    the preemption's checkpoint -- or the NaN state would be saved as an intact checkpoint."""
    stopper, health = _lagged_stopper()
    for step in range(1, 5):
        health.observe_loss(torch.tensor(1.0))
        assert not _step(stopper, step).should_training_stop
    stopper.signal_name = "SIGTERM"  # the handler ran during step 5
    health.observe_loss(torch.tensor(1.0))
    control = _step(stopper, 5)
    assert not control.should_save and not control.should_training_stop  # step 5's flags are still in flight
    health.observe_loss(torch.tensor(float("nan")))
    control = _step(stopper, 6)
    assert not control.should_save and control.should_training_stop
    assert stopper.diverged[0] == 6 and stopper.stopped_at_step == 6


def test_lagged_a_signal_alone_checkpoints_the_step_it_is_read_at():
    stopper, health = _lagged_stopper()
    health.observe_loss(torch.tensor(1.0))
    _step(stopper, 1)
    stopper.signal_name = "SIGUSR1"
    health.observe_loss(torch.tensor(1.0))
    assert not _step(stopper, 2).should_training_stop
    health.observe_loss(torch.tensor(1.0))
    control = _step(stopper, 3)
    assert control.should_save and control.should_training_stop and stopper.stopped_at_step == 3
    assert stopper.diverged is None


def test_lagged_a_nan_is_reported_at_its_own_step_and_the_next_is_not_saved():
    stopper, health = _lagged_stopper()
    health.observe_loss(torch.tensor(float("nan")))
    assert not _step(stopper, 1).should_training_stop  # read one step late
    health.observe_loss(torch.tensor(1.0))
    control = _step(stopper, 2, save=True)  # a save planned at step 2
    assert not control.should_save and control.should_training_stop and stopper.diverged[0] == 1


def test_lagged_a_step_that_saves_reads_its_own_flags_first():
    stopper, health = _lagged_stopper()
    health.observe_loss(torch.tensor(1.0))
    _step(stopper, 1)
    health.observe_loss(torch.tensor(float("inf")))
    control = _step(stopper, 2, save=True)
    assert not control.should_save and stopper.diverged[0] == 2
