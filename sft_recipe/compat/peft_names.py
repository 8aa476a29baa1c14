"""peft 0.21: FSDP1's wrapper segments in module names make adapter saves EMPTY; trl 1.16 + peft 0.21: the fused LM
head reads a `bias` that PEFT's trainable-token wrapper does not have."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

_FSDP_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def strip_wrapper_segments(name: str) -> str:
    """'base_model.model.layers.0._fsdp_wrapped_module.self_attn' -> 'base_model.model.layers.0.self_attn'."""
    previous = None
    while previous != name:
        previous, name = name, _FSDP_WRAPPER_SEGMENT.sub(r"\1", name)
    return name


@contextlib.contextmanager
def module_names_without_fsdp_segments(peft_model) -> Iterator[None]:
    """Make `peft_model.named_modules()` report names without FSDP1/checkpoint wrapper segments.

    Bug (peft 0.21.x, not 0.20.0): `get_peft_model_state_dict` finds the LoRA keys from module names and strips only a
    *leading* `_fsdp_wrapped_module.`; FSDP1 TRANSFORMER_BASED_WRAP nests it mid-path
    (`...layers.0._fsdp_wrapped_module.self_attn...`), so no key matches and the adapter is saved EMPTY (a 40-byte
    safetensors, exit code 0). The gathered FULL_STATE_DICT keys are already clean, so reporting clean module names
    makes them match again.
    When it can go: `tests/e2e` logs "adapter keys needed the FSDP1 name fix" for FSDP1 runs; when it stops appearing
    with a newer peft, delete this and its single caller.
    """
    original = peft_model.named_modules

    def clean_named_modules(*args, **kwargs):
        for name, module in original(*args, **kwargs):
            yield strip_wrapper_segments(name), module

    peft_model.named_modules = clean_named_modules
    try:
        yield
    finally:
        del peft_model.named_modules


def fsdp1_checkpoint_model_io_with_clean_names() -> None:
    """Make FSDP1 checkpoints save and load the LoRA weights.

    Bug (peft 0.21 via accelerate 1.15): `save_fsdp_model(..., adapter_only=True)` (what transformers passes for PEFT)
    selects the adapter with `get_peft_model_state_dict`, which misses every LoRA key under FSDP1 (see
    `module_names_without_fsdp_segments`): the checkpoint holds no LoRA weights and a resume continues from fresh
    ones, exit code 0. Fix here: transformers' references to `save_fsdp_model`/`load_fsdp_model` run with clean module
    names for FSDP1. Only the model I/O is wrapped: FSDP's optimizer-state mapping must keep the real names.
    When it can go: with this patch off, `tests/e2e/test_resume.py` FSDP1 still matches the uninterrupted run.
    """
    import transformers.trainer as trainer_module

    for name in ("save_fsdp_model", "load_fsdp_model"):
        original = getattr(trainer_module, name)
        if getattr(original, "_sft_recipe_clean_names", False):
            continue

        def with_clean_names(fsdp_plugin, accelerator, model, *args, _original=original, **kwargs):
            if fsdp_plugin.fsdp_version != 1:
                return _original(fsdp_plugin, accelerator, model, *args, **kwargs)
            with module_names_without_fsdp_segments(model):
                return _original(fsdp_plugin, accelerator, model, *args, **kwargs)

        with_clean_names._sft_recipe_clean_names = True
        setattr(trainer_module, name, with_clean_names)


def trainable_tokens_lm_head_bias() -> None:
    """Let TRL's fused LM head run over PEFT trainable tokens on `lm_head` (--train_new_tokens).

    Bug (trl 1.16 with peft 0.21): the fused head reads `lm_head.weight` and `lm_head.bias` directly instead of calling
    the module. PEFT's `TrainableTokensWrapper` answers `weight` with the merged (trainable) rows but has no `bias`,
    so the first training step raises AttributeError. Fix here: `bias` is the wrapped layer's own bias (None for
    Llama-style heads).
    When it can go: `tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp`
    passes without it.
    """
    from peft.utils.other import TrainableTokensWrapper

    if "bias" not in vars(TrainableTokensWrapper):
        TrainableTokensWrapper.bias = property(lambda self: getattr(self.original_module, "bias", None))


