"""What training runs of a model, asked of the model and the libraries (sft_recipe/model/reach.py), and the family
refusals built on it (sft_recipe/model/family_rules.py), on tiny meta-device models from transformers' own config
classes: a decoder-only Llama, Gemma (tied) and Mixtral (MoE) that nothing refuses; BERT as a causal LM (a prediction
head TRL never runs); CTRL (no activation checkpointing); TrOCR (cross-attention nothing calls); Mamba (PEFT refuses
out_proj, dt_proj's weight is read directly, the conv kernels are missing here); Jamba (out_proj allowed); Qwen3.5
(linear attention: packing needs kernels); Llama-4-text and GraniteMoE (what TRL's fused head reads)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from sft_recipe.compat.trl_fused_head import _expose_backbone, _name_the_expert_count
from sft_recipe.model import reach
from sft_recipe.model.family_rules import family_problems
from sft_recipe.model.kernels import packing_kernel_gaps
from sft_recipe.model.structure import resolve_lora_targets

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
CONFIGS = {
    "LlamaConfig": SMALL,
    "Gemma2Config": {**SMALL, "head_dim": 16},
    "MixtralConfig": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
    "BertConfig": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=128, is_decoder=True),
    "CTRLConfig": dict(n_embd=64, dff=128, n_layer=2, n_head=4, vocab_size=128),
    "TrOCRConfig": dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, vocab_size=128),
    "MambaConfig": dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, state_size=8),
    "JambaConfig": {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2,
                    "attn_layer_offset": 1},
    "Qwen3_5TextConfig": {**SMALL, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                          "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                          "layer_types": ["linear_attention", "full_attention"]},
    "Llama4TextConfig": {**SMALL, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
                         "intermediate_size_mlp": 128},
    "GraniteMoeConfig": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
}
DECODERS = ("LlamaConfig", "Gemma2Config", "MixtralConfig")


def _meta(name: str):
    import transformers
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(getattr(transformers, name)(**CONFIGS[name]))


def _linears(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _args(targets: str = "all-linear", gradient_checkpointing=True, packing=True):
    return (SimpleNamespace(model_name_or_path="tiny", use_peft_lora=True, lora_target_modules=targets),
            SimpleNamespace(gradient_checkpointing=gradient_checkpointing, packing=packing))


@pytest.mark.parametrize("name", DECODERS)
def test_a_decoder_only_model_is_refused_nothing_and_every_linear_but_the_head_is_reached(name):
    model = _meta(name)
    assert reach.backbone(model) is model.model and reach.head_bypassed_modules(model) == []
    reached = reach.reached_linears(model)
    head = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    assert reached == _linears(model) - head  # the fused MoE experts are no nn.Linear; the router is called
    assert reach.gradient_checkpointing_support(model) and packing_kernel_gaps(type(model)) == {}
    assert family_problems(*_args(), model) == []
    assert family_problems(*_args("q_proj,v_proj"), model) == []


def test_a_bert_style_prediction_head_is_not_a_causal_lm_and_is_refused():
    model = _meta("BertConfig")
    assert "cls.predictions.transform.dense" in reach.head_bypassed_modules(model)
    (problem,) = family_problems(*_args(), model)
    assert "no decoder-only causal-LM layout" in problem and "cls.predictions" in problem and "Fix:" in problem


def test_a_class_without_activation_checkpointing_is_refused_only_when_asked_for_it():
    model = _meta("CTRLConfig")
    assert not reach.gradient_checkpointing_support(model)
    (problem,) = family_problems(*_args(gradient_checkpointing=True), model)
    assert problem.startswith("--gradient_checkpointing True") and "Fix: --gradient_checkpointing False" in problem
    assert family_problems(*_args(gradient_checkpointing=False), model) == []


def test_cross_attention_nothing_calls_is_left_out_of_all_linear_and_refused_when_named():
    model = _meta("TrOCRConfig")
    unreached = _linears(model) - reach.reached_linears(model)
    assert {n for n in unreached if ".encoder_attn." in n} and all(".encoder_attn." in n or n == "output_projection"
                                                                    for n in unreached)
    targets = resolve_lora_targets("all-linear", model)
    assert not any(".encoder_attn." in n for n in targets.modules) and any(".self_attn." in n for n in targets.modules)
    assert "never trains" in targets.note()
    (problem,) = family_problems(*_args("q_proj,v_proj"), model)
    assert "not trained as plain linears" in problem and "encoder_attn" in problem and "Fix: all-linear" in problem
    assert family_problems(*_args(), model) == []


def test_mamba_all_linear_leaves_out_what_peft_refuses_and_what_is_never_called():
    from peft import LoraConfig, get_peft_model

    model = _meta("MambaConfig")
    assert set(reach.peft_refused(model, _linears(model))) == {n for n in _linears(model) if n.endswith("out_proj")}
    targets = resolve_lora_targets("all-linear", model)
    leaves = {n.rsplit(".", 1)[-1] for n in targets.modules}
    assert leaves == {"in_proj", "x_proj"}  # out_proj refused by PEFT, dt_proj's weight read by the scan directly
    assert "PEFT refuses" in targets.note() and "never trains" in targets.note()
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets.target_modules, lora_dropout=0.1))
    assert {n.removeprefix("base_model.model.").removesuffix(".base_layer") for n, _ in peft_model.named_modules()
            if n.endswith(".base_layer")} == set(targets.modules)
    problems = family_problems(*_args("out_proj,x_proj", packing=False), _meta("MambaConfig"))
    assert len(problems) == 1 and "PEFT refuses ['out_proj']" in problems[0]


def test_peft_refuses_out_proj_only_where_peft_says_so():
    assert reach.peft_refused(_meta("JambaConfig"), _linears(_meta("JambaConfig"))) == {}


@pytest.mark.parametrize("name", ["MambaConfig", "Qwen3_5TextConfig", "JambaConfig"])
def test_packing_is_refused_where_a_kernel_package_is_missing_and_the_reader_agrees_with_the_import(name):
    from transformers.integrations.hub_kernels import _PACKAGE_TO_DISTRIBUTION

    model = _meta(name)
    gaps = packing_kernel_gaps(type(model))
    to_package = {v: k for k, v in _PACKAGE_TO_DISTRIBUTION.items()}
    assert gaps and all(importlib.util.find_spec(to_package.get(d, d)) is None for d in gaps)
    assert "causal_conv1d" in gaps and "causal_conv1d_fn" in gaps["causal_conv1d"]
    problems = family_problems(*_args(packing=True), model)
    assert len(problems) == 1 and "Fix: --packing False" in problems[0] and "causal_conv1d" in problems[0]
    assert family_problems(*_args(packing=False), model) == []


def test_the_kernel_reader_sees_mamba_fall_back():
    import transformers.models.mamba.modeling_mamba as mamba

    assert getattr(mamba.causal_conv1d_fn, "__wrapped__", None) is not None  # transformers' hub-kernel wrapper
    assert set(packing_kernel_gaps(mamba.MambaForCausalLM)) == {"causal_conv1d", "mamba_ssm"}


def test_trls_fused_head_finds_llama4_texts_decoder_and_granitemoes_expert_count():
    from transformers.models.llama4.modeling_llama4 import Llama4ForCausalLM

    model = _meta("Llama4TextConfig")
    assert model.base_model is model  # the bug: the class's prefix names no child
    assert reach.backbone(model) is model.model and reach.head_bypassed_modules(model) == []
    _expose_backbone(model)
    assert model.base_model is model.model and Llama4ForCausalLM.base_model_prefix == "language_model"
    granite = _meta("GraniteMoeConfig")
    with pytest.raises(AttributeError):
        granite.config.num_experts  # noqa: B018
    _name_the_expert_count(granite)
    assert granite.config.num_experts == granite.config.num_local_experts == 4
    mixtral = _meta("MixtralConfig")
    _name_the_expert_count(mixtral)  # a config that answers to the name is left as it is
    assert "num_experts" not in mixtral.config.to_dict() or mixtral.config.num_experts == 4


def test_a_router_loss_without_routed_experts_of_mixtrals_kind_is_refused_with_the_coefficient_to_set():
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.DogeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, is_moe=True,
                                     num_experts=16, num_experts_per_tok=4)
    with torch.device("meta"):
        doge = AutoModelForCausalLM.from_config(config)
    model_args, t = _args(packing=False)
    (problem,) = family_problems(model_args, SimpleNamespace(**vars(t), router_aux_loss_coef=None), doge)
    assert problem.startswith("--router_aux_loss_coef") and "Fix: --router_aux_loss_coef 0" in problem
    assert family_problems(model_args, SimpleNamespace(**vars(t), router_aux_loss_coef=0.0), doge) == []
    mixtral = SimpleNamespace(**vars(t), router_aux_loss_coef=None)
    assert family_problems(model_args, mixtral, _meta("MixtralConfig")) == []  # its experts are what TRL's loss fits
    with_coefficient = SimpleNamespace(**vars(t), router_aux_loss_coef=0.01)
    assert family_problems(model_args, with_coefficient, _meta("MixtralConfig")) == []


def test_a_router_coefficient_for_a_model_without_router_logits_is_refused_as_trl_would():
    model_args, t = _args(packing=False)
    dense = _meta("LlamaConfig")
    (problem,) = family_problems(model_args, SimpleNamespace(**vars(t), router_aux_loss_coef=0.01), dense)
    assert problem.startswith("--router_aux_loss_coef 0.01: LlamaForCausalLM (llama) is not a mixture-of-experts")
    assert "Fix: drop --router_aux_loss_coef" in problem
    assert family_problems(model_args, SimpleNamespace(**vars(t), router_aux_loss_coef=None), dense) == []
    assert family_problems(model_args, SimpleNamespace(**vars(t), router_aux_loss_coef=0.0), dense) == []


def test_the_router_coefficient_is_the_flags_else_the_configs():
    """As TRL 1.16 reads it: Mixtral's config declares 0.001 (transformers' MixtralConfig default), Llama's none."""
    from sft_recipe.model.family_rules import router_loss

    text = _meta("MixtralConfig").config
    assert router_loss(SimpleNamespace(router_aux_loss_coef=None), text) == (None, 0.001, True)
    assert router_loss(SimpleNamespace(router_aux_loss_coef=0.02), text) == (0.02, 0.02, True)
    assert router_loss(SimpleNamespace(router_aux_loss_coef=0.0), text) == (0.0, 0.0, False)
    dense = _meta("LlamaConfig").config
    assert router_loss(SimpleNamespace(router_aux_loss_coef=None), dense) == (None, 0.0, False)


