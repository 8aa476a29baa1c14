"""Keep bitsandbytes, wandb, MLflow and DeepSpeed out of a launched run that will not use them.

Behaviour (bitsandbytes 0.50, torch 2.13): importing bitsandbytes wraps four of its kernels in `torch.compile` at
import time (`backends/default/ops.py`, `_try_torch_compile`), and that call imports `torch._inductor.compile_fx`:
0.7-0.8 s of CPU in every process. PEFT imports bitsandbytes whenever it is installed (`peft/helpers.py`), and
transformers imports PEFT while train.py imports the trainer: so every rank of every run paid it, LoRA runs that
never quantize included. On a two-rank CPU launch of the tiny model that was 1.6 of 13.8 CPU seconds.

Behaviour (trl 1.16, wandb 0.31): `trl/trainer/base_trainer.py` imports wandb at import time whenever it is installed
(for a model card's link), and wandb's import brings pydantic, click and protobuf: ~0.27 s in every process of every
run, whatever --report_to says.

Behaviour (deepspeed 0.19, mlflow 3.18): `deepspeed/runtime/config.py` imports DeepSpeed's autotuner, whose module
imports mlflow whenever it is installed (for the autotuner's own experiment logging), and mlflow's import brings its
tracing, pydantic and protobuf: ~0.9 CPU-s in every rank of every DeepSpeed run, whatever --report_to says (the
autotuner is a launcher mode, `deepspeed --autotuning`; a run never starts it).

Behaviour (accelerate 1.15, deepspeed 0.19): `accelerate.utils.extract_model_from_parallel`, which the Trainer and
accelerate call while setting up any run (`is_peft_model`, `unwrap_model`), imports DeepSpeed whenever it is
installed, to add `DeepSpeedEngine` to the wrappers it unwraps: ~1.2 s of CPU in every rank of every FSDP or
one-process run on a machine that has DeepSpeed (as this suite's does; DeepSpeed users' GPU machines often do).

What this does: before the libraries load, where `config.command_line` finds that the run cannot use one
(`bitsandbytes_needed`: no 4-/8-bit quantization, no bitsandbytes optimizer, a local base that is not quantized;
`wandb_needed`: --report_to names neither wandb nor all; `mlflow_needed`: likewise for mlflow;
`deepspeed_needed`: neither a DeepSpeed launch nor --deepspeed; anything it cannot read keeps it),
`sys.modules[name] = None` makes every `import name` fail as if it were not installed, and
`importlib.util.find_spec` (how transformers, PEFT and TRL decide availability) answers None.

When it can go: `tests/test_compat_fresh_process.py::test_importing_bitsandbytes_still_imports_inductor` fails
(bitsandbytes stops compiling at import); `tests/unit/test_compat.py::test_importing_trls_trainer_still_imports_wandb`
fails (TRL stops importing wandb at import);
`tests/unit/test_compat.py::test_deepspeeds_config_still_imports_mlflow_through_its_autotuner` fails (DeepSpeed
stops importing mlflow when its config module loads);
`tests/test_compat_fresh_process.py::test_accelerates_unwrapping_still_imports_deepspeed` fails (accelerate stops
importing DeepSpeed to unwrap a model that is not DeepSpeed's).
"""

from __future__ import annotations

import sys

KEPT_OUT = ("bitsandbytes", "wandb", "mlflow", "deepspeed")  # what a run may keep out


def _keep_out(name: str) -> bool:
    if name in sys.modules:  # something imported it already
        return False
    sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    return True


def skip_unused_bitsandbytes() -> bool:
    """Keep bitsandbytes out of this process (the caller decided the run will not use it); True if it was kept out,
    False where something imported it already."""
    return _keep_out("bitsandbytes")


def skip_unused_wandb() -> bool:
    """Keep wandb out of this process (the caller decided the run does not report to it); as above."""
    return _keep_out("wandb")


def skip_unused_mlflow() -> bool:
    """Keep mlflow out of this process (the caller decided the run does not report to it); as above."""
    return _keep_out("mlflow")


def skip_unused_deepspeed() -> bool:
    """Keep DeepSpeed out of this process (the caller decided the run does not use it); as above."""
    return _keep_out("deepspeed")


def skipped_imports() -> list[str]:
    """What this process kept out (the run record's `run.skipped_imports`)."""
    return [name for name in KEPT_OUT if name in sys.modules and sys.modules[name] is None]
