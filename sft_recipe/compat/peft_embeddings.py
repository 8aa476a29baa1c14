"""peft 0.21: a resized vocabulary is not saved with the adapter of a model whose config nests its text config."""

from __future__ import annotations


def save_embedding_layers_for(peft_model, trust_remote_code: bool = False) -> bool | str:
    """`save_embedding_layers` for PEFT's state-dict selection and save: True when the vocabulary was resized,
    else "auto" (PEFT's own rule).

    Bug (peft 0.21.2): "auto" compares `model.config.vocab_size` with the base checkpoint's; a multimodal checkpoint
    trained on text (Gemma-3 4B+, ...) keeps `vocab_size` in its nested text config, so the check finds no vocabulary
    and the embedding and head rows that chatml/zephyr added are not saved: the reloaded adapter then runs on freshly
    initialised rows for those tokens, not the ones it was trained with. Here the text config is read on both sides.
    When it can go: the gemma3-multimodal cell of tests/e2e/test_families.py saves the embedding rows without it.
    """
    from sft_recipe.model.shape import read_config

    config = peft_model.get_base_model().config
    if config.get_text_config() is config:
        return "auto"  # PEFT's check reads this config correctly
    base = peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path
    try:
        saved = read_config(base, trust_remote_code).get_text_config().vocab_size
    except (OSError, ValueError):
        return "auto"
    return True if saved != peft_model.get_input_embeddings().weight.shape[0] else "auto"
