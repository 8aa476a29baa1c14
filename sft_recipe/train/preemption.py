"""Stopping at a step end, all ranks together: preemption, Ctrl-C and divergence.

- SIGTERM (Slurm, cloud spot reclaim, `kill`) or SIGUSR1 (Slurm's `--signal` pre-warning) on any rank: every rank
  finishes the current optimizer step, writes a complete checkpoint, and exits PREEMPTED_EXIT_CODE with a line
  saying how to resume.
- SIGINT (Ctrl-C) is the same, exit INTERRUPTED_EXIT_CODE (130, the shell's code for Ctrl-C). A second SIGINT
  aborts at once (KeyboardInterrupt: the checkpoint being written is left unmarked, so `latest` skips it). Under
  torchrun / `accelerate launch` with several ranks the ranks run in sessions of their own: the terminal's Ctrl-C
  reaches the launcher, which forwards one SIGINT to every rank and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT
  seconds later (torch's default: 30 s; the run_peft_*.sh scripts raise it, see scripts/lib/launch_common.sh).
  A SIGINT that was ignored when the run started (a background job of a non-interactive shell, `nohup`) stays
  ignored.
- SIGHUP (the terminal or ssh session closed) is SIGTERM's twin: exit 75, checkpoint, resume line. Output that went
  to the closed terminal would fail from then on (EIO on every write, the progress bar's first), so the ranks whose
  stdout/stderr was a terminal send both to HANGUP_LOG in output_dir, where the stop's lines land. Under a launcher
  the terminal's SIGHUP reaches the launcher, which forwards it to every rank (torch elastic handles SIGHUP). A
  SIGHUP ignored at start (`nohup`) stays ignored.
- A non-finite loss or gradient norm on any rank (divergence.StepHealth): every rank stops at that step, nothing is
  saved, exit divergence.DIVERGED_EXIT_CODE.

The signal handlers only set a flag; at each step end the ranks agree on [signal, non-finite] with one tiny
all-reduce, so they all stop at the same step even when the signal or the NaN reached one of them.
"""

from __future__ import annotations

import logging
import signal

import torch
from transformers import TrainerCallback

from sft_recipe.train.divergence import Diverged, StepHealth, divergence_message

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later" -- what a requeue wrapper can test for
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
# Written to output_dir by a preempted or interrupted run and removed when a later run finishes: the launcher
# (torchrun) reports any failed rank as exit code 1, so wrappers (run_peft_*.sh) look for this file to exit 75 / 130.
PREEMPTED_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# Kept ignored when the run starts with them ignored: Ctrl-C in a background job, SIGHUP under `nohup`.
KEPT_IF_IGNORED = (signal.SIGINT, signal.SIGHUP)
HANGUP_LOG = "hangup.log"  # in output_dir: what a rank printed after its terminal closed


class Preempted(Exception):
    def __init__(self, message: str, exit_code: int = PREEMPTED_EXIT_CODE):
        super().__init__(message)
        self.exit_code = exit_code


