"""FSDP1 QLoRA loads one 4-bit copy of the base per run: rank 0 reads and quantizes it; every other rank builds the
same 4-bit layers without weights and receives rank 0's quantization state.

Why: under FSDP every rank loaded and quantized the whole base into host RAM (compat.quantized_base_device_map): one
full 4-bit copy of host RAM per rank (the guide's 70B: ~34 GiB each, 271 GiB on 8 ranks) and the same quantization
on every rank. FSDP1's `sync_module_states` -- forced on by `fsdp_cpu_ram_efficient_loading: true`, the guide's
setting -- already broadcasts every parameter from rank 0 when it wraps a unit, packed 4-bit weights included, into
the storage its `param_init_fn` (accelerate's `to_empty`) gives meta placeholders. What it does not carry is the
quantization state (absmax, code and the nested state are attributes of the weight, neither parameters nor
buffers), so rank 0 sends that here, a batch of layers at a time, before anything is wrapped. The other ranks'
state is rank 0's by construction, and train.py's identity check compares the checksums anyway.

Only global rank 0 reads the checkpoint, also on several machines: FSDP1 broadcasts from global rank 0 (hybrid
sharding too: inter-node first), so a node-local copy would be overwritten unread; the other machines receive the
packed weights over the network once, at wrapping (the base's 4-bit size: ~34 GiB for a 70B).
Not for FSDP2 (accelerate 1.15's `fsdp2_prepare_model` keeps 4-bit weights out of its meta move and rank-0
broadcast, PR #3981, so each rank needs its own copy; filling the sharded 4-bit parameters from rank 0 would mean
reaching into torch's FSDPParam), nor for 8-bit (its state is computed on the GPU when the layer moves there).
"""

from __future__ import annotations

import logging

import torch

from sft_recipe.errors import ConfigError

logger = logging.getLogger(__name__)

# Quantization state sent per broadcast: a bound on the transient host (and, over NCCL, GPU) memory of one message.
BATCH_BYTES = 256 * 2**20


def make_4bit_layers(model, quantization_config) -> None:
    """Turn a weightless model (sft_recipe.train.model.model_without_weights) into the 4-bit model rank 0 loaded:
    transformers' own quantizer swaps in bitsandbytes' Linear4bit for the same modules it converts while loading
    (its modules_to_not_convert: the output head, tied and fp32-kept modules), weights still on meta, ties the head
    to the embedding where the config says so, and marks the model quantized as `from_pretrained` does (PEFT and
    TRL read those marks)."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)  # the new layers in the model's dtype, as from_pretrained builds them
    try:
        quantizer.preprocess_model(model, dtype=model.dtype, device_map={"": "cpu"})
    finally:
        torch.set_default_dtype(before)
    model.tie_weights()  # as from_pretrained finishes a load: a tied head is the embedding (built untied on meta)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def layout(model) -> list[tuple[str, tuple, str]]:
    """Every parameter and buffer as (name, shape, dtype), a 4-bit weight by what it stands for (its unquantized
    shape and dtype): what must be equal on every rank before FSDP1 flattens the units."""
    from bitsandbytes.nn import Params4bit

    out = []
    for name, param in model.named_parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            out.append((name, tuple(state.shape), f"4bit:{state.dtype}"))
        elif isinstance(param, Params4bit):  # not quantized yet: a weightless rank's layer, in its unquantized shape
            out.append((name, tuple(param.shape), f"4bit:{param.dtype}"))
        else:
            out.append((name, tuple(param.shape), str(param.dtype)))
    out.extend((name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers())
    return out


def layout_differences(mine: list, rank0: list, limit: int = 5) -> list[str]:
    """What differs between this rank's layout and rank 0's, the first `limit` entries."""
    mine_by_name, theirs = {n: rest for n, *rest in mine}, {n: rest for n, *rest in rank0}
    problems = [f"{n}: rank 0 has {theirs.get(n)}, this rank {mine_by_name.get(n)}"
                for n in dict.fromkeys([*theirs, *mine_by_name]) if theirs.get(n) != mine_by_name.get(n)]
    return problems[:limit]


def share_quantization_state(model, launch, device: torch.device) -> str | None:
    """Every rank calls it right after loading (a collective). Rank 0 sends its layout and every 4-bit weight's
    quantization state; the others check their layout against rank 0's, then give each 4-bit weight a meta
    placeholder of the packed shape carrying rank 0's state, on `device`. Returns what rank 0 logs."""
    import torch.distributed as dist

    sender = launch.rank == 0
    rank0_layout = [layout(model) if sender else None]
    dist.broadcast_object_list(rank0_layout, src=0)
    problems = [] if sender else layout_differences(layout(model), rank0_layout[0])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    if any(everyone):
        rank, first = next((r, p) for r, p in enumerate(everyone) if p)
        raise ConfigError([
            f"rank {rank} built another model than rank 0 loaded, so it cannot take rank 0's 4-bit weights: "
            f"{'; '.join(first)}. Every rank builds the model from the same config and quantization flags, so the "
            "machines differ (transformers, bitsandbytes or the model folder). Fix: the same packages and model "
            "files on every machine, or fsdp_cpu_ram_efficient_loading: false (each rank then loads its own copy)."])
    sent, batches = 0, _batches(model) if sender else None
    while True:
        message = [next(batches) if sender else None]
        dist.broadcast_object_list(message, src=0)
        if not message[0]:  # rank 0's last message is empty
            break
        if not sender:
            _install_placeholders(model, message[0], device)
        sent += len(message[0])
    return (f"4-bit base loaded once, on rank 0; its quantization state for {sent} weights sent to the other "
            f"{launch.world_size - 1} rank{'s' if launch.world_size > 2 else ''}, which hold no packed weights until "
            "FSDP1 broadcasts them as it wraps each unit") if sender else None


def _batches(model):
    """Rank 0's messages: lists of (module name, packed shape, packed dtype, quantization state as bitsandbytes
    packs it), about BATCH_BYTES each, then an empty list."""
    batch, size = [], 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None:
            continue
        packed = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.as_dict(packed=True).items()}
        batch.append((name, tuple(weight.shape), weight.dtype, packed))
        size += sum(v.nbytes for v in packed.values() if isinstance(v, torch.Tensor))
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
    yield []


def _install_placeholders(model, batch, device: torch.device) -> None:
    """Give each named Linear4bit a meta weight of rank 0's packed shape and dtype that carries rank 0's
    quantization state (on `device`, where the layer will compute): FSDP1's `to_empty` gives it storage and its
    module-state sync fills it from rank 0."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    modules = dict(model.named_modules())
    for name, packed_shape, packed_dtype, packed_state in batch:
        module = modules[name]
        state = QuantState.from_dict(dict(packed_state), device=device)
        placeholder = torch.empty(packed_shape, dtype=packed_dtype, device="meta")
        module.weight = Params4bit(placeholder, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                                   compress_statistics=state.nested, quant_type=state.quant_type,
                                   quant_storage=packed_dtype, module=module, bnb_quantized=True)
        module.quant_state = state