def test_a_config_transformers_cannot_build_as_a_causal_lm_is_refused_before_the_load(tmp_path):
    import transformers

    from sft_recipe.model.architecture import architecture_problems

    transformers.Emu3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=128).save_pretrained(str(tmp_path))
    model_args = SimpleNamespace(model_name_or_path=str(tmp_path), use_peft_lora=True,
                                 lora_target_modules="all-linear", use_flash_attn=False)
    (problem,) = architecture_problems(model_args, SimpleNamespace(trust_remote_code=False))
    assert "transformers cannot build a causal LM from its config (model_type emu3_text_model" in problem
    assert "Fix:" in problem


def test_a_mask_that_reads_values_is_probed_on_transformers_compile_time_branches():
    # Jamba's no-cache mask asks whether position ids are packed (a value meta tensors have not): the eager forward
    # fails on the meta device, the compile-time branches run. Its scan reads dt_proj's weight directly: never
    # trained, so all-linear leaves it out (it was the census's one Jamba failure: lora_B never moved).
    model = _meta("JambaConfig")
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        reach.backbone(model)(input_ids=ids, use_cache=False)
    reach._REACHED.clear()
    reached = reach.reached_linears(model)
    assert reached is not None
    assert {n.rsplit(".", 1)[-1] for n in reached} >= {"in_proj", "x_proj", "out_proj", "q_proj"}
    assert not any(n.endswith("dt_proj") for n in reached)
    assert "dt_proj" not in {n.rsplit(".", 1)[-1] for n in resolve_lora_targets("all-linear", model).modules}
    assert not torch.compiler.is_compiling()  # the switch is the probe's alone


