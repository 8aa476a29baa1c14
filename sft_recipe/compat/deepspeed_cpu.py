"""DeepSpeed on a CPU compiles an inference-only op each time a process group starts in a new environment.

Behaviour (deepspeed 0.19): `deepspeed.comm.torch.TorchBackend.__init__`, which every DeepSpeed run reaches through
`deepspeed.init_distributed` (accelerate calls it while TrainingArguments are parsed), calls `build_shm_op()`. On
DeepSpeed's CPU accelerator that JIT-compiles `deepspeed_shm_comm` with ninja and the C++ compiler, then loads it.
Torch's extension cache keeps the build under its name alone, and its build file names the Python environment's
include paths: the first DeepSpeed launch in each environment (a fresh clone's, CI's), or after another environment
built it, compiles again -- 21 s of wall time and ~40 CPU-s on the 2-core machine, measured with the refused
one-process launch of tests/test_deepspeed.py::test_launcher_exports_what_the_check_reads (29 s against 8 s once
built). The op serves `inference_all_reduce` alone (DeepSpeed inference's tensor parallelism); a training run's
collectives are torch.distributed's. On CUDA the accelerator has no such builder and `build_shm_op` answers None.

What this does: in a process that will start DeepSpeed, `build_shm_op` answers None on every accelerator, as it does
on CUDA; `inference_all_reduce`, never called in training, would then use torch.distributed.all_reduce, as on CUDA.

When it can go: tests/unit/test_compat.py::test_deepspeed_still_builds_its_cpu_inference_op_at_init fails
(TorchBackend no longer builds the op while starting).
"""

from __future__ import annotations

import importlib
import importlib.util


def skip_cpu_inference_op_build() -> bool:
    """Keep DeepSpeed from compiling or loading its CPU inference op in this process; True if DeepSpeed is here."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    # By its module's name: the attribute `deepspeed.comm.torch` is torch itself (deepspeed.comm imports it as such).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_inference_op
    return True


def _no_inference_op():
    return None
