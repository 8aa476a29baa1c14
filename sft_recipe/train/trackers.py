"""The run's memory plan, sent to the trackers that show it (`--report_to wandb`, `mlflow`), beside the losses and
the measured peak memory per step they already log: what the plan said before the run, and what the run took, on
one page.

W&B: the run's config gets `memory_plan` (the whole plan, `MemoryPlan.to_dict`). MLflow: the run's parameters get
the headline figures (`memory_plan/peak_gib`, ...) and its artifacts `memory_plan.json` (the whole plan). TensorBoard
has no place for a nested record; the plan is `python -m sft_recipe.plan` or `--plan_memory_gib` there.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from sft_recipe.config.launch_env import LaunchEnv, gpu_memory_bytes
from sft_recipe.errors import check_not_run

GIB = 2 ** 30
TRACKERS_SHOWING_THE_PLAN = ("wandb", "mlflow")
HEADLINE = ("device", "setup", "budget_gib", "peak_gib", "largest_phase", "verdict", "host_peak_gib")


def trackers_showing_the_plan(report_to) -> list[str]:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [name for name in TRACKERS_SHOWING_THE_PLAN if name in names]


def plan_for_trackers(model_args, data_args, training_args, launch: LaunchEnv) -> dict | None:
    """This run's memory plan (GPU memory per rank on a GPU, peak RSS per rank on the CPU, against the device's own
    size), on the process that reports (rank 0) of a run that reports to a tracker showing it; None otherwise, or
    where the plan cannot be made (said in a WARNING: the run goes on)."""
    if not launch.is_main_process or not trackers_showing_the_plan(training_args.report_to):
        return None
    gpu_bytes = gpu_memory_bytes(launch)
    device, budget_gib = ("cuda", gpu_bytes / GIB) if gpu_bytes else ("cpu", host_memory_gib())
    try:
        from sft_recipe.plan.planner import plan_memory

        plan = plan_memory(model_args, data_args, training_args, launch.accelerate_config(), None, budget_gib, device,
                           ladder=False)
    except Exception as e:  # noqa: BLE001 -- said; the run itself does not depend on its plan
        check_not_run("the memory plan for the trackers", e)
        return None
    return plan.to_dict()


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


class PlanToTrackers(TrainerCallback):
    """At the start of training (the trackers' own callbacks, added before this one, have opened their runs by then),
    hand the plan to each tracker of `report_to` that shows it."""

    def __init__(self, plan: dict, report_to):
        self.plan = plan
        self.trackers = trackers_showing_the_plan(report_to)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if "wandb" in self.trackers:
            import wandb

            if wandb.run is not None:
                wandb.run.config.update({"memory_plan": self.plan}, allow_val_change=True)
        if "mlflow" in self.trackers:
            import mlflow
            from mlflow.exceptions import MlflowException

            if mlflow.active_run() is not None:
                try:
                    mlflow.log_params({f"memory_plan/{key}": self.plan[key] for key in HEADLINE})
                except MlflowException as e:  # a run continued (MLFLOW_RUN_ID) under new flags:
                    check_not_run("logging the memory plan's figures to MLflow", e)  # its params cannot change
                mlflow.log_dict(self.plan, "memory_plan.json")
