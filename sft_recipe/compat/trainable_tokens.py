"""PEFT's trainable tokens (--train_new_tokens) under FSDP2: the rows of the new tokens trained, the matrices frozen.

Bug (peft 0.21.2, torch 2.13): `TrainableTokensLayer.get_merged_weights` writes the trained rows into the base
weight with `W.index_copy(0, index, deltas)`, `index` a plain tensor. Inside a wrapped unit's forward FSDP2 hands
the layer its gathered, plain weight and it works; but TRL 1.16's fused LM head reads `lm_head.weight` without
calling the module (trl/trainer/utils.py `_fused_forward`), so the output head's merge sees FSDP2's sharded DTensor
and fails ("aten.index_copy.default got mixed torch.Tensor and DTensor"), and so does anything that reads the
`weight` attribute of a wrapped embedding between steps.
Fix here: where the base weight is a DTensor, the merge runs on full tensors: the weight and the trained rows are
gathered with `full_tensor()` (differentiable: the rows' gradient flows back to their shards), then merged as PEFT
does. The full head is what TRL's fused head gathers right after anyway (`weight.full_tensor()`), so no extra
memory is held for longer than that projection.
When it can go: `tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp`
(its fsdp2 case) passes without it.
"""

from __future__ import annotations


def merge_trainable_tokens_on_dtensor() -> None:
    """Process-wide: `TrainableTokensLayer.get_merged_weights` on FSDP2's sharded weights."""
    import torch
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from torch.distributed.tensor import DTensor

    original = TrainableTokensLayer.get_merged_weights
    if getattr(original, "_sft_recipe_fixed", False):
        return

    def get_merged_weights(self, active_adapters):
        weight = self.base_layer.weight
        if not isinstance(weight, DTensor):
            return original(self, active_adapters)
        weight = weight.full_tensor()
        for adapter_name in active_adapters:
            rows = self.trainable_tokens_delta[adapter_name]
            rows = rows.full_tensor() if isinstance(rows, DTensor) else rows
            index = torch.tensor(self.token_indices[adapter_name], device=weight.device)
            weight = weight.index_copy(0, index, rows.to(weight))
        return weight

    get_merged_weights._sft_recipe_fixed = True
    TrainableTokensLayer.get_merged_weights = get_merged_weights



def collect_token_rows_off_cuda() -> bool:
    """Process-wide: PEFT's ZeRO-3 start of the trainable rows on a machine without CUDA.

    Bug (peft 0.21.2): under ZeRO-3, `TrainableTokensLayer._collect_token_weights` gathers the base weight, copies the
    new tokens' rows on rank 0 and broadcasts them; the other ranks' receiving tensor is placed on
    `torch.device("cuda", torch.cuda.current_device())` ("right now, only CUDA is implemented"), so without CUDA every
    rank but 0 fails with "Torch not compiled with CUDA enabled" before training. Fix: without CUDA, the receiving
    tensor is on the weight's device (the CPU; gloo broadcasts there); with CUDA the method is PEFT's own.
    When it can go: the zero3 case of
    tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp passes without it.
    """
    import torch
    from peft.tuners.trainable_tokens import layer as trainable_tokens_layer

    layer = trainable_tokens_layer.TrainableTokensLayer
    original = layer._collect_token_weights
    if getattr(original, "_sft_recipe_fixed", False):
        return True

    def _collect_token_weights(self, weight, rows, embed_dim):
        if torch.cuda.is_available():
            return original(self, weight, rows, embed_dim)
        import torch.distributed as dist

        with trainable_tokens_layer.gather_params_ctx([weight], modifier_rank=None):
            if dist.is_available() and dist.is_initialized() and dist.get_rank() == 0:
                token_weights = weight[rows].clone()
            else:
                token_weights = torch.empty((len(rows), embed_dim), dtype=weight.dtype, device=weight.device)
        dist.broadcast(token_weights, src=0)
        return token_weights

    _collect_token_weights._sft_recipe_fixed = True
    layer._collect_token_weights = _collect_token_weights
    return True
