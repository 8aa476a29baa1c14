"""What each model family needs (sft_recipe.model.architecture), decided from its config: attention, what
`all-linear` adapts, fused-expert targets, tied embeddings kept tied, resized vocabularies of nested configs saved."""

from __future__ import annotations

import pytest
import torch

from sft_recipe.config.args import ModelArguments
from sft_recipe.model import architecture
from sft_recipe.model.shape import meta_model
from sft_recipe.model.structure import fused_expert_parameters
from sft_recipe.train.model import attention_kwargs, materialize_meta_parameters


def _args(path, **kw) -> ModelArguments:
    return ModelArguments(**{"model_name_or_path": str(path), "use_peft_lora": True,
                             "lora_target_modules": "all-linear", **kw})


def test_attention_is_transformers_choice_unless_flash_is_asked(family_model):
    from transformers import AutoModelForCausalLM

    assert attention_kwargs(_args("x")) == {}  # no attn_implementation: transformers picks per class
    assert attention_kwargs(_args("x", use_flash_attn=True)) == {"attn_implementation": "flash_attention_2"}
    gemma2 = AutoModelForCausalLM.from_pretrained(str(family_model("gemma2")), **attention_kwargs(_args("x")))
    assert gemma2.config._attn_implementation == "eager"  # what Gemma-2's soft-capping requires
    assert "attention: eager for Gemma2ForCausalLM" in architecture.attention_note(gemma2)
    llama = AutoModelForCausalLM.from_pretrained(str(family_model("llama")), **attention_kwargs(_args("x")))
    assert llama.config._attn_implementation == "sdpa"


