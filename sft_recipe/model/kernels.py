"""transformers 5.24: which kernel packages a model's packed-sequence training needs, read from what the library
decided when it imported the modeling module.

Gap: `transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(func_name, package)` decorates
the sequence-mixing functions of Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, Nemotron-H, Qwen3.5/Qwen3-Next, Kimi-Linear,
LFM2, OLMo-hybrid, ... At import it looks for `package` (causal_conv1d, mamba_ssm, fla); without it the function is
the torch reference, which "can't keep packed sequences apart" (its own message): it raises once training passes
packed-sequence boundaries, after every weight loaded -- or, in a model that does not pass them, lets a convolution
run across documents. transformers offers no public way to ask, so this reads the decorated function's closure:
`is_new_implementation` (False: the torch fallback) and `package`.
When it can go: transformers exposes which kernels a model class falls back on (tests/unit/test_model_reach.py
::test_the_kernel_reader_sees_mamba_fall_back fails on a transformers whose wrapper keeps these elsewhere).
"""

from __future__ import annotations

import sys


def _closure(function) -> dict:
    code = getattr(function, "__code__", None)
    if code is None or not function.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, function.__closure__)}


def packing_kernel_gaps(model_class) -> dict[str, list[str]]:
    """{missing distribution: [functions of the model's modeling module falling back on torch without it]}."""
    from transformers.integrations import hub_kernels

    distributions = getattr(hub_kernels, "_PACKAGE_TO_DISTRIBUTION", {})
    module = sys.modules.get(model_class.__module__)
    gaps: dict[str, list[str]] = {}
    for name, value in sorted(vars(module).items() if module else ()):
        if not callable(value) or not hasattr(value, "__wrapped__"):
            continue
        closure = _closure(value)
        if closure.get("is_new_implementation") is False and isinstance(closure.get("package"), str):
            package = closure["package"]
            gaps.setdefault(distributions.get(package, package), []).append(name)
    return gaps
