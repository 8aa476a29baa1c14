"""sft_recipe/train/resume_settings.py: a resume puts this launch's learning rate, weight decay, betas and epsilon
back over what the checkpoint's optimizer and scheduler state restored (torch's AdamW and LambdaLR, in-process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sft_recipe.train.resume_settings import follow_changed_settings, group_settings, schedule_settings


def _args(**changes):
    values = dict(learning_rate=3e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                  lr_scheduler_type="linear", warmup_steps=0, warmup_ratio=0.0, max_steps=10, max_grad_norm=1.0,
                  optim="adamw_torch")
    return SimpleNamespace(**{**values, **changes})


def _optimizer_and_schedule(args, params):
    """As the Trainer builds them: a decayed group and a no-decay group, a linear decay over max_steps."""
    optimizer = torch.optim.AdamW([{"params": params[:1], "weight_decay": args.weight_decay},
                                   {"params": params[1:], "weight_decay": 0.0}], lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.max_steps)
    return optimizer, schedule


def _checkpoint_after(steps: int, args):
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer, schedule = _optimizer_and_schedule(args, params)
    for _ in range(steps):
        sum(p.sum() for p in params).backward()
        optimizer.step()
        schedule.step()
    return optimizer.state_dict(), schedule.state_dict()


def _resume(saved_args, args, steps=4, built_none=False):
    optimizer_state, schedule_state = _checkpoint_after(steps, saved_args)
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer, schedule = _optimizer_and_schedule(args, params)
    built = None if built_none else group_settings(optimizer)
    optimizer.load_state_dict(optimizer_state)
    schedule.load_state_dict(schedule_state)
    said = follow_changed_settings(optimizer, schedule, args, built, schedule_settings(saved_args))
    return optimizer, schedule, said


def test_nothing_changed_nothing_said():
    optimizer, schedule, (followed, not_followed) = _resume(_args(), _args())
    assert followed == not_followed == []
    assert schedule.get_last_lr()[0] == pytest.approx(3e-3 * (1 - 4 / 10))


def test_a_lower_learning_rate_replaces_the_checkpoints_from_its_step_on():
    optimizer, schedule, (followed, _) = _resume(_args(learning_rate=1e30), _args(learning_rate=1e-3))
    assert followed == ["--learning_rate 1e+30 -> 0.001"]
    # step 4 of 10 on a linear decay: 0.6 of the base, for both groups, now and after the next step
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([6e-4, 6e-4])
    assert schedule.get_last_lr() == pytest.approx([6e-4, 6e-4])
    optimizer.step()
    schedule.step()
    assert schedule.get_last_lr() == pytest.approx([5e-4, 5e-4])


def test_weight_decay_betas_and_epsilon_follow_the_flags_in_the_groups_that_had_them():
    optimizer, _, (followed, _) = _resume(_args(), _args(weight_decay=0.1, adam_beta2=0.95, adam_epsilon=1e-6))
    assert followed == ["--weight_decay 0 -> 0.1", "--adam_beta1/--adam_beta2 (0.9, 0.999) -> (0.9, 0.95)",
                        "--adam_epsilon 1e-08 -> 1e-06"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # the no-decay group stays so
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6 for g in optimizer.param_groups)


def test_the_schedules_shape_and_clipping_are_said_old_to_new():
    _, _, (followed, _) = _resume(_args(), _args(lr_scheduler_type="cosine", max_steps=20, max_grad_norm=0.3))
    assert followed == ["--lr_scheduler_type linear -> cosine", "--max_steps 10 -> 20", "--max_grad_norm 1 -> 0.3"]


def test_where_the_launch_built_no_optimizer_the_rate_follows_and_the_rest_is_named_as_kept():
    """A DeepSpeed config with an optimizer of its own: the Trainer built none to take the settings from."""
    optimizer, _, (followed, not_followed) = _resume(_args(weight_decay=0.1), _args(learning_rate=1e-3,
                                                                                    weight_decay=0.2), built_none=True)
    assert followed == ["--learning_rate 0.003 -> 0.001"]
    assert not_followed == ["--weight_decay 0.1 -> 0.2"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("rates,expected", [([0.0], True), ([0.0, 0.0], True), ([0.0, 1e-3], False), ([], False),
                                            (None, False)])
def test_a_checkpoint_trained_only_at_rate_zero_holds_the_initial_weights(rates, expected, tmp_path):
    """Such a checkpoint's adapter equals a fresh one (same seed): its resume is no failed load (trainer.py)."""
    import json

    from sft_recipe.train.trainer import _trained_at_rate_zero

    if rates is not None:
        history = [{"step": i + 1, "learning_rate": rate, "loss": 7.0} for i, rate in enumerate(rates)]
        (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert _trained_at_rate_zero(str(tmp_path)) is expected


def test_groups_that_cannot_be_matched_one_to_one_are_compared_with_the_flags_not_skipped():
    """A checkpoint whose optimizer has another number of groups: nothing is silently left as saved."""
    optimizer_state, schedule_state = _checkpoint_after(4, _args(weight_decay=0.1))
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer, schedule = _optimizer_and_schedule(_args(weight_decay=0.2), params)
    built = [*group_settings(optimizer), {"weight_decay": 0.0}]  # one group more than the loaded optimizer has
    optimizer.load_state_dict(optimizer_state)
    schedule.load_state_dict(schedule_state)
    followed, not_followed = follow_changed_settings(optimizer, schedule, _args(weight_decay=0.2), built, None)
    assert not_followed == ["--weight_decay 0.1 -> 0.2"]


def test_under_deepspeed_the_groups_kept_are_those_that_hold_parameters():
    """ZeRO drops a LoRA model's empty no-decay group; the settings taken for it must match what it keeps."""
    optimizer = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": 0.5},
                                   {"params": [], "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.9))
    assert [g["weight_decay"] for g in group_settings(optimizer)] == [0.5, 0.0]
    assert group_settings(optimizer, holding_only=True) == [{"lr": 1e-3, "weight_decay": 0.5, "betas": (0.9, 0.9),
                                                             "eps": 1e-8}]
