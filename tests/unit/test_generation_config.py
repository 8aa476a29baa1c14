"""The eos ids a chat format needs (one function for the adapter folder, its checkpoints and the merged model), the
generation config written beside an adapter, and the model card lines that load it.

Expected ids come from the tokenizer and the chat formats' own definitions (`CHAT_FORMATS`), never literals.
"""

from __future__ import annotations

import json
import shutil

import pytest

from sft_recipe.artifacts.generation import (
    CARD_HEADING,
    CARD_PLACEHOLDER,
    GENERATION_CONFIG,
    MODEL_CARD,
    add_chat_eos,
    add_usage_to_card,
    chat_eos_token_ids,
    end_of_turn_token_id,
    ensure_generation_config,
    write_adapter_generation_files,
    write_generation_config,
)
from sft_recipe.config.args import ModelArguments
from sft_recipe.data.chat_templates import CHAT_FORMATS
from sft_recipe.train.model import load_tokenizer

FORMATS = ("chatml", "zephyr", "none")


def _tokenizer(tiny, fmt: str):
    return load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format=fmt))


def _turn_end(tokenizer, fmt: str) -> int:
    """What the format's definition says ends an assistant turn: its own EOS token, else the tokenizer's EOS (the
    zephyr template and the tiny tokenizer's own close turns with `eos_token`)."""
    token = CHAT_FORMATS[fmt].eos_token if fmt in CHAT_FORMATS else None
    return tokenizer.convert_tokens_to_ids(token) if token else tokenizer.eos_token_id


def _base_eos(tiny) -> int:
    return json.loads((tiny.model_dir / GENERATION_CONFIG).read_text())["eos_token_id"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_end_of_turn_is_read_from_the_rendered_template(tiny, fmt):
    tokenizer = _tokenizer(tiny, fmt)
    assert end_of_turn_token_id(tokenizer) == _turn_end(tokenizer, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("base_eos_kind", ["int", "list", "none"])
def test_chat_eos_ids_keep_the_base_ones_first_and_add_the_turn_end(tiny, fmt, base_eos_kind):
    tokenizer = _tokenizer(tiny, fmt)
    base = _base_eos(tiny)
    base_eos = {"int": base, "list": [base, tokenizer.bos_token_id], "none": None}[base_eos_kind]
    kept = {"int": [base], "list": [base, tokenizer.bos_token_id], "none": []}[base_eos_kind]

    ids = chat_eos_token_ids(base_eos, tokenizer)

    assert ids[:len(kept)] == kept  # the base's own, in their order
    assert _turn_end(tokenizer, fmt) in ids and tokenizer.eos_token_id in ids
    assert len(ids) == len(set(ids))  # no id twice (zephyr/none: the turn end is the base's EOS)
    if _turn_end(tokenizer, fmt) in kept:
        assert ids == kept


def test_a_template_of_its_own_that_ends_turns_with_another_token(tiny):
    """Llama-3 style: EOS stays `</s>`, turns end with a special token of their own; both stop generation."""
    tokenizer = _tokenizer(tiny, "none")
    tokenizer.add_tokens(["<|eot_id|>"], special_tokens=True)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")

    assert end_of_turn_token_id(tokenizer) == eot
    assert chat_eos_token_ids(_base_eos(tiny), tokenizer) == [_base_eos(tiny), eot]


def test_templates_that_say_nothing_about_the_turn_end_add_only_the_tokenizer_eos(tiny):
    tokenizer = _tokenizer(tiny, "none")
    tokenizer.chat_template = "{{ raise_exception('a system turn is required') }}"  # refuses user + assistant
    assert end_of_turn_token_id(tokenizer) is None
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + '\\n' }}{% endfor %}"  # nothing special
    assert end_of_turn_token_id(tokenizer) is None
    tokenizer.chat_template = None
    assert end_of_turn_token_id(tokenizer) is None
    assert chat_eos_token_ids(None, tokenizer) == [tokenizer.eos_token_id]


def test_add_chat_eos_keeps_one_id_an_int_and_marks_a_changed_config(tiny):
    from transformers import GenerationConfig

    base = GenerationConfig.from_pretrained(str(tiny.model_dir))
    unchanged = GenerationConfig.from_pretrained(str(tiny.model_dir))
    add_chat_eos(unchanged, _tokenizer(tiny, "none"))
    assert unchanged.eos_token_id == base.eos_token_id and unchanged._from_model_config == base._from_model_config

    chatml = _tokenizer(tiny, "chatml")
    add_chat_eos(base, chatml)
    assert base.eos_token_id == chat_eos_token_ids(_base_eos(tiny), chatml)
    assert base._from_model_config is False  # it no longer is what config.json implies