def test_flash_attention_on_a_class_without_it_is_refused_up_front(family_model):
    problem = architecture.flash_attention_problem(_args(family_model("gemma3-multimodal"), use_flash_attn=True))
    assert problem and "Gemma3ForConditionalGeneration" in problem and "--use_flash_attn False" in problem
    assert architecture.flash_attention_problem(_args(family_model("gemma2"), use_flash_attn=True)) is None
    assert architecture.flash_attention_problem(_args(family_model("gemma3-multimodal"))) is None  # not asked


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "gpt-neox"])
def test_all_linear_stays_peft_all_linear_where_peft_is_right(family_model, family):
    assert architecture.lora_targets(_args(family_model(family))).target_modules == "all-linear"


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_all_linear_on_moe_is_attention_and_shared_projections_never_experts_or_router(family_model, family):
    from peft import LoraConfig, get_peft_model

    path = family_model(family)
    targets = architecture.lora_targets(_args(path)).target_modules
    assert targets == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert fused_expert_parameters(meta_model(str(path)))  # the experts are there, as 3-D parameters
    # With the guide's dropout, PEFT's own all-linear raises on this model; the resolved targets do not.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    with pytest.raises(ValueError, match="ParamWrapper does not work with lora_dropout"):
        get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                       LoraConfig(target_modules="all-linear", lora_dropout=0.1))
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, lora_dropout=0.1))
    adapted = {n for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted and not any(".mlp." in n for n in adapted)


def test_experts_are_adapted_only_when_named_and_with_dropout_zero(family_model):
    path = family_model("qwen3-moe")
    named = _args(path, lora_target_parameters="experts.gate_up_proj,experts.down_proj", lora_dropout=0.1)
    problems = architecture.target_parameter_problems(named)
    assert len(problems) == 1 and "--lora_dropout 0" in problems[0] and "ParamWrapper" in problems[0]
    assert architecture.target_parameter_problems(_args(path, lora_target_parameters="experts.gate_up_proj",
                                                        lora_dropout=0.0)) == []
    wrong = architecture.target_parameter_problems(_args(path, lora_target_parameters="experts.nope",
                                                         lora_dropout=0.0))
    assert len(wrong) == 1 and "experts.nope" in wrong[0] and "gate_up_proj" in wrong[0]
    assert architecture.lora_target_parameters(_args(path)) is None


def test_a_multimodal_checkpoint_adapts_its_language_model_only(family_model):
    path = family_model("gemma3-multimodal")
    from peft import LoraConfig, get_peft_model

    targets = architecture.lora_targets(_args(path)).target_modules
    model = meta_model(str(path))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    peft_model = get_peft_model(meta_model(str(path)), LoraConfig(target_modules=targets))
    chosen = [n.removeprefix("base_model.model.").removesuffix(".base_layer") for n, _ in peft_model.named_modules()
              if n.endswith(".base_layer")]
    assert chosen and all("language_model" in n for n in chosen)
    assert any("vision_tower" in n for n in linears)  # there was a vision tower to leave alone
    assert len(chosen) == 2 * 7  # 2 decoder layers x q,k,v,o,gate,up,down


def test_materialized_meta_parameters_stay_tied(family_model):
    model = meta_model(str(family_model("qwen2")))
    assert architecture.tied_parameter_names(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    materialize_meta_parameters(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one storage, two names
    assert model.lm_head.weight.device.type == "cpu"


def test_a_nested_text_config_saves_the_resized_vocabulary(family_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.compat import save_embedding_layers_for

    for family, expected in (("gemma3-multimodal", True), ("qwen2", "auto")):
        path = family_model(family)
        model = AutoModelForCausalLM.from_pretrained(str(path))
        rows = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(rows + 3, mean_resizing=False)
        peft_model = get_peft_model(model, LoraConfig(
            target_modules=architecture.lora_targets(_args(path)).target_modules))
        assert save_embedding_layers_for(peft_model) == expected  # "auto": PEFT's own rule already sees it


@pytest.mark.parametrize("family", ["llama-tied", "gemma2", "gemma3-multimodal", "mixtral", "qwen3-moe", "gpt-neox",
                                    "phi3", "deepseek-v3"])
def test_the_plan_reads_each_familys_shape_from_its_config(family_model, family):
    """Nested text configs, head_dim != hidden/heads, fused experts and non-Llama layouts are counted as built."""
    from transformers import AutoModelForCausalLM

    from sft_recipe.model.structure import active_expert_fraction
    from sft_recipe.plan import model_shape
    from sft_recipe.train.flops import count_params

    path = family_model(family)
    shape = model_shape(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    text = model.config.get_text_config()
    assert shape.total_params == sum(p.numel() for p in model.parameters())  # all experts held, a tied head once
    assert shape.num_layers == text.num_hidden_layers  # the decoder's layers, not a vision tower's
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert shape.head_dim == head_dim and shape.kv_width == text.num_key_value_heads * head_dim
    total, _ = count_params(model)  # FLOPs per token: only the routed experts' weights
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    assert total == pytest.approx(shape.total_params - experts * (1 - active_expert_fraction(model)), abs=len(
        [p for p in model.parameters() if p.dim() == 3]))
    if family in ("mixtral", "qwen3-moe", "deepseek-v3"):
        assert experts and active_expert_fraction(model) == 0.5  # 2 of 4 experts per token


def test_a_tied_embedding_trained_in_full_stays_tied_and_fsdp2_efficient_loading_is_refused(family_model):
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.train.model import lora_config

    tied = _args(family_model("qwen2"), lora_modules_to_save="embed_tokens,lm_head")
    untied = _args(family_model("llama"), lora_modules_to_save="embed_tokens,lm_head")
    assert lora_config(tied).ensure_weight_tying is True  # PEFT keeps the two trained copies one tensor
    assert lora_config(untied).ensure_weight_tying is False
    assert lora_config(_args(family_model("qwen2"))).ensure_weight_tying is False  # nothing of them trained
    fsdp2 = LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=2, fsdp_cpu_ram_efficient_loading=True)
    problem = architecture.tied_training_problem(tied, launch=fsdp2)
    assert problem and "fsdp_cpu_ram_efficient_loading: false" in problem
    assert architecture.tied_training_problem(untied, launch=fsdp2) is None
    plain = LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=2, fsdp_cpu_ram_efficient_loading=False)
    assert architecture.tied_training_problem(tied, launch=plain) is None
