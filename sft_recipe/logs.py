"""What a run prints: one copy of each library notice, not one per rank, and no notices that say nothing to a user.

A run of N ranks executes the same imports and data preparation N times, so every progress bar, info log and
deprecation warning would print N times. The main process shows them; the others show errors only.
"""

from __future__ import annotations

import logging
import warnings


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_library_notices() -> None:
    """Notices that say nothing a user can act on, silenced once per process (sft_recipe/__init__ calls this before
    any library logs them).

    - bitsandbytes 0.50, CPUs with AVX512-BF16, at import: "Failed to load CPU gemm_4bit_forward from
      kernels-community ..." (an optional kernel from the Hub; the recipe runs without it).
    - DeepSpeed 0.18, when transformers/accelerate merely probe for it (every run, DeepSpeed or not): "Setting
      accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." On a GPU machine it is
      not logged; on a CPU machine the run already says it runs on cpu. A filter, because DeepSpeed resets its
      logger's level when it is imported.
    - transformers 5.24 FutureWarnings about its own renaming `gradient_checkpointing` -> `activation_checkpointing`
      (TrainingArguments field and `is_gradient_checkpointing`, which PEFT and TRL call): the recipe keeps upstream's
      flag `--gradient_checkpointing`, and nothing a user passes changes the warning.
    When each can go: `make demo` prints none of them without this function.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").addFilter(_DropMessage("Setting accelerator to CPU"))
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing` is deprecated", category=FutureWarning)


def quiet_other_ranks(launch) -> None:
    """On every rank but the main one: no progress bars, no info or warning logs, no Python warnings; rank 0 shows
    each once. Errors still print from every rank."""
    if launch.is_main_process:
        return
    import datasets
    import transformers

    warnings.simplefilter("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
