"""TRL 1.16: SFTTrainer's fused LM head reads two things it assumes every causal LM has.

`SFTTrainer.__init__` always calls `trl.trainer.utils.add_fused_lm_head`, which replaces the model's forward with one
that runs `model.base_model` (the backbone), then the output head's weight on its last hidden state, and, for an MoE
model that asks for router logits, Mixtral's load-balancing loss with `text_config.num_experts`.

Bug 1: the backbone is `model.base_model`, which transformers finds under the class's `base_model_prefix`. Llama-4's
text model (`Llama4ForCausalLM`) keeps the prefix of the multimodal model ("language_model") while its decoder sits
under `model`, so `base_model` is the causal LM itself and the fused forward dies with "'MoeCausalLMOutputWithPast'
object has no attribute 'last_hidden_state'". Fix: for such a model the instance's `base_model_prefix` names the
child that is its decoder (`get_decoder()`), for as long as the process lives.

Bug 2: the expert count is read as `num_experts` alone. GraniteMoE, GraniteMoE-shared, PhiMoE, ... spell it
`num_local_experts`, so the first step dies with "'GraniteMoeConfig' object has no attribute 'num_experts'". Fix:
where the text config has no `num_experts`, it is given the count of routed experts the built model holds
(`model.structure.expert_count`: the structure, not the config's spelling). Only the in-memory config is touched;
the run saves adapters, never the base model's config.

When it can go: `tests/e2e/test_census.py` trains Llama-4-text and GraniteMoE without it (the census bench:
`bench/families.py --types llama4_text,granitemoe,phimoe`).
"""

from __future__ import annotations


def _expose_backbone(model) -> None:
    """Bug 1's fix on one model: `base_model` answers with its decoder when the class's prefix names no child."""
    from sft_recipe.model.reach import decoder_of

    decoder = decoder_of(model)
    if model.base_model is not model or decoder is None:
        return
    for name, child in model.named_children():
        if child is decoder:
            model.base_model_prefix = name  # an instance attribute: the class (and other models) keep theirs
            return


def _name_the_expert_count(model) -> None:
    """Bug 2's fix on one model: `num_experts` on the text config where the config spells it otherwise."""
    from sft_recipe.model.structure import expert_count

    text_config = model.config.get_text_config()
    try:
        text_config.num_experts  # noqa: B018 -- asking whether the config answers to the name TRL reads
    except AttributeError:
        count = expert_count(model)
        if count:
            text_config.num_experts = count


def fused_head_reads_what_it_needs(launch) -> bool:
    """Process-wide: SFTTrainer's call to add_fused_lm_head first applies both fixes to the model it is given."""
    from trl.trainer import sft_trainer

    original = sft_trainer.add_fused_lm_head
    if getattr(original, "_sft_recipe_fixed", False):
        return True

    def add_fused_lm_head(model, *args, **kwargs):
        _expose_backbone(model)
        _name_the_expert_count(model)
        return original(model, *args, **kwargs)

    add_fused_lm_head._sft_recipe_fixed = True
    sft_trainer.add_fused_lm_head = add_fused_lm_head
    return True
