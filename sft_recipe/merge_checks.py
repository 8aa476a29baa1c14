"""What the merge command refuses and how it checks its result: the errors it raises, the refusals of distributed
launchers and FSDP-wrapped models, and the logits comparison of the written model with base+adapter.

merge.py plans and runs the merge and holds the CLI; it re-exports the public names here, so that
`from sft_recipe.merge import MergeError, refuse_merge_in_fsdp, ...` keeps working.
"""

from __future__ import annotations

import torch

COMMAND = "python merge_adapter.py --adapter_dir <training output_dir> --output_dir <merged model dir>"

# Allowed max |merged - (base+adapter)| logits, as a fraction of max(1, max |logit|). Merging rounds W + B@A once to
# the target dtype while the reference adds the LoRA path at run time, so the two differ by a few rounding steps of
# that dtype. Measured on the tiny Llama: fp32 ~5e-7 (7e-6 with a deliberately huge random adapter over 96 tokens),
# bf16 ~1.2e-2 (3 epsilons). The bounds leave >10x margin for deeper models and longer prompts; check_problem adds
# the test that actually separates a merged adapter from a dropped one.
CHECK_RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
CHECK_TEXT = "### User:\nWhat is the opposite of hot?"
CHECK_MAX_EXTRA_TOKENS = 16  # added/trainable token ids appended to the check prompt so their rows are compared too


class MergeError(RuntimeError):
    """A refusal or a user mistake: reported as one message, no traceback, exit code 2."""


class MergeCheckError(MergeError):
    """The written model does not reproduce base+adapter: nothing is published."""


# ----------------------------------------------------------------------------------------------------------------
# Refusals: distributed launchers and FSDP-wrapped models
# ----------------------------------------------------------------------------------------------------------------


def refuse_under_distributed_launcher() -> None:
    """Merging needs every weight whole in one process; a launcher with several ranks would shard or repeat it."""
    from sft_recipe.config.launch_env import read_launch_env

    world_size = read_launch_env().world_size
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size > 1 or initialised:
        why = f"WORLD_SIZE={world_size}" if world_size > 1 else "a process group is initialised"
        raise MergeError(
            f"the merge is running under a distributed launcher ({why}). It reloads the base model unsharded in ONE "
            f"process and never merges inside FSDP. Fix: run it as a plain command after training (not with "
            f"accelerate launch / torchrun): {COMMAND}")


def _fsdp_evidence(model: torch.nn.Module) -> str | None:
    """What shows `model` is FSDP-wrapped (FSDP1 wrapper, FSDP2 `fully_shard` module, sharded params), or None."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch: FSDP2 lives elsewhere or not at all
        FSDPModule = ()  # noqa: N806
    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            return f"FSDP1 FullyShardedDataParallel at '{name or '<root>'}'"
        if FSDPModule and isinstance(module, FSDPModule):
            return f"FSDP2 fully_shard module {type(module).__name__} at '{name or '<root>'}'"
    for name, param in model.named_parameters():
        if type(param).__name__ == "DTensor" or getattr(param, "_is_flat_param", False):
            return f"sharded parameter '{name}' ({type(param).__name__})"
    return None


def refuse_merge_in_fsdp(model: torch.nn.Module) -> None:
    """Raise MergeError if `model` is (or contains) an FSDP1/FSDP2-wrapped module: merging there adds LoRA deltas to
    weight shards, or to flattened parameters, and either fails or saves a wrong model."""
    evidence = _fsdp_evidence(model)
    if evidence is not None:
        raise MergeError(
            f"refusing to merge the adapter inside an FSDP-wrapped model ({evidence}): each rank holds only a shard "
            f"of every weight, so merge_and_unload() here cannot produce the full merged model. Fix: save the adapter "
            f"(train.py does), then after training merge in one plain process: {COMMAND}")


def merge_and_unload_unsharded(peft_model, **kwargs):
    """`peft_model.merge_and_unload(**kwargs)`, refused on an FSDP-wrapped model (see refuse_merge_in_fsdp)."""
    refuse_merge_in_fsdp(peft_model)
    return peft_model.merge_and_unload(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The logits check: the written model against base+adapter
# ----------------------------------------------------------------------------------------------------------------


def make_check_ids(tokenizer, base_rows: int, rows: int, peft_config) -> torch.Tensor:
    """A short prompt in the saved tokenizer's chat format, plus added tokens and trainable-token rows, so resized and
    trained embedding rows are compared too. Only ids below `rows` (the merged vocabulary) are used."""
    text = CHECK_TEXT
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the opposite of hot?"}],
                                                 add_generation_prompt=True, tokenize=False)
        except Exception:  # a template needing other roles/fields: the plain prompt still checks the weights
            text = CHECK_TEXT
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    extra = list(range(base_rows, len(tokenizer)))
    trainable = getattr(peft_config, "trainable_token_indices", None)
    if isinstance(trainable, dict):
        trainable = [i for values in trainable.values() for i in values]
    extra += [int(i) for i in (trainable or []) if int(i) not in extra]
    return torch.tensor([[i for i in ids + extra[:CHECK_MAX_EXTRA_TOKENS] if i < rows]])


def compute_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def check_problem(max_abs_diff: float, tolerance: float, adapter_effect: float) -> str | None:
    """Why the merged logits do not match base+adapter, or None. They must be within rounding noise (`tolerance`)
    and, when the adapter moves the logits by more than that noise, closer to base+adapter than to the bare base:
    a low-precision tolerance alone could pass a merge that dropped a weakly trained adapter."""
    if not max_abs_diff <= tolerance:  # written this way round so NaN fails too
        return f"max|logit diff| {max_abs_diff:.3g} > tolerance {tolerance:.3g}"
    if adapter_effect > tolerance and not max_abs_diff < adapter_effect / 2:
        return (f"max|logit diff| {max_abs_diff:.3g} is not below half of what the adapter moves the logits "
                f"({adapter_effect:.3g})")
    return None
