"""Every causal-LM model type transformers registers: it trains with the guide's flags, or it is refused before any
weight loads with the reason and what works instead (issue: "every causal-LM family transformers ships").

- The census: each type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES gets a tiny config from its own config class (the
  bench's builder, bench/families.py), is built on the meta device or listed with why not, and gets the recipe's
  up-front answer: the family refusals and what all-linear adapts. The full sweep with real runs is the bench.
- One train-and-load run per class the census found failing before, through the real launcher (one process): each
  saves a verified adapter that AutoPeftModelForCausalLM loads. The families the README names run on every engine
  in tests/e2e/test_families.py.
- The refusals on real saved models, through the same check train.py runs before loading (exit 2 is train.py's
  for every ConfigError: tests/test_refusals_as_run.py).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import REPO, launch_train

sys.path.insert(0, str(REPO / "bench"))
import families  # noqa: E402 -- bench/families.py: the census's tiny-config builder and flags

# cell -> (model type, flags beyond the guide's, the class it stands for)
CELLS = {
    "granitemoe": ("granitemoe", [], "MoE whose config spells its expert count otherwise (TRL's fused head)"),
    "llama4-text": ("llama4_text", [], "a class whose base_model_prefix names no child (TRL's fused head)"),
    "mamba": ("mamba", ["--packing", "False"], "Mamba: PEFT refuses out_proj, dt_proj never called"),
    "trocr": ("trocr", [], "a decoder built for an encoder: cross-attention never called"),
}
# model type -> the start of its refusal under the guide's flags
REFUSED = {"ctrl": "--gradient_checkpointing True", "bert": "--model_name_or_path",
           "qwen3_5_text": "--packing True", "lfm2": "--packing True", "doge": "--router_aux_loss_coef"}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.model_dir))


def test_every_causal_lm_type_is_built_or_listed_with_why_and_gets_an_answer_up_front(tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from sft_recipe.model.family_rules import family_problems
    from sft_recipe.model.structure import resolve_lora_targets

    hf_logging.set_verbosity_error()
    model_args = SimpleNamespace(model_name_or_path="tiny", use_peft_lora=True, lora_target_modules="all-linear")
    guide = SimpleNamespace(gradient_checkpointing=True, packing=True, router_aux_loss_coef=None)
    unbuilt, answers = {}, {}
    for model_type in families.causal_lm_types():
        try:
            config = families.tiny_config(model_type, tokenizer)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception as e:  # noqa: BLE001 -- listed with the reason, as the bench lists it
            unbuilt[model_type] = f"{type(e).__name__}: {e}"
            continue
        problems = family_problems(model_args, guide, model)
        targets = None if problems else resolve_lora_targets("all-linear", model)
        answers[model_type] = (problems, targets)
        if targets is not None:  # PEFT takes what all-linear resolves to with the guide's dropout (its ParamWrapper,
            # for fused experts handed to it, refuses any: Hunyuan's single expert, LongCat's 768/512 split, ...)
            get_peft_model(model, LoraConfig(target_modules=targets.target_modules, lora_dropout=0.1, r=8))
    assert all(len(reason) > len("Error: ") for reason in unbuilt.values())
    assert len(answers) > 3 * len(unbuilt)  # the builder keeps up with the registry (181 of 196 on 5.24)
    for model_type, (problems, targets) in answers.items():
        assert all("Fix:" in p for p in problems), model_type
        assert problems or targets.modules, f"{model_type}: all-linear would adapt nothing"
    for model_type, start in REFUSED.items():
        assert any(p.startswith(start) for p in answers[model_type][0]), (model_type, answers[model_type][0])
    for model_type in ("llama", "mistral", "qwen2", "gemma2", "mixtral", "deepseek_v3", "trocr", "granitemoe"):
        assert answers[model_type][0] == [], (model_type, answers[model_type][0])
    assert "never trains" in answers["trocr"][1].note()


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_refused_family_is_refused_by_train_pys_check_before_any_weight_loads(model_type, tiny, tokenizer,
                                                                                 tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.errors import ConfigError
    from sft_recipe.preflight.validate import validate

    path = families.build(model_type, tmp_path, tokenizer)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("loaded")))
    argv = ["--model_name_or_path", str(path), "--dataset_name", str(tiny.jsonl_dir), "--output_dir",
            str(tmp_path / "out"), *families.GUIDE]
    with pytest.raises(ConfigError) as refused:
        validate(*parse_args(argv, launch=LaunchEnv()), LaunchEnv())
    assert any(p.startswith(REFUSED[model_type]) and "Fix:" in p for p in refused.value.problems)


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_family_of_each_class_trains_saves_a_verified_adapter_and_loads(cell, tiny, tokenizer, tmp_path):
    from peft import AutoPeftModelForCausalLM

    model_type, extra, _ = CELLS[cell]
    path = families.build(model_type, tmp_path, tokenizer)
    out = tmp_path / "run"
    result = launch_train("cpu/single.yaml", out, ["--model_name_or_path", str(path), "--dataset_name",
                                                   str(tiny.jsonl_dir), *families.GUIDE, *extra])
    assert result.returncode == 0, result.output[-4000:]
    assert "adapter check OK" in result.output and "Traceback" not in result.output
    model = AutoPeftModelForCausalLM.from_pretrained(str(out))
    trained = [n for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(model.get_parameter(n).abs().sum() > 0 for n in trained)


def test_a_table_indexed_by_token_id_refuses_the_tokens_a_chat_format_adds(tokenizer, tmp_path):
    """DeepSeek-V4's hash router holds one row per vocabulary id: the chat format's new ids would index past it."""
    from sft_recipe.model.family_rules import token_table_problems

    for model_type, refused in (("deepseek_v4", True), ("xlstm", True), ("llama", False), ("qwen2", False)):
        folder = tmp_path / model_type
        families.tiny_config(model_type, tokenizer).save_pretrained(str(folder))
        args = SimpleNamespace(model_name_or_path=str(folder), chat_template_format="chatml")
        problems = token_table_problems(args, added_tokens=3)
        assert bool(problems) == refused, (model_type, problems)
    assert "tid2eid" in _problems_of(tmp_path / "deepseek_v4") and "Fix: --chat_template_format none" in \
        _problems_of(tmp_path / "deepseek_v4")


def _problems_of(folder) -> str:
    from sft_recipe.model.family_rules import token_table_problems

    return " ".join(token_table_problems(SimpleNamespace(model_name_or_path=str(folder),
                                                         chat_template_format="chatml"), added_tokens=3))
