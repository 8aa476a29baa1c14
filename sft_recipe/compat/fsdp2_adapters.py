"""Switch, freeze and disable LoRA adapters on an FSDP2-wrapped (`fully_shard`) PEFT model without silent no-ops.

Why this exists (peft 0.21.2, torch 2.13, accelerate 1.15; pinned by tests/e2e/test_fsdp2_adapters.py):
FSDP2 keeps each parameter twice: the sharded DTensor (the source of truth for `requires_grad`, what the optimizer
holds) and, while a unit is gathered, an unsharded copy that it registers on the module in the DTensor's place.
Every all-gather copies `requires_grad` from the DTensor onto the gathered copy. PEFT's `set_adapter`,
`set_requires_grad` and the exit of `disable_adapter` flip `requires_grad` on whatever is registered *now*; when a
unit is still gathered the flip lands on the throw-away copy, the next all-gather undoes it, and the adapter layers
in that unit train for one more step and then stop (measured: the active adapter's lm_head LoRA froze), no error.
A unit is still gathered after a forward without backward (evaluation) when it does not reshard after forward:
accelerate's FSDP2 preparation gives the `[final norm, lm_head]` unit `reshard_after_forward=False` (measured, with
LoRA on lm_head), and the root, the PeftModel itself, keeps torch's default for roots, also no reshard (it holds
no LoRA in accelerate's layout). By the same mechanism, `fsdp_reshard_after_forward: false` would expose every
decoder layer (not measured). After `backward()` every unit is resharded, so a switch right after an optimizer
step works even with plain PEFT calls (measured).
The PEFT guide's FSDP2 note describes PEFT resharding inside these methods itself; peft 0.21.2 does not, so call
them through this module (it reshards every FSDP2 unit in the model, wrappers around the PeftModel included).

Also checked here: an adapter can only learn if its parameters are in the optimizer. Build the optimizer over every
adapter you will train (`set_requires_grad([...], True)` before building it, or pass the parameters explicitly),
not over the currently trainable ones only (what transformers' Trainer does). Being frozen when wrapped is fine.

Use between optimizer steps, never inside forward/backward. Merged adapters are refused: the guide says units
holding a merged adapter layer's weights are not resharded, and PEFT's FSDP support excludes merging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.fsdp import FSDPModule


def _peft_model(model: torch.nn.Module):
    """The PeftModel itself, or the first one inside a wrapper (e.g. a user's FSDP2 unit around it)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model
    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    raise TypeError(
        f"expected a PEFT model (or a module containing one), got {type(model).__name__}. Fix: pass the model "
        "returned by `get_peft_model(...)` / `accelerator.prepare(...)`."
    )


def _check_adapter_names(peft_model, adapter_names: Sequence[str]) -> None:
    unknown = [name for name in adapter_names if name not in peft_model.peft_config]
    if unknown:
        raise ValueError(
            f"adapter name(s) {unknown} not found; this model has {sorted(peft_model.peft_config)}. Fix: use one of "
            "those names or add the adapter with `add_adapter(name, config)` before wrapping with FSDP2."
        )


def _as_names(adapter_names: str | Sequence[str]) -> list[str]:
    return [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)


def reshard_fsdp2_units(model: torch.nn.Module) -> int:
    """Put every FSDP2 unit in `model` (itself included) back to its sharded DTensor parameters.

    After this, the module attributes PEFT touches *are* the DTensors, so `requires_grad` changes reach them.
    A unit that is already sharded is left as it is. Returns the number of FSDP2 units seen (0: not FSDP2).
    """
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.reshard()
    return len(units)


def adapter_parameters(model: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Parameter]:
    """name -> parameter of one adapter, found through the PEFT layers (not by guessing from names)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: dict[str, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for layer_name in module.adapter_layer_names:
            container = getattr(module, layer_name, None)
            if container is None or adapter_name not in container:
                continue
            entry = container[adapter_name]
            params = [("", entry)] if isinstance(entry, torch.nn.Parameter) else entry.named_parameters()
            for param_name, param in params:
                found[".".join(p for p in (module_name, layer_name, adapter_name, param_name) if p)] = param
    return found


def check_optimizer_covers(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           adapter_names: str | Sequence[str]) -> None:
    """Raise if some parameter of these adapters is not in `optimizer` (it would get gradients but never move).

    Compares by identity with the registered parameters, after resharding: a gathered unit registers copies that no
    optimizer holds, and would be reported missing.
    """
    names = _as_names(adapter_names)
    _check_adapter_names(_peft_model(model), names)
    reshard_fsdp2_units(model)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name in names:
        missing = [n for n, p in adapter_parameters(model, name).items() if id(p) not in in_optimizer]
        if missing:
            raise ValueError(
                f"adapter {name!r} has {len(missing)} parameter(s) that are not in the optimizer, e.g. {missing[0]}: "
                "it would get gradients but never change. Fix: make every adapter you will train trainable before "
                "building the optimizer (`model.set_requires_grad([...all adapter names...], True)`), build it "
                "over them, then `accelerator.prepare(model, optimizer)`, then `set_adapter` the first one."
            )


def _refuse_merged(peft_model) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = sorted({name for module in peft_model.modules() if isinstance(module, BaseTunerLayer)
                     for name in module.merged_adapters})
    if merged:
        raise ValueError(
            f"adapter(s) {merged} are merged into the base weights; switching or re-flagging adapters on FSDP2 "
            "needs them unmerged. Fix: call `model.unmerge_adapter()` first (merging is not supported with FSDP)."
        )


def set_adapter_fsdp2(model: torch.nn.Module, adapter_name: str,
                      optimizer: torch.optim.Optimizer | None = None) -> None:
    """`model.set_adapter(adapter_name)` whose `requires_grad` changes reach the FSDP2 shards.

    With `optimizer`, first refuse to switch to an adapter the optimizer does not hold.
    """
    peft_model = _peft_model(model)
    _check_adapter_names(peft_model, [adapter_name])
    _refuse_merged(peft_model)
    if optimizer is not None:
        check_optimizer_covers(model, optimizer, adapter_name)
    reshard_fsdp2_units(model)
    peft_model.set_adapter(adapter_name)


def set_requires_grad_fsdp2(model: torch.nn.Module, adapter_names: str | Sequence[str],
                            requires_grad: bool = True) -> None:
    """`model.set_requires_grad(...)` whose changes reach the FSDP2 shards."""
    peft_model = _peft_model(model)
    _check_adapter_names(peft_model, _as_names(adapter_names))
    _refuse_merged(peft_model)
    reshard_fsdp2_units(model)
    peft_model.set_requires_grad(adapter_names, requires_grad=requires_grad)


@contextlib.contextmanager
def disable_adapter_fsdp2(model: torch.nn.Module) -> Iterator[None]:
    """`with model.disable_adapter():` that gives `requires_grad` back to the shards on exit.

    PEFT re-enables the active adapter's `requires_grad` when the block ends; a forward inside the block can leave
    units gathered, so they are resharded first, at entry as well as at exit.
    """
    peft_model = _peft_model(model)
    _refuse_merged(peft_model)
    reshard_fsdp2_units(model)
    with peft_model.disable_adapter():
        try:
            yield
        finally:
            # Runs before PEFT's own exit code (the enclosing `with`), which flips requires_grad back on.
            reshard_fsdp2_units(model)