class StopAtStepEnd(TrainerCallback):
    """Every rank stops at the same step end when any rank got a stop signal or saw a non-finite value."""

    def __init__(self, trainer, health: StepHealth | None, launcher_shutdown_timeout_s: int | None = None):
        self.trainer = trainer
        self.health = health  # None: --stop_on_nonfinite False
        self.launcher_shutdown_timeout_s = launcher_shutdown_timeout_s  # LaunchEnv's; None: no torchrun around us
        self.signal_name: str | None = None
        self.stopped_at_step: int | None = None
        self.diverged: tuple[int, float | None, float | None, str] | None = None  # step, loss, norm, where
        self._previous = {}
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None  # the last step's flags
        # Read each step's flags one step late (CUDA: no wait for the step's kernels). None: on CUDA devices only;
        # the unit tests set it on CPU so that the lag logic runs in the CPU suite.
        self.read_lagged: bool | None = None
        self._terminal_fds: list[int] = []  # of stdout/stderr, those that were a terminal at train begin

    # --- signals --------------------------------------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.signal_name == "SIGINT":  # the second Ctrl-C: abort now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signal_name = self.signal_name or name
        if signum == signal.SIGHUP:
            self._leave_the_closed_terminal()
        if signum == signal.SIGINT:
            grace = self.launcher_shutdown_timeout_s
            logger.warning("Ctrl-C: every rank finishes this step and writes a checkpoint, then the run exits 130 "
                           "(resume with --resume_from_checkpoint latest). Ctrl-C again aborts at once; what is not "
                           "checkpointed yet is then lost." + (
                               f" The launcher kills the ranks {grace} s after Ctrl-C (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."
                               if grace is not None else ""))

    def _leave_the_closed_terminal(self) -> None:
        """Point this rank's terminal-bound stdout/stderr at output_dir/HANGUP_LOG (appended), then say why there."""
        import os
        import sys

        if self._terminal_fds:
            path = os.path.join(self.trainer.args.output_dir, HANGUP_LOG)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:  # the folder is gone or full: the stop itself still goes ahead
                fd = os.open(os.devnull, os.O_WRONLY)
                path = f"nowhere ({e.strerror}: {path})"
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except OSError:  # what was buffered for the closed terminal is lost with it
                    pass
            for target in self._terminal_fds:
                os.dup2(fd, target)
            os.close(fd)
        logger.warning("SIGHUP (the terminal or session closed): every rank finishes this step and writes a "
                       "checkpoint, then the run exits 75 (resume with --resume_from_checkpoint latest)."
                       + (f" This rank's output goes to {path} from here on." if self._terminal_fds else ""))

    def on_train_begin(self, args, state, control, **kwargs):
        import os

        self._terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]
        for sig in SIGNALS:
            if sig in KEPT_IF_IGNORED and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # started with Ctrl-C or SIGHUP ignored (a background job, nohup): keep it so
            self._previous[sig] = signal.signal(sig, self._on_signal)
            # Restart interrupted system calls: a signal landing inside a gloo/NCCL socket read must not turn into
            # an EINTR error in the collective (the handler only sets a flag).
            signal.siginterrupt(sig, False)

    def on_train_end(self, args, state, control, **kwargs):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    # --- the step-end agreement -------------------------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        device = accelerator.device
        health = torch.zeros(2, dtype=torch.int32, device=device)  # [non-finite loss, non-finite gradient norm]
        if self.health is not None:
            health = self.health.step_flags(device)
            if self.health.scaler_in_use and accelerator.optimizer_step_was_skipped:
                health = torch.zeros_like(health)  # fp16's scaler skipped the step: the weights are untouched
        # [SIGTERM/SIGUSR1 seen, SIGINT seen, ranks with a non-finite loss, the sum of their (rank + 1), ranks with a
        #  non-finite gradient norm]: one all-reduce of 5 integers.
        flags = torch.cat([torch.tensor([self.signal_name not in (None, "SIGINT"), self.signal_name == "SIGINT"],
                                        dtype=torch.int32, device=device), health[:1],
                           health[:1] * (accelerator.process_index + 1), health[1:]])
        if accelerator.num_processes > 1:
            flags = accelerator.reduce(flags, reduction="sum")
        must_read_now = control.should_save or control.should_log or control.should_evaluate or \
            state.global_step >= state.max_steps
        self._decide(self._read(state.global_step, flags, must_read_now), control)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        """An epoch-end save/evaluation (--save_strategy epoch, the guide's) follows: read the flags still in flight,
        and never save a diverged state."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._decide(self._values(pending), control)
        if self.diverged is not None:
            control.should_save = control.should_evaluate = False
        return control

    def _decide(self, flags_step, control) -> None:
        if flags_step is None or self.stopped_at_step is not None:
            return
        (preempted, interrupted, loss_ranks, loss_rank_sum, norm_ranks), step = flags_step
        if loss_ranks > 0 or norm_ranks > 0:
            self._stop_diverged(step, loss_ranks, loss_rank_sum, control)
        elif preempted > 0 or interrupted > 0:
            self.stopped_at_step = self.trainer.state.global_step
            if interrupted > 0:  # Ctrl-C anywhere: every rank exits 130, not 75
                self.signal_name = "SIGINT"
            self.signal_name = self.signal_name or "a signal on another rank"
            control.should_save = True
            control.should_training_stop = True

    def _read(self, step: int, flags: torch.Tensor, must_read_now: bool):
        """(flags, the step they belong to), or None while this step's flags are still in flight.

        On CUDA, `.item()` would wait for the whole step's kernels: instead the flags go to pinned host memory
        without blocking, and the previous step's copy (finished a step ago) is read -- unless this step logs,
        evaluates or saves (those wait for the device anyway): then this step's flags are read at once, so a broken
        state is never saved."""
        lagged = flags.device.type == "cuda" if self.read_lagged is None else self.read_lagged
        if not lagged:
            return tuple(int(x) for x in flags.tolist()), step
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags.clone(), None
        previous, self._pending = self._pending, (step, host, event)
        older = self._values(previous)
        if older is not None and any(older[0]):
            # A stop was asked (or a NaN seen) a step ago, and this step's own flags are still in flight: read them
            # before anything is saved, so that a NaN at this step is never checkpointed as a preemption.
            pending, self._pending = self._pending, None
            current = self._values(pending)
            if any(older[0][2:]):  # the older step diverged: that is the step to report
                return older
            signals = tuple(max(a, b) for a, b in zip(older[0][:2], current[0][:2]))
            return signals + current[0][2:], current[1]
        if must_read_now:
            pending, self._pending = self._pending, None
            return self._values(pending)
        return older

    @staticmethod
    def _values(pending):
        if pending is None:
            return None
        step, host, event = pending
        if event is not None:
            event.synchronize()
        return tuple(int(x) for x in host.tolist()), step

    def _stop_diverged(self, step: int, loss_ranks: int, loss_rank_sum: int, control) -> None:
        loss, grad_norm = self.health.values()  # this rank's loss, if it saw one; the global gradient norm
        # Which ranks' losses: the gradient norm is reduced across ranks, so only the loss tells where it began.
        where = "" if self.trainer.accelerator.num_processes == 1 or not loss_ranks else \
            f"rank {loss_rank_sum - 1}" if loss_ranks == 1 else f"{loss_ranks} ranks"
        self.diverged = (step, loss, grad_norm, where)
        self.stopped_at_step = step
        control.should_save = False  # the weights after this step may hold NaN: never checkpoint them
        control.should_evaluate = False
        control.should_training_stop = True
        control.should_log = True  # the log shows the non-finite loss of this step, not a filtered 0

    # --- after train() ------------------------------------------------------------------------------------------

    def raise_if_stopped(self, output_dir: str, intact_checkpoints) -> None:
        """Diverged (nothing saved) or Preempted (a checkpoint was saved; exit 75, or 130 for Ctrl-C).
        `intact_checkpoints(output_dir)`: the intact checkpoints, newest first (artifacts.checkpoints)."""
        if self.diverged is not None:
            step, loss, grad_norm, where = self.diverged
            # The checkpoint written right before the broken step holds the weights that broke it (a 1e30 update is
            # finite and saved, the next forward is not): name the newest one before that.
            intact = [str(p) for p in intact_checkpoints(output_dir)]
            step_of = {path: int(path.rsplit("-", 1)[-1]) for path in intact}
            usable = next((path for path in intact if step_of[path] < step - 1), None)
            passed_over = next((path for path in intact if step_of[path] == step - 1), None)
            raise Diverged(divergence_message(step, loss, grad_norm, where, self.trainer.args, usable, passed_over))
        if self.stopped_at_step is None:
            return
        interrupted = self.signal_name == "SIGINT"
        if self.trainer.accelerator.is_main_process:
            import json
            import os

            with open(os.path.join(output_dir, PREEMPTED_FILE), "w") as f:
                json.dump({"signal": self.signal_name, "global_step": self.stopped_at_step,
                           "checkpoint": f"checkpoint-{self.stopped_at_step}"}, f)
        by = "Ctrl-C (SIGINT)" if interrupted else self.signal_name
        raise Preempted(
            f"stopped by {by} after step {self.stopped_at_step}; checkpoint saved to "
            f"{output_dir}/checkpoint-{self.stopped_at_step}. Resume: run the same command with "
            f"--resume_from_checkpoint latest", INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE)
