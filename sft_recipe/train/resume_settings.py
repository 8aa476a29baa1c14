"""What a resume does with the optimizer and schedule settings the user changed since the checkpoint was written.

torch's optimizer and LR scheduler save their hyperparameters with their state: loading a checkpoint puts back the
old learning rate (each group's `initial_lr` and the scheduler's `base_lrs`), weight decay, betas and epsilon, over
what this launch's flags built. Without this module a resume with `--learning_rate 1e-3` after a divergence at 1e30
trained at 1e30 again, silently. Decided per setting:
- `--learning_rate`: followed. Each group's rate and the scheduler's base rates are scaled by new / old, so the rate
  from the checkpoint's step on is the new base rate times the schedule at that step (as if the run had been
  launched with it).
- `--weight_decay`, `--adam_beta1/2`, `--adam_epsilon`: followed: each group gets back what this launch's optimizer
  was built with (the Trainer decides which groups decay from the model, so a decay switched on applies where it
  should).
- `--lr_scheduler_type`, `--warmup_steps/--warmup_ratio`, `--max_steps`, `--max_grad_norm`: followed already: the
  schedule's shape is built from the flags on every launch (a scheduler saves its step and base rates, not its
  function) and the clipping norm is read at every step. Said, old -> new, where the checkpoint recorded them
  (`schedule` in its marker, `schedule_settings`).
- Under DeepSpeed the engine restores its optimizer before the Trainer's hook runs: what this launch built is taken
  when the Trainer creates the optimizer (`RecipeSFTTrainer.create_optimizer`) and followed the same way. Only where
  the Trainer built none (a DeepSpeed config with an optimizer of its own), or the groups cannot be matched one to
  one, is the learning rate followed (compared with the flag) and a WARNING names the settings that stay as saved.
The data order and the step count stay exactly the checkpoint's.
"""

from __future__ import annotations

import math

GROUP_KEYS = ("weight_decay", "betas", "eps")  # what create_optimizer reads from the flags into each param group
SCHEDULE_FLAGS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "max_steps", "max_grad_norm",
                  "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim")


def schedule_settings(args) -> dict:
    """The flags a checkpoint's marker records, to say old -> new on a resume (plain JSON values)."""
    settings = {}
    for name in SCHEDULE_FLAGS:
        value = getattr(args, name, None)
        settings[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return settings


def group_settings(optimizer, holding_only: bool = False) -> list[dict]:
    """Each param group's hyperparameters as this launch's flags built them (taken before the checkpoint loads).
    `holding_only`: only the groups that hold parameters, as DeepSpeed's ZeRO optimizers keep them (they drop a
    LoRA model's empty no-decay group: no bias or norm is trained); torch keeps every group."""
    groups = [group for group in optimizer.param_groups if not holding_only or len(group["params"]) > 0]
    return [{k: group[k] for k in ("initial_lr", "lr", *GROUP_KEYS) if k in group} for group in groups]


def _close(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)


def _scale_learning_rate(optimizer, scheduler, ratio: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps torch's
    if hasattr(inner, "base_lrs"):
        inner.base_lrs = [rate * ratio for rate in inner.base_lrs]
    if hasattr(inner, "_last_lr"):  # what get_last_lr() (the logged learning_rate) answers until the next step
        inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(tuple(value) if isinstance(value, list) else value)


def follow_changed_settings(optimizer, scheduler, args, built: list[dict] | None, saved: dict | None) \
        -> tuple[list[str], list[str]]:
    """After the checkpoint's optimizer and scheduler state loaded: put this launch's settings back where they
    changed. `built`: group_settings() of the optimizer this launch built (None where it built none: compared with the
    flags);
    `saved`: the checkpoint marker's `schedule` (None for a checkpoint of an earlier version).
    Returns (followed: "--flag old -> new" lines, not_followed: the same for settings that stay as saved)."""
    followed, not_followed = [], []
    groups = optimizer.param_groups
    if built is not None and len(built) != len(groups):  # groups not matched one to one: compared with the flags
        built = None
    loaded_lr = groups[0].get("initial_lr") if groups else None
    if loaded_lr:
        wanted_lr = built[0].get("initial_lr", args.learning_rate) if built else args.learning_rate
        if not _close(loaded_lr, wanted_lr):
            _scale_learning_rate(optimizer, scheduler, wanted_lr / loaded_lr)
            followed.append(f"--learning_rate {_shown(loaded_lr)} -> {_shown(wanted_lr)}")
    flags = {"weight_decay": "--weight_decay", "betas": "--adam_beta1/--adam_beta2", "eps": "--adam_epsilon"}
    for key in GROUP_KEYS:
        now = [group.get(key) for group in groups]
        if built is None:  # the loaded groups against the flags; the no-decay group's 0 is no change
            asked = {"weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2),
                     "eps": args.adam_epsilon}[key]
            present = [n for n in now if n is not None and not (key == "weight_decay" and n == 0)]
            old = present[0] if present else (0.0 if key == "weight_decay" else None)
            if old is not None and not _close(old, asked):
                not_followed.append(f"{flags[key]} {_shown(old)} -> {_shown(asked)}")
            continue
        wanted = [settings.get(key) for settings in built]
        if all(w is None or _close(n, w) for n, w in zip(now, wanted)):
            continue
        old = next(n for n, w in zip(now, wanted) if w is not None and not _close(n, w))
        new = next(w for n, w in zip(now, wanted) if w is not None and not _close(n, w))
        for group, value in zip(groups, wanted):
            if value is not None:
                group[key] = tuple(value) if key == "betas" else value
        followed.append(f"{flags[key]} {_shown(old)} -> {_shown(new)}")
    for name in ("lr_scheduler_type", "warmup_steps", "warmup_ratio", "max_steps", "max_grad_norm"):
        if saved and name in saved:
            now_value = schedule_settings(args)[name]
            if saved[name] != now_value and not _close(saved[name], now_value):
                followed.append(f"--{name} {_shown(saved[name])} -> {_shown(now_value)}")
    return followed, not_followed
