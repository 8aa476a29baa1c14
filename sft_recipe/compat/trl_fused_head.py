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

Bug 3 (with PEFT 0.21's trainable tokens, `--train_new_tokens`, under DeepSpeed ZeRO-3): the fused forward reads
`lm_head.weight` without calling the head. With the new tokens' rows trained, the head is PEFT's
TrainableTokensWrapper, whose `weight` is a plain tensor merged from the base head's weight and the rows' delta --
read outside any ZeRO-3 gather, so from the head's empty partition -- and TRL's own gather
(`maybe_gather_lm_head_ctx`) then fails on it ("'Tensor' object has no attribute 'ds_status'", on GPUs too). Fix:
under ZeRO-3, when the output head holds trainable tokens, the fused forward runs inside
`deepspeed.zero.GatheredParameters` of the base head's weight and the deltas that are not available already (read,
not modified: every rank keeps its partition; gathering an available one, a persisted small parameter, and releasing
it at the end freed it under the submodule holding it: "Cannot free a ZeRO-3 parameter while it is still active in
submodules", seen at step 2), so the merged weight is the full one; TRL's gather passes over a tensor that is no
ZeRO-3 parameter (nothing to gather: it is a fresh tensor that owns its data). The deltas' gradients flow back through
the merge to their ZeRO-3 partitions as any parameter's do.

When it can go: `tests/e2e/test_census.py` trains Llama-4-text and GraniteMoE without it (the census bench:
`bench/families.py --types llama4_text,granitemoe,phimoe`); Bug 3: the zero3 cell of
`tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp` passes without it.
"""

from __future__ import annotations

import functools


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
        result = original(model, *args, **kwargs)
        _gather_trainable_token_head_under_zero3(model)
        return result

    add_fused_lm_head._sft_recipe_fixed = True
    sft_trainer.add_fused_lm_head = add_fused_lm_head
    _skip_tensors_that_are_no_zero3_parameter()
    return True


def _trainable_token_head_parameters(model) -> list:
    """The base head's weight (and bias) and the new rows' deltas, where the output head is PEFT's trainable tokens
    wrapper (looked up at each call: PEFT wraps the head after the fused forward is added); [] otherwise."""
    adapter = getattr(model.get_output_embeddings(), "token_adapter", None)
    if adapter is None:
        return []
    base = adapter.base_layer
    return [p for p in (base.weight, getattr(base, "bias", None), *adapter.trainable_tokens_delta.values())
            if p is not None]


def _gather_trainable_token_head_under_zero3(model) -> None:
    """Bug 3's fix on one model: under ZeRO-3, the fused forward runs with the trainable-token head gathered."""
    fused = model.forward

    @functools.wraps(fused)  # generate validates its model kwargs against this signature
    def forward(*args, fused_lm_head=False, **kwargs):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        params = _trainable_token_head_parameters(model) if fused_lm_head and is_deepspeed_zero3_enabled() else []
        if params:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            # as TRL's own gather: what is available already (a persisted small parameter, or one a running
            # submodule holds) is left to its owner; releasing it here would free it under that submodule
            params = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
        if not params:
            return fused(*args, fused_lm_head=fused_lm_head, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return fused(*args, fused_lm_head=fused_lm_head, **kwargs)

    model.forward = forward


def _skip_tensors_that_are_no_zero3_parameter() -> None:
    """Bug 3's other half: TRL's gather of the head passes over a plain tensor (the merged trainable-token weight)."""
    from trl.trainer import utils as trl_utils

    original = trl_utils.maybe_gather_lm_head_ctx
    if getattr(original, "_sft_recipe_fixed", False):
        return

    def maybe_gather_lm_head_ctx(*params):
        return original(*(p for p in params if p is None or hasattr(p, "ds_status")))

    maybe_gather_lm_head_ctx._sft_recipe_fixed = True
    trl_utils.maybe_gather_lm_head_ctx = maybe_gather_lm_head_ctx
