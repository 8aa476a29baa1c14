"""compat.wrap_other_dtypes_apart: which modules FSDP1 must wrap alone because they keep another dtype than the base.

DeepSeek-V3's router keeps `gate.weight` in fp32 (transformers' `_keep_in_fp32_modules_strict`) whatever the load
dtype; FSDP1 flattens a unit's parameters into one tensor and refused the bf16 decoder layer holding it. The rule is
read from the loaded model's parameters (their dtypes), never from class or parameter names; the e2e cell
deepseek-v3-qlora-fsdp1 in tests/e2e/test_families.py trains through it.
"""

from __future__ import annotations

import pytest
import torch

from sft_recipe.compat.fsdp1_dtype_units import other_dtype_modules, with_units_for
from sft_recipe.config.launch_env import LaunchEnv


@pytest.fixture(scope="module")
def family(tiny, tmp_path_factory):
    from sft_recipe.tiny.families import build_family_model

    root = tmp_path_factory.mktemp("dtype-families")
    return lambda name: build_family_model(root, tiny.root, name)


def _loaded(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def test_a_bf16_deepseek_v3_wraps_its_fp32_routers_alone_and_nothing_else(family):
    model = _loaded(family("deepseek-v3"), torch.bfloat16)
    apart = [name for name, module in model.named_modules() if id(module) in other_dtype_modules(model)]
    fp32 = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.dtype == torch.float32})
    assert apart and apart == fp32  # exactly the modules that hold the fp32 weights (the routers)
    assert all(next(model.get_submodule(n).parameters(recurse=False)).numel() < 10_000 for n in apart)  # small units

    never = lambda module, recurse, nonwrapped_numel: False  # noqa: E731  a policy that wraps nothing
    policy = with_units_for(never, other_dtype_modules(model))
    router = model.get_submodule(apart[0])
    assert policy(module=router, recurse=False, nonwrapped_numel=0)
    assert not policy(module=model.model.layers[0], recurse=False, nonwrapped_numel=0)


@pytest.mark.parametrize("name,dtype", [("deepseek-v3", torch.float32), ("qwen2", torch.bfloat16)])
def test_a_model_of_one_dtype_wraps_as_before(family, name, dtype):
    """fp32 DeepSeek-V3 (the routers are fp32 like the rest) and a bf16 Qwen2: nothing to wrap apart."""
    assert other_dtype_modules(_loaded(family(name), dtype)) == set()


def test_it_is_installed_for_fsdp1_only(monkeypatch):
    import transformers.trainer as trainer_module

    from sft_recipe.compat.fsdp1_dtype_units import wrap_other_dtypes_apart

    original = trainer_module.update_fsdp_plugin_peft
    monkeypatch.setattr(trainer_module, "update_fsdp_plugin_peft", original)  # put back after the test
    assert not wrap_other_dtypes_apart(LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=2))
    assert not wrap_other_dtypes_apart(LaunchEnv(world_size=2))
    assert trainer_module.update_fsdp_plugin_peft is original
    assert wrap_other_dtypes_apart(LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=1))
    assert trainer_module.update_fsdp_plugin_peft is not original