@pytest.fixture()
def base_with_settings(tiny, tmp_path):
    """A copy of the tiny base whose generation_config.json holds sampling settings of its own."""
    base = tmp_path / "base"
    shutil.copytree(tiny.model_dir, base)
    settings = json.loads((base / GENERATION_CONFIG).read_text())
    settings.update(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    (base / GENERATION_CONFIG).write_text(json.dumps(settings))
    return base


def test_the_written_config_is_the_base_one_with_the_turn_end_added(tiny, base_with_settings, tmp_path):
    from transformers import GenerationConfig

    tokenizer = _tokenizer(tiny, "chatml")
    write_generation_config(tmp_path / "adapter", str(base_with_settings), tokenizer)

    written = GenerationConfig.from_pretrained(str(tmp_path / "adapter"))
    base = GenerationConfig.from_pretrained(str(base_with_settings))
    assert written.eos_token_id == chat_eos_token_ids(base.eos_token_id, tokenizer)
    for name in ("do_sample", "temperature", "top_p", "repetition_penalty", "bos_token_id"):
        assert getattr(written, name) == getattr(base, name), name


def test_a_base_without_generation_config_uses_what_its_config_implies(tiny, tmp_path):
    from transformers import AutoConfig, GenerationConfig

    base = tmp_path / "base"
    shutil.copytree(tiny.model_dir, base)
    (base / GENERATION_CONFIG).unlink()
    tokenizer = _tokenizer(tiny, "chatml")
    write_generation_config(tmp_path / "adapter", str(base), tokenizer)

    written = GenerationConfig.from_pretrained(str(tmp_path / "adapter"))
    assert written.eos_token_id == chat_eos_token_ids(AutoConfig.from_pretrained(str(base)).eos_token_id, tokenizer)


PEFT_CARD = f"""---
library_name: peft
---

# Model Card for Model ID

## Recommendations

Users should be made aware of the risks.

{CARD_HEADING}

Use the code below to get started with the model.

{CARD_PLACEHOLDER}

## Training Details

{CARD_PLACEHOLDER}
"""


@pytest.mark.parametrize("fmt", ["chatml", "none"])
def test_the_card_section_replaces_the_empty_one_and_names_what_stops(tiny, tmp_path, fmt):
    tokenizer = _tokenizer(tiny, fmt)
    (tmp_path / MODEL_CARD).write_text(PEFT_CARD)
    write_adapter_generation_files(tmp_path, "runs/demo", str(tiny.model_dir), tokenizer)

    card = (tmp_path / MODEL_CARD).read_text()
    section = card[card.index(CARD_HEADING):card.index("## Training Details")]
    assert card.count(CARD_HEADING) == 1 and CARD_PLACEHOLDER not in section
    assert card.startswith(PEFT_CARD[:PEFT_CARD.index(CARD_HEADING)]) and card.endswith(
        PEFT_CARD[PEFT_CARD.index("## Training Details"):])  # the rest of PEFT's card as it was
    assert "GenerationConfig.from_pretrained(adapter_dir)" in section and 'adapter_dir = "runs/demo"' in section
    assert "AutoPeftModelForCausalLM" in section and "only the base model's generation config" in section
    assert "--output_dir runs/demo-merged" in section and 'pipeline("text-generation", model="runs/demo-merged")' \
        in section
    turn_end = tokenizer.convert_ids_to_tokens(_turn_end(tokenizer, fmt))
    added = _turn_end(tokenizer, fmt) != _base_eos(tiny)
    assert (f"ends its answers with `{turn_end}`" in section) == added  # said only where the base does not stop


def test_trls_card_written_before_a_push_keeps_the_loading_section(tiny, tmp_path):
    """transformers' push_to_hub (and TRL at every checkpoint) writes TRL's card over README.md, then uploads the
    folder: RecipeSFTTrainer.create_model_card runs it inside keeping_usage_section."""
    from trl.trainer.utils import generate_model_card

    from sft_recipe.artifacts.generation import keeping_usage_section, usage_section_of

    def trls_card():  # what TRL's create_model_card writes, by TRL's own generator
        generate_model_card(base_model="org/base", model_name="demo", hub_model_id="me/demo", dataset_name=None,
                            tags=["sft", "trl"], wandb_url=None, trackio_url=None,
                            trainer_name="SFT").save(str(tmp_path / MODEL_CARD))

    (tmp_path / MODEL_CARD).write_text(PEFT_CARD)
    write_adapter_generation_files(tmp_path, "me/demo", str(tiny.model_dir), _tokenizer(tiny, "chatml"))
    section = usage_section_of(tmp_path)
    assert section and section.startswith(CARD_HEADING) and "GenerationConfig.from_pretrained" in section
    with keeping_usage_section(tmp_path, is_main_process=True):
        trls_card()
        assert usage_section_of(tmp_path) is None  # TRL's card alone, as it was written
    card = (tmp_path / MODEL_CARD).read_text()
    assert "TRL" in card and "org/base" in card and card.count(CARD_HEADING) == 1  # TRL's card, with ours in it
    assert usage_section_of(tmp_path) == section
    with keeping_usage_section(tmp_path, is_main_process=False):  # the other ranks write no card
        trls_card()
    assert usage_section_of(tmp_path) is None
    with keeping_usage_section(tmp_path, is_main_process=True):  # nothing to keep: TRL's card as it wrote it
        trls_card()
    assert usage_section_of(tmp_path) is None


def test_a_card_without_the_section_gets_it_at_the_end(tiny, tmp_path):
    tokenizer = _tokenizer(tiny, "chatml")
    (tmp_path / MODEL_CARD).write_text("# my card\n")
    add_usage_to_card(tmp_path, f"{CARD_HEADING}\n\ntext\n")
    assert (tmp_path / MODEL_CARD).read_text() == f"# my card\n\n{CARD_HEADING}\n\ntext\n"
    (tmp_path / MODEL_CARD).unlink()
    write_adapter_generation_files(tmp_path, "out", str(tiny.model_dir), tokenizer)
    assert (tmp_path / MODEL_CARD).read_text().startswith(CARD_HEADING)
    (tmp_path / MODEL_CARD).unlink()
    write_adapter_generation_files(tmp_path, "out", str(tiny.model_dir), tokenizer, card=False)  # a full model
    assert not (tmp_path / MODEL_CARD).exists() and (tmp_path / GENERATION_CONFIG).is_file()


class _FakeAccelerator:
    def unwrap_model(self, model):
        return model


class _FakeTrainer:
    """What the savers use of a Trainer: the accelerator, the model, the tokenizer, trust_remote_code."""

    def __init__(self, model, tokenizer):
        from types import SimpleNamespace

        self.accelerator, self.model, self.processing_class = _FakeAccelerator(), model, tokenizer
        self.args = SimpleNamespace(trust_remote_code=False)


def _peft_model(tiny, tokenizer):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.model import fit_embeddings_to_tokenizer

    base = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    fit_embeddings_to_tokenizer(base, tokenizer)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)  # as after training: the adapter check wants lora_B moved
    return model


