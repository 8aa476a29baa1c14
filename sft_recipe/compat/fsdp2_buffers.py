"""accelerate 1.15: FSDP2 with cpu_ram_efficient_loading crashes on a model that holds a persistent buffer."""

from __future__ import annotations

import torch


def load_persistent_buffers_apart(launch) -> bool:
    """Let FSDP2's rank-0 weight broadcast carry a model's persistent buffers.

    Bug (accelerate 1.15): with `fsdp_cpu_ram_efficient_loading: true`, `fsdp2_load_full_state_dict` takes every
    entry of the sharded model's `state_dict()` for a DTensor (`sharded_param.device_mesh`). A persistent buffer is
    in that state dict but FSDP2 never shards buffers, so the load dies with "'Tensor' object has no attribute
    'device_mesh'" after the weights were read. DeepSeek-V3's router keeps its `e_score_correction_bias` so; any
    family may. (Non-persistent buffers are outside the state dict: accelerate re-registers those itself.)
    Fix here: for the length of that load, the persistent buffers are marked non-persistent (so accelerate's loop
    sees only parameters); afterwards rank 0 broadcasts each buffer's value from its full state dict and every rank
    registers it back, persistent, on its device.
    When it can go: the deepseek-v3 FSDP2 cell of tests/e2e/test_families.py trains without it.
    """
    if not (launch.use_fsdp and launch.requested_fsdp_version == 2 and launch.cpu_ram_efficient_loading):
        return False
    from accelerate.utils import fsdp_utils

    original = fsdp_utils.fsdp2_load_full_state_dict
    if getattr(original, "_sft_recipe_buffers_apart", False):
        return True

    def load_with_buffers_apart(accelerator, model, full_sd, *args, **kwargs):
        owners = _persistent_buffers(model)
        for module, name in owners.values():
            module._non_persistent_buffers_set.add(name)
        try:
            model = original(accelerator, model, full_sd, *args, **kwargs)
        finally:
            for module, name in owners.values():
                module._non_persistent_buffers_set.discard(name)
        _broadcast_buffers(accelerator, owners, full_sd)
        return model

    load_with_buffers_apart._sft_recipe_buffers_apart = True
    fsdp_utils.fsdp2_load_full_state_dict = load_with_buffers_apart
    return True


def _persistent_buffers(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """{state-dict key: (owning module, buffer name)} for every persistent buffer."""
    owners = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                owners[f"{module_name}.{name}" if module_name else name] = (module, name)
    return owners


def _broadcast_buffers(accelerator, owners, full_sd) -> None:
    import torch.distributed as dist

    device = accelerator.device
    for key, (module, name) in owners.items():
        held = getattr(module, name)
        if accelerator.is_main_process:
            value = full_sd[key].detach().to(device=device, dtype=held.dtype).contiguous()
        else:  # on the meta device here: only its shape and dtype are known
            value = torch.empty(held.shape, dtype=held.dtype, device=device)
        dist.broadcast(value, src=0)
        module.register_buffer(name, value, persistent=True)
