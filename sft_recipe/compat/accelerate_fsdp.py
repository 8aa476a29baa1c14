"""accelerate 1.15: an FSDP launch on a CPU machine silently runs DDP; FSDP1's full gather frees what it reads on CPU;
FSDP1's sharded optimizer load drops Adam's moments on resume."""

from __future__ import annotations

import torch

from sft_recipe.compat.peft_names import strip_wrapper_segments


def enable_fsdp_on_cpu(launch) -> bool:
    """Make an FSDP launch on a CPU machine really run FSDP (over gloo) instead of silently running DDP.

    Bug (accelerate 1.15): `AcceleratorState` only promotes GPU-like distributed types to FSDP, so with the CPU
    switch on, `distributed_type: FSDP` becomes `MULTI_CPU` (DDP) with exit code 0. The launcher also drops the
    config's `use_cpu: true` for FSDP configs, hence the switch is accelerate's own environment variable
    `ACCELERATE_USE_CPU=true`, which transformers' TrainingArguments also reads.
    Fix here: after AcceleratorState is built, promote it (and PartialState, which shares the fields) to FSDP with
    the plain `cpu` device (FSDP1 rejects `cpu:0`: "Inconsistent compute device and `device_id`").
    When it can go: `ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp_config.yaml ...`
    reports `DistributedType.FSDP` without this patch.

    Returns True when the patch was installed. Raises when FSDP is asked on a machine with no GPU and no CPU switch,
    rather than letting accelerate run something else.
    """
    if not launch.use_fsdp:
        return False
    if not launch.use_cpu:
        if torch.cuda.is_available():
            return False
        from sft_recipe.errors import ConfigError

        raise ConfigError([
            "the accelerate config asks for FSDP but this machine has no CUDA GPU. Fix: to run FSDP on the CPU "
            "(gloo), launch with ACCELERATE_USE_CPU=true and a CPU config, e.g. `ACCELERATE_USE_CPU=true accelerate "
            "launch --config_file configs/cpu/fsdp_config.yaml train.py ...`."
        ])

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_sft_recipe_fsdp_on_cpu", False):
        return True
    original_init = AcceleratorState.__init__

    def init_then_promote(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if self.distributed_type == DistributedType.MULTI_CPU and plugin is not None:
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            cpu = torch.device("cpu")
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            self.device = cpu
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            PartialState._shared_state["device"] = cpu

    init_then_promote._sft_recipe_fsdp_on_cpu = True
    AcceleratorState.__init__ = init_then_promote
    return True


def gather_full_state_dict(accelerator, wrapped_model) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it. Returns the full, unsharded state dict on the main process ({} elsewhere).

    Bug (accelerate 1.15): `Accelerator.get_state_dict` for FSDP1 hard-codes `offload_to_cpu=True`; when the compute
    device is already the CPU, FSDP frees the unsharded storage it then reads, and the save dies with
    "setStorage: ... out of bounds for storage of size 0". So the offload is only asked for on a GPU.
    When it can go: accelerate passes `offload_to_cpu` only for non-CPU devices (or FSDP1 tolerates it on CPU).
    """
    state = accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None:
        return accelerator.get_state_dict(wrapped_model) or {}
    on_gpu = accelerator.device.type != "cpu"
    if plugin.fsdp_version == 2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(wrapped_model, options=options)
    else:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)
        with FSDP.state_dict_type(wrapped_model, StateDictType.FULL_STATE_DICT, config):
            state_dict = wrapped_model.state_dict()
    if not accelerator.is_main_process:
        return {}
    return {strip_wrapper_segments(k): v for k, v in state_dict.items()}


def init_optimizer_state_before_fsdp1_load(optimizer) -> None:
    """Give a fresh optimizer its state tensors so an FSDP1 sharded optimizer checkpoint has somewhere to load into.

    Bug (accelerate 1.15 `load_fsdp_optimizer`, FSDP1): the load template is built from the optimizer's current
    state; on resume that state is still empty, so the checkpoint's Adam moments are silently dropped and training
    continues from fresh moments (the first resumed step matches, later ones drift). torch's own
    `_init_optim_state` (what `set_optimizer_state_dict` does for FSDP2) creates the state with a zero-lr step.
    When it can go: `tests/e2e/test_resume.py` FSDP1 still matches the uninterrupted run without this call.
    """
    if any(optimizer.state.values()):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def keep_present_no_split_modules(model) -> list[str]:
    """Drop from the model's `_no_split_modules` the layer classes it does not contain; returns the dropped names.

    Bug (accelerate 1.15 `FullyShardedDataParallelPlugin.set_auto_wrap_policy`, and peft 0.21's
    `fsdp_auto_wrap_policy` that transformers' Trainer applies): TRANSFORMER_BASED_WRAP wraps the classes named in
    `model._no_split_modules` and raises "Could not find the transformer layer class X in the model" for one that is
    absent. transformers 5 collects that list from every sub-model a composite model may hold: a multimodal
    checkpoint (Gemma-3 4B+) lists `SiglipTextEmbeddings`, which its vision tower does not have, so FSDP wrapping
    failed after the model had loaded. The present classes (the decoder layer among them) still wrap as before.
    When it can go: the gemma3-multimodal FSDP2 cell of tests/e2e/test_families.py wraps without it.
    """
    names = getattr(model, "_no_split_modules", None)
    if not names:
        return []
    present = {type(module).__name__ for module in model.modules()}
    dropped = sorted(name for name in names if name not in present)
    if dropped:
        model._no_split_modules = sorted(name for name in names if name in present)  # this instance only
    return dropped
