"""bitsandbytes 0.50 and DeepSpeed 0.19's Muon optimizer compile kernels at import that a run of the recipe never calls.

Behaviour (bitsandbytes 0.50, torch 2.13): `bitsandbytes/backends/default/ops.py` wraps four of its "default" kernels
(blockwise dequantization, 4-bit dequantization, the 32-bit optimizer's two steps) in `torch.compile` as the module is
imported (`_try_torch_compile`). `torch.compile` imports torch's inductor to build its backend: ~0.85 s of CPU in
every process of a QLoRA run (a one-process QLoRA launch of the tiny model: 6.6 -> 5.7 CPU-s without it). Those
kernels are the fallback of a device with no kernel of its own: CUDA and the CPU register theirs
(`backends/cuda/ops.py`, `backends/cpu/ops.py`), so the compiled functions are never called there.

What this does: bitsandbytes is imported with `torch.compile` standing in for a wrapper that compiles on the first
call (with the same arguments), then puts `torch.compile` back. A device that does call a default kernel compiles it
then; bitsandbytes' own fallback (the plain function where compiling fails) still catches a failure, now at that
call. Nothing else's `torch.compile` is touched.

DeepSpeed (0.19.8): every ZeRO run's `deepspeed.initialize` checks that the optimizer is one ZeRO supports
(`runtime/zero/utils.py`, `is_zero_supported_optimizer`), and that check imports its Muon optimizer, whose module
decorates the Newton-Schulz kernel with `torch.compile` (`runtime/zero/muon/original_muon.py`, through
`runtime/compiler.compile()`): torch's inductor again, ~0.9 CPU-s in every rank of a DeepSpeed run. The recipe's
optimizers are the Trainer's (`--optim`), never DeepSpeed's Muon, so the kernel is never called; the module is
imported here under the same stand-in, before the check imports it.

When it can go: `tests/test_compat_fresh_process.py::test_importing_bitsandbytes_still_imports_inductor` fails
(bitsandbytes stops compiling at import); for DeepSpeed,
`tests/test_compat_fresh_process.py::test_deepspeeds_zero_optimizer_check_still_imports_inductor` fails.
"""

from __future__ import annotations

import functools
import importlib.util
import sys


def compile_on_first_call(real_compile):
    """A stand-in for `torch.compile` (either form: `compile(fn, **kw)` and the decorator `compile(**kw)`) whose
    functions call `real_compile(fn, **kw)` when first called, once, and its result from then on."""

    def stand_in(model=None, **kwargs):
        if model is None:  # @torch.compile(dynamic=False)
            return lambda fn: stand_in(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return first_call_compiles

    return stand_in


def import_bitsandbytes_compiling_on_first_use() -> bool:
    """Import bitsandbytes now, its import-time compiles deferred to first calls; True if this process imported it so,
    False where it was imported already or is not installed (the package checks name it where a run needs it)."""
    return _import_compiling_on_first_use("bitsandbytes")


def import_muon_compiling_on_first_use() -> bool:
    """Import DeepSpeed's Muon optimizer module (which every ZeRO run's optimizer check imports) with its import-time
    compile deferred to a first call; True if this process imported it so, False where it was imported already or
    DeepSpeed is not installed."""
    return _import_compiling_on_first_use(MUON_MODULE)


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def _import_compiling_on_first_use(module: str) -> bool:
    if module in sys.modules or importlib.util.find_spec(module.partition(".")[0]) is None:
        return False
    import torch

    real_compile = torch.compile
    torch.compile = compile_on_first_call(real_compile)
    try:
        importlib.import_module(module)
    finally:
        torch.compile = real_compile
    return True
