"""Divergence: the first non-finite loss or gradient norm on any rank stops the run at that step, before anything of
the broken state is saved, with one message and exit code DIVERGED_EXIT_CODE.

Why it needs code: transformers' `logging_nan_inf_filter` (on by default) replaces a NaN loss in the log by the mean
of the logged ones -- `'loss': 0` beside `'grad_norm': nan` -- and training goes on; the NaN weights then reach the
next checkpoint. The recipe turns that filter off (args.RECIPE_DEFAULTS: the log shows `nan`, and the filter's
`torch.isnan(...)` in a Python `if` was a device sync on every micro-batch) and watches the values itself.

Cost: `StepHealth` keeps one flag tensor on the device, updated with `isfinite` (no sync). It is read where the run
already waits for the device: at each step end together with the preemption flag (preemption.StopAtStepEnd, one
all-reduce of both). On CUDA that read is one step late -- the flag is copied to pinned host memory without
blocking and read at the next step end, when the copy is long done -- except on a step that will log, evaluate or
save, which wait for the device anyway: there it is read at once, so a broken state is never saved.

fp16: a step GradScaler skips (inf/NaN gradients, weights untouched) is the scaler working, not divergence; only a
non-finite loss on a step the scaler did not skip counts. bf16 and fp32 have no scaler: every non-finite counts.
"""

from __future__ import annotations

import math

import torch

DIVERGED_EXIT_CODE = 4  # beside 0 (done), 2 (configuration), 3 (plan does not fit), 74 (disk full), 75 (preempted)


class Diverged(Exception):
    def __init__(self, message: str):
        super().__init__(message)


class StepHealth:
    """What this rank saw since the last step end: any non-finite loss or gradient norm (a device flag), and the
    first such value (read only once a rank has diverged, so reading it costs nothing on a healthy run)."""

    def __init__(self, scaler_in_use: bool):
        self.scaler_in_use = scaler_in_use  # fp16: non-finite gradients are the scaler's business (skipped step)
        self._flags: dict[str, torch.Tensor] = {}  # "loss" / "grad_norm" -> 1 if non-finite since the step began
        self._loss: torch.Tensor | float | None = None
        self._grad_norm: torch.Tensor | float | None = None

    def observe_loss(self, loss) -> None:
        self._loss = self._remember("loss", self._loss, loss)

    def observe_grad_norm(self, grad_norm) -> None:
        if grad_norm is not None and not self.scaler_in_use:
            self._grad_norm = self._remember("grad_norm", self._grad_norm, grad_norm)

    def _remember(self, what: str, kept, value):
        """Raise the flag if `value` is not finite; return what to keep: the first non-finite value seen (device
        ops only: `where` instead of a Python `if` on a device value)."""
        if isinstance(value, torch.Tensor):
            if hasattr(value, "full_tensor"):  # FSDP2's gradient norm is a DTensor (every rank calls this)
                value = value.full_tensor()
            value = value.detach().float().reshape(-1)[:1]
            bad = (~torch.isfinite(value)).to(torch.int32)
            if isinstance(kept, torch.Tensor):
                value = torch.where(torch.isfinite(kept), value.to(kept.device), kept)
        else:  # DeepSpeed hands the gradient norm over as a Python float
            bad = torch.tensor([0 if math.isfinite(float(value)) else 1], dtype=torch.int32)
            if kept is not None and not math.isfinite(float(kept)):
                value = kept
        self._flags[what] = bad if what not in self._flags else self._flags[what] | bad.to(self._flags[what].device)
        return value

    def step_flags(self, device) -> torch.Tensor:
        """[non-finite loss seen, non-finite gradient norm seen] since the last call, 0/1 on `device` (unread); then
        reset. The loss is this rank's own; the gradient norm is global (reduced across ranks)."""
        flags = torch.cat([self._flags[k].to(device) if k in self._flags else
                           torch.zeros(1, dtype=torch.int32, device=device) for k in ("loss", "grad_norm")])
        self._flags = {}
        return flags

    def values(self) -> tuple[float | None, float | None]:
        """(first non-finite loss, first non-finite gradient norm) this rank saw, as floats; None where finite.
        Reads the device: call it only once the run has diverged."""
        def non_finite(v) -> float | None:
            v = None if v is None else float(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else float(v)
            return None if v is None or math.isfinite(v) else v
        return non_finite(self._loss), non_finite(self._grad_norm)


def divergence_message(step: int, loss: float | None, grad_norm: float | None, where: str, training_args,
                       newest_checkpoint: str | None, passed_over: str | None = None) -> str:
    """One message: the step, the value (this rank's; `where`: which ranks saw one, "" in one process), the
    checkpoint to resume from (`newest_checkpoint`: the newest intact one whose weights trained a finite step after
    it), the one passed over (`passed_over`: written right before the broken step, so its weights are the ones that
    produced the non-finite value), the fix."""
    on = f" on {where}" if where else ""
    seen = [f"loss {loss}{on}"] if loss is not None else [f"a non-finite loss{on}"] if where else []
    seen += [f"gradient norm {grad_norm}"] if grad_norm is not None else []
    what = " and ".join(seen) if seen else "a non-finite loss or gradient norm"
    precision = "fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "fp32"
    fixes = [f"a lower --learning_rate (now {training_args.learning_rate:g})"]
    if not training_args.max_grad_norm:
        fixes.append("--max_grad_norm 1.0 (clipping is off)")
    else:
        fixes.append(f"a lower --max_grad_norm (now {training_args.max_grad_norm:g})")
    if training_args.fp16:
        fixes.append("--bf16 True rather than --fp16 (a wider exponent)")
    passed = (f"{passed_over} is intact but holds the weights that produced this step's non-finite value (a resume "
              f"from it breaks again at once); " if passed_over else "")
    resume = passed + (f"the newest checkpoint to resume from is {newest_checkpoint}: resume from it with the fix "
                       f"(--resume_from_checkpoint {newest_checkpoint})" if newest_checkpoint else
                       f"no {'earlier ' if passed_over else ''}checkpoint was written before it: start again with "
                       "the fix and --overwrite_output_dir True")
    return (f"training diverged at step {step}: {what} ({precision}). Stopped there: nothing of the broken "
            f"state was saved; {resume}. Fix: {', or '.join(fixes)}.")
