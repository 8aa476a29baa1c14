"""Keep bitsandbytes out of a launched run that will not use it.

Behaviour (bitsandbytes 0.50, torch 2.13): importing bitsandbytes wraps four of its kernels in `torch.compile` at
import time (`backends/default/ops.py`, `_try_torch_compile`), and that call imports `torch._inductor.compile_fx`:
0.7-0.8 s of CPU in every process. PEFT imports bitsandbytes whenever it is installed (`peft/helpers.py`), and
transformers imports PEFT while train.py imports the trainer: so every rank of every run paid it, LoRA runs that
never quantize included. On a two-rank CPU launch of the tiny model that was 1.6 of 13.8 CPU seconds.

What this does: before the libraries load, where `config.command_line.bitsandbytes_needed` finds that the run
cannot use it (no 4-/8-bit quantization, no bitsandbytes optimizer, a local base that is not quantized; anything it
cannot read keeps it), `sys.modules["bitsandbytes"] = None` makes every `import bitsandbytes` fail as if it were not
installed, and `importlib.util.find_spec` (how transformers and PEFT decide availability) answers None.

When it can go: `tests/unit/test_compat.py::test_importing_bitsandbytes_still_imports_inductor` fails (bitsandbytes
stops compiling at import).
"""

from __future__ import annotations

import sys


def skip_unused_bitsandbytes() -> bool:
    """Keep bitsandbytes out of this process (the caller decided the run will not use it); True if it was kept out,
    False where something imported it already."""
    if "bitsandbytes" in sys.modules:
        return False
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    return True


def skipped_imports() -> list[str]:
    """What this process kept out (the run record's `run.skipped_imports`)."""
    return [name for name in ("bitsandbytes",) if name in sys.modules and sys.modules[name] is None]
