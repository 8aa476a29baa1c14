"""A launched process's start: what train.py decides before the libraries load.

`prepare_imports(argv)`: the libraries import without Python's cyclic garbage collector (below); bitsandbytes, wandb,
MLflow and DeepSpeed stay out of a run that cannot use them (sft_recipe/compat/unused_imports.py), bitsandbytes'
import-time compiles and those of DeepSpeed's Muon module wait for a first call that never comes
(compat/deferred_compile.py), a DeepSpeed run does not compile DeepSpeed's CPU inference op (compat/deepspeed_cpu.py),
and transformers and its model classes import without reading every model file (compat/models_import_structure.py).

The collector:

Importing torch, transformers, PEFT, TRL and datasets creates ~0.7 million objects that live as long as the process
(train.py's imports: `gc.get_freeze_count()` after them). With the collector on, every generation-2 collection walks
all of them again, and the imports alone trigger many; so do the model load and the trainer's set-up after them.
Measured on the 2-core machine, tiny model, 8 steps, medians of 3 (2026-12-05): one process 5.5 -> 3.9 CPU-s;
FSDP2 on 2 ranks through `accelerate launch` 10.6 -> 8.9 CPU-s (the launcher's own ~1.6 s unchanged). On a GPU
machine every rank starts ~1.5 s sooner.

`freeze_imports()` moves everything the imports created into the permanent generation, which no collection walks;
objects created afterwards (each step's) are collected as before. The cost: cyclic garbage the imports left
(~10 MiB a process, measured as peak RSS 505 -> 516 MiB) is never freed.

Entry points call `pause_collector()` (or `prepare_imports`, `prepare_tool_imports`) before their first heavy import
and `freeze_imports()` after the last: train.py, merge_adapter.py, and the workers that stand for train.py in the
tests and benchmarks.
"""

from __future__ import annotations

import gc


def prepare_imports(argv: list[str]) -> None:
    """Before the libraries load, for a run of train.py with `argv` (config.command_line reads it; anything it cannot
    read keeps the library): pause the collector, keep out or defer what the run cannot use."""
    pause_collector()
    # These import sft_recipe.compat, hence torch and accelerate: none of bitsandbytes, wandb, mlflow, DeepSpeed.
    from sft_recipe.compat.deepspeed_cpu import skip_cpu_inference_op_build
    from sft_recipe.compat.deferred_compile import (
        import_bitsandbytes_compiling_on_first_use,
        import_muon_compiling_on_first_use,
    )
    from sft_recipe.compat.models_import_structure import cache_models_import_structure
    from sft_recipe.compat.unused_imports import (
        skip_unused_bitsandbytes,
        skip_unused_deepspeed,
        skip_unused_mlflow,
        skip_unused_wandb,
    )
    from sft_recipe.config.command_line import bitsandbytes_needed, deepspeed_needed, mlflow_needed, wandb_needed
    from sft_recipe.config.launch_env import may_use_deepspeed, recipe_cache_dir

    if not bitsandbytes_needed(argv):  # before PEFT imports it (0.8 CPU-s a rank)
        skip_unused_bitsandbytes()
    else:  # its import compiles kernels no CUDA or CPU run calls (0.85 s): they wait for a first call
        import_bitsandbytes_compiling_on_first_use()
    if not wandb_needed(argv):  # before TRL imports it (0.27 CPU-s a rank)
        skip_unused_wandb()
    if not mlflow_needed(argv):  # before DeepSpeed's autotuner imports it (0.9 CPU-s a DeepSpeed rank)
        skip_unused_mlflow()
    if not deepspeed_needed(argv, may_use_deepspeed()):  # before accelerate imports it (1.2 CPU-s a rank)
        skip_unused_deepspeed()
    else:  # before accelerate starts it: no C++ build of an op training never calls (21 s on a fresh CPU machine)
        skip_cpu_inference_op_build()
        import_muon_compiling_on_first_use()  # before ZeRO's optimizer check imports it: no inductor (0.9 CPU-s)
    # before transformers: its import and transformers.models' each read 1,700 model files (0.24 CPU-s a scan)
    cache_models_import_structure(recipe_cache_dir())


def prepare_tool_imports(imports_peft: bool = True) -> None:
    """Before the libraries load, for the recipe's other commands (merge_adapter.py, the planner, the test and
    benchmark workers): the collector paused and transformers' models scan cached; where the tool
    imports PEFT (`imports_peft`), which imports bitsandbytes whenever it is installed, bitsandbytes imported with its
    compiles deferred. Nothing is kept out: a tool's command line does not say what it will meet."""
    pause_collector()
    from sft_recipe.compat.deferred_compile import import_bitsandbytes_compiling_on_first_use
    from sft_recipe.compat.models_import_structure import cache_models_import_structure
    from sft_recipe.config.launch_env import recipe_cache_dir

    if imports_peft:
        import_bitsandbytes_compiling_on_first_use()
    cache_models_import_structure(recipe_cache_dir())


def pause_collector() -> None:
    gc.disable()


def freeze_imports() -> None:
    """Everything alive now is kept out of every later collection; collecting resumes for what comes next."""
    global _frozen
    gc.freeze()
    gc.enable()
    _frozen = True


_frozen = False


def imports_frozen() -> bool:
    """Whether this process froze its imports (the run record's `run.imports_frozen`). A flag, not
    `gc.get_freeze_count()`: counting walks every frozen object (~0.05 s for train.py's ~0.7 million)."""
    return _frozen
