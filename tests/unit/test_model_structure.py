"""MoE rules read from module structure (sft_recipe/model/structure.py), on tiny meta-device models of every MoE
style transformers 5 builds: fused experts with an nn.Linear router (Mixtral, Qwen3-MoE, OLMoE, PhiMoE, GraniteMoE,
GPT-OSS, Jamba), a router that is no nn.Linear plus shared experts and dense first layers (DeepSeek-V2/V3, GLM-4-MoE,
ERNIE-4.5), a gated shared expert (Qwen2-MoE, Qwen3-Next, whose linear attention holds a 3-D Conv1d weight), and a
remote-code style ModuleList of experts. For each: all-linear adapts no expert and no router, and PEFT takes it with
the guide's lora_dropout 0.1 (its own all-linear raises there), adapting exactly the modules resolved; the expert
count, top-k, FLOPs and the memory plan's LoRA count agree with what is built."""

from __future__ import annotations

import pytest
import torch

from sft_recipe.model import structure as ms

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
DEEPSEEK = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                moe_intermediate_size=32, n_group=1, topk_group=1)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           num_key_value_heads=4)
# config class -> its arguments beyond SMALL; every model has 4 routed experts, 2 per token, however it spells them
MOE = {
    "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, decoder_sparse_step=1),
    "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                           head_dim=16),
    "DeepseekV3Config": {**DEEPSEEK, **MLA},
    "DeepseekV2Config": {**DEEPSEEK, **MLA},
    "Glm4MoeConfig": {**DEEPSEEK, "head_dim": 16},
    "Ernie4_5_MoeConfig": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                               moe_layer_start_index=1),
    "GraniteMoeConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "GraniteMoeSharedConfig": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
    "PhimoeConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "OlmoeConfig": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0),
    "Qwen3NextConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, decoder_sparse_step=1, head_dim=16,
                            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    "GptOssConfig": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                         layer_types=["sliding_attention", "full_attention"]),
    "JambaConfig": dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
                        attn_layer_period=2, attn_layer_offset=1),
}
# The model types whose dense/shared MLP names PEFT 0.21 rewrites into routed-expert parameters (peft#3711).
REWRITTEN_BY_PEFT = {"DeepseekV3Config", "DeepseekV2Config", "Glm4MoeConfig", "Ernie4_5_MoeConfig",
                     "Qwen3NextConfig"}


def _config(name: str):
    import transformers

    return getattr(transformers, name)(**{**SMALL, **MOE.get(name, {})})


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _adapted(peft_model) -> set[str]:
    """The modules PEFT wrapped, by their names in the base model."""
    return {n.removeprefix("base_model.model.").removesuffix(".base_layer") for n, _ in peft_model.named_modules()
            if n.endswith(".base_layer")}


@pytest.mark.parametrize("name", list(MOE))
def test_all_linear_on_every_moe_style_adapts_no_expert_or_router_and_takes_the_guides_dropout(name):
    from peft import LoraConfig, get_peft_model

    model = _meta(_config(name))
    blocks = ms.expert_blocks(model)
    assert blocks and {b.num_experts for b in blocks} == {4}
    assert ms.expert_count(model) == 4 and ms.experts_per_token(model.config) == 2
    assert ms.active_expert_fraction(model) == 0.5
    targets = ms.resolve_lora_targets("all-linear", model)
    attention = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in n}
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets.target_modules, lora_dropout=0.1, r=8))
    adapted = _adapted(peft_model)
    assert adapted == set(targets.modules)
    inside = tuple(f"{part}." for b in blocks for part in (b.experts, *b.gating))
    assert not any(a.startswith(inside) or a in {g for b in blocks for g in b.gating} for a in adapted)
    assert not any(p.dim() == 3 and p.requires_grad for p in peft_model.parameters())  # no expert trains
    assert attention and attention <= adapted  # the attention is always adapted
    # What is left out is what PEFT would rewrite, and said; elsewhere the dense and shared MLPs are adapted too.
    assert bool(targets.left_out) == (name in REWRITTEN_BY_PEFT)
    assert ("peft#3711" in (targets.note() or "")) == (name in REWRITTEN_BY_PEFT)
    assert not set(targets.left_out) & adapted
    # Jamba's Mamba layers read dt_proj's weight directly: never called, so left out (model_reach), and said.
    assert bool(targets.unreached) == (name == "JambaConfig")
    assert ("never trains" in (targets.note() or "")) == bool(targets.unreached)
    assert not set(targets.unreached) & adapted


@pytest.mark.parametrize("name", ["DeepseekV3Config", "Qwen2MoeConfig", "Glm4MoeConfig"])
def test_shared_experts_dense_layers_and_a_router_that_is_no_linear_are_told_apart(name):
    model = _meta(_config(name))
    (block, *_) = ms.expert_blocks(model)
    modules = dict(model.named_modules())
    assert block.shared and all(sum(isinstance(m, torch.nn.Linear) for m in modules[s].modules()) >= 2
                                for s in block.shared)
    router = modules[block.gating[0]]
    assert any(p.dim() == 2 and p.shape[0] == 4 for p in router.parameters())  # one logit per expert
    if name != "Qwen2MoeConfig":  # a dense first layer, outside every MoE block
        assert not isinstance(router, torch.nn.Linear)
        assert not any(b.name.startswith("model.layers.0.") for b in ms.expert_blocks(model))


