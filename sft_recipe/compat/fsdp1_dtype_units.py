"""peft 0.21 + torch FSDP1: a model that keeps some weights in fp32 beside a bf16 (or 4-bit, bf16-stored) base
cannot be wrapped: FSDP1 flattens each unit's parameters into one tensor of one dtype."""

from __future__ import annotations

import functools
from collections import Counter

import torch


def other_dtype_modules(model: torch.nn.Module) -> set[int]:
    """The modules (by id) that hold parameters of a dtype other than the model's main one (the dtype most of its
    weights have): each must be an FSDP1 unit of its own. Empty when every parameter has one dtype."""
    weights = Counter()
    for param in model.parameters():
        weights[param.dtype] += param.numel()
    if len(weights) < 2:
        return set()
    main = weights.most_common(1)[0][0]
    return {id(module) for module in model.modules()
            if any(p.dtype != main for p in module.parameters(recurse=False))}


def wrap_other_dtypes_apart(launch) -> bool:
    """Under FSDP1, give every module whose own parameters have another dtype than the model's an FSDP unit of its own.

    Bug (peft 0.21's `fsdp_auto_wrap_policy`, which transformers 5.24's Trainer applies through
    `update_fsdp_plugin_peft`; torch 2.13's FSDP1 `FlatParamHandle`): FSDP1 flattens every parameter of a unit into
    one FlatParameter and raises "Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32".
    PEFT's policy puts the (fp32) LoRA layers in units of their own, but not the frozen weights transformers keeps in
    fp32 whatever the load dtype (`_keep_in_fp32_modules_strict`: the MoE routers of DeepSeek-V2/V3, Dots1,
    ERNIE-4.5-MoE, Kimi and ~20 other families, `gate.weight`). So with a bf16 base -- the recipe's default for LoRA
    under --bf16 True, and the guide's QLoRA storage -- those families died at wrapping, after the load. FSDP2 shards
    each parameter on its own and trains them (checked: DeepSeek-V3, FSDP2, bf16 base).
    Fix here: after Trainer sets PEFT's policy, add one more: a module holding parameters of another dtype than the
    model's main one is wrapped alone (the router: one small fp32 unit; it computes as FSDP1's mixed precision
    says, as the rest of the model does). A model of one dtype wraps exactly as before.
    When it can go: the deepseek-v3-qlora-fsdp1 cell of tests/e2e/test_families.py wraps without it.
    """
    if not (launch.use_fsdp and launch.fsdp_version == 1):
        return False
    import transformers.trainer as trainer_module

    original = trainer_module.update_fsdp_plugin_peft
    if getattr(original, "_sft_recipe_dtype_units", False):
        return True

    def update_with_dtype_units(model, accelerator):
        original(model, accelerator)
        plugin = accelerator.state.fsdp_plugin
        apart = other_dtype_modules(model)
        if apart and plugin.auto_wrap_policy is not None:
            plugin.auto_wrap_policy = with_units_for(plugin.auto_wrap_policy, apart)

    update_with_dtype_units._sft_recipe_dtype_units = True
    trainer_module.update_fsdp_plugin_peft = update_with_dtype_units
    return True


def with_units_for(policy, module_ids: set[int]):
    """`policy`, or-ed with one that wraps the modules in `module_ids` (FSDP1's auto-wrap policy protocol)."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    apart = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda module: id(module) in module_ids)
    return functools.partial(_or_policy, policies=[policy, apart])
