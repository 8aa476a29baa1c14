"""Gather only what the saved adapter holds, never the frozen base.

Upstream's final save (`trainer.save_model()` after `set_state_dict_type("FULL_STATE_DICT")`) unshards every weight
of the model onto rank 0 and only then keeps the adapter's keys: at Llama-2-70B in fp32 that is ~260 GiB of extra
host RAM on one machine at the very end of the run, plus the time to move it (peft #447, pytorch #111900,
transformers #31675, accelerate #3250). Here the keys the adapter will hold are chosen first, from key names alone,
and only those tensors are gathered, each engine with its own library means:

- one process / DDP: the module's own state dict (references, no copies);
- FSDP2: the sharded state dict from torch's `get_model_state_dict`, then `DTensor.full_tensor()` per wanted key;
- FSDP1 (flat parameters): `FSDP.summon_full_params(unit, recurse=False)` of just the units that own a wanted key,
  which is what FULL_STATE_DICT does for *every* unit (so the bytes are the same);
- DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters` over the wanted parameters only.

The result feeds the same `save_pretrained` + adapter check + atomic write as before, and is bit-identical to the
full gather (tests/e2e/test_adapter_gather.py).
"""

from __future__ import annotations

import torch

from sft_recipe import compat


def adapter_state_keys(peft_model) -> list[str]:
    """State-dict keys (full model namespace, adapter name included) of every tensor `save_pretrained` would write.

    Decided by PEFT's own selection (`get_peft_model_state_dict`: LoRA/DoRA tensors, `modules_to_save`, trainable
    token deltas, and the embedding/LM-head rows it saves after a vocabulary resize) over a skeleton of placeholder
    tensors, so no weight is read. Call it on the model before FSDP wraps it: a wrapped FSDP1 model's state dict
    would gather everything, which is exactly what this module avoids.
    """
    from peft import PeftModel, get_peft_model_state_dict

    if not isinstance(peft_model, PeftModel):
        return []
    skeleton = {key: torch.empty(0, device="meta") for key in peft_model.state_dict(keep_vars=True)}
    key_of = {id(placeholder): key for key, placeholder in skeleton.items()}
    with compat.module_names_without_fsdp_segments(peft_model):
        selected = get_peft_model_state_dict(peft_model, state_dict=skeleton,
                                             save_embedding_layers=compat.save_embedding_layers_for(peft_model))
    return sorted(key_of[id(value)] for value in selected.values())


def gather_adapter_state(accelerator, wrapped_model, keys: list[str]) -> dict[str, torch.Tensor]:
    """Collective: every rank calls it with the same `keys`. Returns {key: full tensor} on the main process (CPU
    tensors under FSDP/DeepSpeed), {} on the others."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        return _gather_deepspeed(accelerator, wrapped_model, keys)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:  # one process or DDP: every rank holds every weight
        if not accelerator.is_main_process:
            return {}
        state = accelerator.unwrap_model(wrapped_model).state_dict()
        return {key: state[key] for key in keys}
    if plugin.fsdp_version == 2:
        return _gather_fsdp2(accelerator, wrapped_model, keys)
    return _gather_fsdp1(accelerator, wrapped_model, keys)


def _gather_fsdp2(accelerator, wrapped_model, keys):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # full_state_dict=False: DTensor shards keyed by clean names, nothing gathered yet.
    sharded = get_model_state_dict(wrapped_model, options=StateDictOptions(full_state_dict=False))
    out = {}
    for key in keys:  # the same order on every rank: each full_tensor() is an all-gather
        value = sharded[key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if accelerator.is_main_process:
            out[key] = full.detach().cpu()
        del full
    return out


def _owning_unit(key: str, unit_names: list[str]) -> str:
    """The deepest FSDP unit (clean module name, "" for the root) whose subtree holds `key`."""
    owner = ""
    for name in unit_names:
        if (not name or key.startswith(name + ".")) and len(name) >= len(owner):
            owner = name
    return owner


def _fsdp1_units_by_owner(wrapped_model, keys):
    """({clean unit name: FSDP unit}, {clean unit name: the wanted keys its subtree (not its sub-units) holds})."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = {compat.strip_wrapper_segments(name + ".").rstrip(".") if name else "": module
             for name, module in wrapped_model.named_modules() if isinstance(module, FSDP)}
    wanted_by_unit: dict[str, set[str]] = {}
    for key in keys:
        wanted_by_unit.setdefault(_owning_unit(key, list(units)), set()).add(key)
    return units, wanted_by_unit