def test_a_conv1d_weight_is_not_an_expert():
    model = _meta(_config("Qwen3NextConfig"))
    convs = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d)]
    assert convs and not any(b.experts in convs for b in ms.expert_blocks(model))


class _Expert(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(h, 2 * h), torch.nn.Linear(2 * h, h)


class _Block(torch.nn.Module):
    """Remote-code style MoE: a ModuleList of expert MLPs beside a router with one row per expert."""

    def __init__(self, h: int, experts: int):
        super().__init__()
        self.router = torch.nn.Linear(h, experts, bias=False)
        self.experts = torch.nn.ModuleList(_Expert(h) for _ in range(experts))


class _Layer(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.attn = torch.nn.Linear(h, h)
        self.moe = _Block(h, 3)


def test_a_module_list_of_experts_is_found_and_a_list_of_layers_is_not():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(_Layer(8) for _ in range(3))

    blocks = ms.expert_blocks(Model())
    assert [b.experts for b in blocks] == [f"layers.{i}.moe.experts" for i in range(3)]
    assert {b.num_experts for b in blocks} == {3} and blocks[0].gating == ("layers.0.moe.router",)
    assert not ms.expert_blocks(torch.nn.Sequential(torch.nn.ModuleList(_Expert(8) for _ in range(4))))  # no router


def test_a_dense_model_keeps_peft_all_linear_and_a_listed_target_is_given_as_is():
    model = _meta(_config("LlamaConfig"))
    assert ms.expert_blocks(model) == () and ms.active_expert_fraction(model) == 1.0
    assert ms.resolve_lora_targets("all-linear", model).target_modules == "all-linear"
    listed = ms.resolve_lora_targets("q_proj, v_proj", model)
    assert listed.target_modules == ["q_proj", "v_proj"] and len(listed.modules) == 4 and not listed.rewritten


def test_an_expert_name_peft_rewrites_is_reported_for_validation():
    listed = ms.resolve_lora_targets("q_a_proj,gate_proj,up_proj,down_proj", _meta(_config("DeepseekV3Config")))
    assert set(listed.rewritten) == {"gate_proj", "up_proj", "down_proj"}


def test_flops_count_deepseeks_routed_experts_at_their_active_fraction():
    """The old count read num_local_experts/num_experts only: DeepSeek's n_routed_experts counted every expert."""
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.flops import count_params

    model = AutoModelForCausalLM.from_config(_config("DeepseekV3Config"))
    routed = sum(p.numel() for p in model.parameters() if id(p) in ms.routed_expert_parameter_ids(model))
    shared = sum(p.numel() for p in model.model.layers[1].mlp.shared_experts.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert routed and shared
    assert count_params(model)[0] == total - routed // 2  # 2 of 4 routed experts; shared and dense whole


@pytest.mark.parametrize("name", ["DeepseekV3Config", "MixtralConfig", "Qwen2MoeConfig", "LlamaConfig"])
def test_the_plan_counts_the_lora_parameters_peft_creates_and_the_largest_layer(tmp_path, name):
    from peft import LoraConfig, get_peft_model

    from sft_recipe.plan import model_shape

    _config(name).save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    model = _meta(_config(name))
    layers = model.model.layers
    assert shape.layer_params == max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    targets = ms.lora_targets_of("all-linear", str(tmp_path))
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets.target_modules, r=8, lora_dropout=0.1))
    created = sum(p.numel() for n, p in peft_model.named_parameters() if ".lora_" in n)
    assert shape.lora_params(8, "all-linear") == created


def test_lora_targets_of_a_path_are_resolved_once(tmp_path, monkeypatch):
    import sft_recipe.model.shape as model_shape

    _config("DeepseekV3Config").save_pretrained(tmp_path)
    built = []
    real = model_shape.meta_model
    monkeypatch.setattr(model_shape, "meta_model", lambda *a: built.append(a) or real(*a))
    first = ms.lora_targets_of("all-linear", str(tmp_path))
    assert ms.lora_targets_of("all-linear", str(tmp_path)) is first and len(built) == 1


def test_the_layer_shaped_pattern_matches_the_chosen_modules_in_every_layer_and_nothing_else():
    """The third spelling of a choice is one full-match pattern with the layer number as \\d+. It escaped the dots
    twice (re.escape, then by hand) and so matched nothing; the spelled-out fallback hid that."""
    import re

    chosen = {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.up_proj"}
    others = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    patterns = [c for c in ms._candidates(chosen, sorted(chosen) + others, prefix="") if isinstance(c, str)]
    shaped = patterns[0]
    assert shaped == r"model\.layers\.\d+\.mlp\.up_proj|model\.layers\.\d+\.self_attn\.q_proj"  # written by hand
    for name in chosen | {"model.layers.7.self_attn.q_proj", "model.layers.12.mlp.up_proj"}:
        assert re.fullmatch(shaped, name), name
    for name in others + ["model.layers.0.self_attn.q_proj.lora_A", "model.layersX0.self_attn.q_proj"]:
        assert not re.fullmatch(shaped, name), name