def test_an_adapter_save_writes_the_generation_config_and_the_card(tiny, tmp_path):
    from transformers import GenerationConfig

    from sft_recipe.artifacts.adapter import _write_and_check

    tokenizer = _tokenizer(tiny, "chatml")
    model = _peft_model(tiny, tokenizer)
    out = tmp_path / "out"
    _write_and_check(_FakeTrainer(model, tokenizer), model.state_dict(), str(out), verify=True,
                     trust_remote_code=False)

    eos = GenerationConfig.from_pretrained(str(out)).eos_token_id
    assert eos == chat_eos_token_ids(_base_eos(tiny), tokenizer)
    card = (out / MODEL_CARD).read_text()
    assert card.count(CARD_HEADING) == 1 and f"adapter_dir = {json.dumps(str(out))}" in card


def test_a_checkpoint_without_one_gets_it_before_its_marker_and_the_marker_records_it(tiny, tmp_path):
    from sft_recipe.artifacts.checkpoints import checkpoint_damage, mark_complete, read_marker

    tokenizer = _tokenizer(tiny, "chatml")
    trainer = _FakeTrainer(_peft_model(tiny, tokenizer), tokenizer)
    sharded = tmp_path / "checkpoint-2"  # what an FSDP SHARDED_STATE_DICT checkpoint holds: no adapter files
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    (sharded / "trainer_state.json").write_text("{}")

    ensure_generation_config(sharded, trainer)
    mark_complete(sharded, 2)

    written = json.loads((sharded / GENERATION_CONFIG).read_text())
    assert written["eos_token_id"] == chat_eos_token_ids(_base_eos(tiny), tokenizer)
    assert GENERATION_CONFIG in read_marker(sharded)["files"] and not checkpoint_damage(sharded)

    (sharded / GENERATION_CONFIG).write_text('{"eos_token_id": 0}')  # one an adapter save wrote is left alone
    ensure_generation_config(sharded, trainer)
    assert json.loads((sharded / GENERATION_CONFIG).read_text()) == {"eos_token_id": 0}


def test_a_base_that_cannot_be_read_any_more_falls_back_to_the_training_model_config(tiny, tmp_path):
    """The final save of a long run must not fail because the base folder moved: the in-memory config is used."""
    from transformers import GenerationConfig

    tokenizer = _tokenizer(tiny, "chatml")
    gone = str(tmp_path / "moved-away")
    with pytest.raises(OSError):
        write_generation_config(tmp_path / "a", gone, tokenizer)
    in_memory = GenerationConfig.from_pretrained(str(tiny.model_dir))
    write_generation_config(tmp_path / "b", gone, tokenizer, fallback=in_memory)

    assert GenerationConfig.from_pretrained(str(tmp_path / "b")).eos_token_id == chat_eos_token_ids(
        in_memory.eos_token_id, tokenizer)
    assert in_memory.eos_token_id == _base_eos(tiny)  # the training model's own is left as it was