def test_a_config_the_models_own_forward_fails_on_is_refused_before_the_load(tmp_path):
    """4 query heads over 3 key/value heads: the weights would load, then the first step's attention would fail
    (as a real forward of this config does). The meta-device probe sees it; architecture_problems refuses it."""
    import transformers

    from sft_recipe.model.architecture import architecture_problems

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=3, vocab_size=128).save_pretrained(str(tmp_path))
    model_args = SimpleNamespace(model_name_or_path=str(tmp_path), use_peft_lora=True, lora_target_modules="all-linear",
                                 use_flash_attn=False, lora_modules_to_save="", modules_to_save=[],
                                 train_new_tokens=False, lora_target_parameters="", lora_dropout=0.0)
    problems = architecture_problems(model_args, SimpleNamespace(trust_remote_code=False))
    (refusal,) = [p for p in problems if "own forward" in p]
    assert "the model's own forward fails on its config, before any weight loads (RuntimeError: The size of " \
           "tensor a (4) must match the size of tensor b (3)" in refusal and "Fix:" in refusal
    with torch.no_grad():  # the same error in a real forward: the refusal is no artefact of the meta device
        real = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(str(tmp_path)))
        with pytest.raises(RuntimeError, match=r"tensor a \(4\) must match the size of tensor b \(3\)"):
            real(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_a_meta_device_limitation_is_no_refusal():
    """Jamba's no-cache mask reads a value (the meta device has none): not the model's fault, so nothing is said."""
    model = _meta("JambaConfig")
    reach._REACHED.clear()
    assert reach.forward_failure(model) is None
