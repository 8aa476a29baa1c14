"""GPT-QModel builds a kernel it is about to refuse for training.

Loading a GPTQ base with `--gptq_backend auto_trainable` (the recipe's default) has GPT-QModel try each candidate
kernel with `BaseQuantLinear.validate(..., trainable=True)`. Its validate runs `cached_validate_once()` first, and a
kernel's `validate_once` builds its C++ extension; only then `_validate` reads `SUPPORTS_TRAINING`. On CPU the first
candidate is the AVX512 inference kernel (`TorchCpuAvx512Linear`, SUPPORTS_TRAINING = False): every machine that had
not built it before JIT-compiled it (~75 CPU-s, measured 2026-12-07; then cached in ~/.cache/gptqmodel), to then
train with `TorchAtenLinear` as before. GPT-QModel 7.7.0; the test that shows when this can go:
tests/test_gptq.py::test_gpt_qmodel_builds_no_kernel_it_cannot_train_with.

`check_trainability_before_building()` makes validate refuse a kernel that cannot train before it builds anything,
with the error `_validate` gives; every other check, and the choice among trainable kernels, stay GPT-QModel's.
Called where the recipe asks for a trainable kernel (sft_recipe/train/gptq.py); a no-op when already done.
"""

from __future__ import annotations

import functools


def check_trainability_before_building() -> bool:
    """Patch GPT-QModel's BaseQuantLinear.validate; True when this call patched it."""
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    upstream = BaseQuantLinear.__dict__["validate"].__func__
    if getattr(upstream, "recipe_checks_trainability_first", False):
        return False

    @functools.wraps(upstream)
    def validate(cls, *args, trainable=None, **kwargs):
        if trainable and not cls.SUPPORTS_TRAINING:
            return False, NotImplementedError(f"{cls} does not support training.")
        return upstream(cls, *args, trainable=trainable, **kwargs)

    validate.recipe_checks_trainability_first = True
    BaseQuantLinear.validate = classmethod(validate)
    return True