def fsdp1_sharded_adapter_state(wrapped_model, keys: list[str]) -> dict | None:
    """Collective: the SHARDED_STATE_DICT entries (ShardedTensors, full-model keys) of the adapter's tensors only,
    for an FSDP1 checkpoint; None when the root unit owns one of them (a resized vocabulary's embedding rows),
    where asking the root would shard-copy every weight anyway.

    Why: accelerate's `save_fsdp_model(adapter_only=True)` picks the adapter out of `model.state_dict()`, which
    under FSDP1 flat parameters unshards every unit and clones this rank's chunk of every frozen weight (measured:
    +130 MiB on each rank per checkpoint for a 149 MiB model). Asking only the adapter's own units (PEFT's wrap
    policy gives each LoRA layer its own unit) does the same work on the adapter alone; the DCP files have the
    same keys, so accelerate's `load_fsdp_model` resumes from them unchanged.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    units, wanted_by_unit = _fsdp1_units_by_owner(wrapped_model, keys)
    if "" in wanted_by_unit:
        return None
    out = {}
    with FSDP.state_dict_type(wrapped_model, StateDictType.SHARDED_STATE_DICT):
        for name, unit in units.items():  # named_modules order: the same on every rank
            wanted = wanted_by_unit.get(name)
            if wanted:
                for local, value in unit.state_dict().items():
                    key = f"{name}.{compat.strip_wrapper_segments(local)}"
                    if key in wanted:
                        out[key] = value
    return out


def _gather_fsdp1(accelerator, wrapped_model, keys):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units, wanted_by_unit = _fsdp1_units_by_owner(wrapped_model, keys)
    # Offload only from a GPU: on a CPU compute device FSDP1 frees the storage it then reads (see compat).
    on_gpu = accelerator.device.type != "cpu"
    out = {}
    for name, unit in units.items():  # dict order = named_modules order, the same on every rank
        wanted = wanted_by_unit.get(name)
        if not wanted:
            continue
        with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True, offload_to_cpu=on_gpu):
            if accelerator.is_main_process:
                prefix = f"{name}." if name else ""
                # remove_duplicate=False: a tied output head is the embedding's parameter under a second name, and
                # PEFT saves both keys (as the one-process save does).
                named = [*unit.named_parameters(remove_duplicate=False), *unit.named_buffers(remove_duplicate=False)]
                for local, tensor in named:
                    key = prefix + compat.strip_wrapper_segments(local)
                    if key in wanted:
                        out[key] = tensor.detach().clone().cpu()
    missing = sorted(set(keys) - set(out)) if accelerator.is_main_process else []
    if missing:
        raise RuntimeError(f"FSDP1 adapter gather found no tensor for {len(missing)} keys, e.g. {missing[:3]}")
    return out


def _gather_deepspeed(accelerator, wrapped_model, keys):
    import deepspeed

    model = accelerator.unwrap_model(wrapped_model)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head under its own name too
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = list({id(params[key]): params[key] for key in keys if key in params}.values())  # each tensor once
    out = {}
    with deepspeed.zero.GatheredParameters(wanted, modifier_rank=None):
        if accelerator.is_main_process:
            for key in keys:
                tensor = params[key] if key in params else buffers[key]
                out[key] = tensor.detach().cpu().clone()
    return out
