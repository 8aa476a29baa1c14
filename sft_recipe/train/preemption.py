"""Preemption: SIGTERM (Slurm, cloud spot reclaim, `kill`) or SIGUSR1 (Slurm's `--signal` pre-warning) on any rank
makes every rank finish the current optimizer step, write a complete checkpoint, and exit with PREEMPTED_EXIT_CODE
and a one-line message saying how to resume.

The handler only sets a flag; at each step end the ranks agree on it with one tiny all-reduce, so they all stop at the
same step even when the signal reached one of them.
"""

from __future__ import annotations

import signal

import torch
from transformers import TrainerCallback

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later" -- what a requeue wrapper can test for
# Written to output_dir by a preempted run and removed when a later run finishes: the launcher (torchrun) reports
# any failed rank as exit code 1, so wrappers (run_peft_*.sh) look for this file to exit 75 themselves.
PREEMPTED_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    def __init__(self, message: str):
        super().__init__(message)


class PreemptionCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer
        self.signal_name: str | None = None
        self.stopped_at_step: int | None = None
        self._previous = {}

    def _on_signal(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
            # Restart interrupted system calls: a signal landing inside a gloo/NCCL socket read must not turn into
            # an EINTR error in the collective (the handler only sets a flag).
            signal.siginterrupt(sig, False)

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        flag = torch.tensor([1 if self.signal_name else 0], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        if int(flag.item()) > 0 and self.stopped_at_step is None:
            self.stopped_at_step = state.global_step
            self.signal_name = self.signal_name or "a signal on another rank"
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def raise_if_preempted(self, output_dir: str) -> None:
        if self.stopped_at_step is None:
            return
        if self.trainer.accelerator.is_main_process:
            import json
            import os

            with open(os.path.join(output_dir, PREEMPTED_FILE), "w") as f:
                json.dump({"signal": self.signal_name, "global_step": self.stopped_at_step,
                           "checkpoint": f"checkpoint-{self.stopped_at_step}"}, f)
        raise Preempted(
            f"stopped by {self.signal_name} after step {self.stopped_at_step}; checkpoint saved to "
            f"{output_dir}/checkpoint-{self.stopped_at_step}. Resume: run the same command with "
            f"--resume_from_checkpoint latest")
