"""Workarounds for library bugs and gaps, one function each.

Each says which bug, how it shows, and how to tell when it can go. Nothing else in the recipe patches a library.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_FSDP_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def fsdp_requested() -> bool:
    """`accelerate launch` with an FSDP config exports ACCELERATE_USE_FSDP=true to every rank."""
    return _env_flag("ACCELERATE_USE_FSDP")


def deepspeed_requested() -> bool:
    """`accelerate launch` with a DeepSpeed config exports ACCELERATE_USE_DEEPSPEED=true to every rank."""
    return _env_flag("ACCELERATE_USE_DEEPSPEED")


def requested_fsdp_version() -> str | None:
    """"1" or "2" when the launcher asked for FSDP (accelerate exports FSDP_VERSION; 1 when absent), else None."""
    return os.environ.get("FSDP_VERSION", "1") if fsdp_requested() else None


def cpu_ram_efficient_loading_requested() -> bool:
    """An FSDP launch whose config sets fsdp_cpu_ram_efficient_loading (accelerate exports it to every rank)."""
    return fsdp_requested() and _env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def local_rank() -> int:
    """This process's rank on its machine (0 when not launched by a distributed launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def fsdp_on_cpu_requested() -> bool:
    return fsdp_requested() and _env_flag("ACCELERATE_USE_CPU")


def enable_fsdp_on_cpu() -> bool:
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
    if not fsdp_requested():
        return False
    if not _env_flag("ACCELERATE_USE_CPU"):
        if torch.cuda.is_available():
            return False
        from .args import ConfigError

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


def strip_wrapper_segments(name: str) -> str:
    """'base_model.model.layers.0._fsdp_wrapped_module.self_attn' -> 'base_model.model.layers.0.self_attn'."""
    previous = None
    while previous != name:
        previous, name = name, _FSDP_WRAPPER_SEGMENT.sub(r"\1", name)
    return name


@contextlib.contextmanager
def module_names_without_fsdp_segments(peft_model) -> Iterator[None]:
    """Make `peft_model.named_modules()` report names without FSDP1/checkpoint wrapper segments.

    Bug (peft 0.21.x, not 0.20.0): `get_peft_model_state_dict` finds the LoRA keys from module names and strips only a
    *leading* `_fsdp_wrapped_module.`; FSDP1 TRANSFORMER_BASED_WRAP nests it mid-path
    (`...layers.0._fsdp_wrapped_module.self_attn...`), so no key matches and the adapter is saved EMPTY (a 40-byte
    safetensors, exit code 0). The gathered FULL_STATE_DICT keys are already clean, so reporting clean module names
    makes them match again.
    When it can go: `tests/e2e` logs "adapter keys needed the FSDP1 name fix" for FSDP1 runs; when it stops appearing
    with a newer peft, delete this and its single caller.
    """
    original = peft_model.named_modules

    def clean_named_modules(*args, **kwargs):
        for name, module in original(*args, **kwargs):
            yield strip_wrapper_segments(name), module

    peft_model.named_modules = clean_named_modules
    try:
        yield
    finally:
        del peft_model.named_modules


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


def fsdp1_checkpoint_model_io_with_clean_names() -> None:
    """Make FSDP1 checkpoints save and load the LoRA weights.

    Bug (peft 0.21 via accelerate 1.15): `save_fsdp_model(..., adapter_only=True)` (what transformers passes for PEFT)
    selects the adapter with `get_peft_model_state_dict`, which misses every LoRA key under FSDP1 (see
    `module_names_without_fsdp_segments`): the checkpoint holds no LoRA weights and a resume continues from fresh
    ones, exit code 0. Fix here: transformers' references to `save_fsdp_model`/`load_fsdp_model` run with clean module
    names for FSDP1. Only the model I/O is wrapped: FSDP's optimizer-state mapping must keep the real names.
    When it can go: with this patch off, `tests/e2e/test_resume.py` FSDP1 still matches the uninterrupted run.
    """
    import transformers.trainer as trainer_module

    for name in ("save_fsdp_model", "load_fsdp_model"):
        original = getattr(trainer_module, name)
        if getattr(original, "_sft_recipe_clean_names", False):
            continue

        def with_clean_names(fsdp_plugin, accelerator, model, *args, _original=original, **kwargs):
            if fsdp_plugin.fsdp_version != 1:
                return _original(fsdp_plugin, accelerator, model, *args, **kwargs)
            with module_names_without_fsdp_segments(model):
                return _original(fsdp_plugin, accelerator, model, *args, **kwargs)

        with_clean_names._sft_recipe_clean_names = True
        setattr(trainer_module, name, with_clean_names)


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


def exit_skipping_teardown(code: int) -> None:
    """End a rank of a multi-process run without Python's interpreter teardown.

    Bug (torch 2.13 + gloo, CPU, intermittent: seen about once in 40 launches): after a rank has finished, saved and
    destroyed its process group, interpreter teardown can destroy a still-joinable C++ thread -- "terminate called
    without an active exception", SIGABRT -- so torchrun reports a finished (or cleanly preempted) run as failed.
    Everything the run writes is closed by then, so streams and logging are flushed and the process exits at once.
    When it can go: `bench/parity.py` run in a loop (about 80 launches) shows no SIGABRT without this.
    """
    import logging
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    logging.shutdown()
    os._exit(code)

def trainable_tokens_lm_head_bias() -> None:
    """Let TRL's fused LM head run over PEFT trainable tokens on `lm_head` (--train_new_tokens).

    Bug (trl 1.16 with peft 0.21): the fused head reads `lm_head.weight` and `lm_head.bias` directly instead of calling
    the module. PEFT's `TrainableTokensWrapper` answers `weight` with the merged (trainable) rows but has no `bias`,
    so the first training step raises AttributeError. Fix here: `bias` is the wrapped layer's own bias (None for
    Llama-style heads).
    When it can go: `tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process` passes without it.
    """
    from peft.utils.other import TrainableTokensWrapper

    if "bias" not in vars(TrainableTokensWrapper):
        TrainableTokensWrapper.bias = property(lambda self: getattr(self.original_module, "bias", None))


def restore_bnb_4bit_storage_layout(model) -> int:
    """Put 4-bit weights that bitsandbytes re-laid out for CPU inference back in their stored layout; returns how many.

    Behaviour (bitsandbytes 0.50, CPUs with AVX512-BF16 only): a `Linear4bit` forward in eval mode without grad
    rewrites its packed weight bytes into a CPU-kernel layout (`packing_format_for_cpu`); `state_dict()` converts
    them back. The values are the same, the bytes are not, so the run record's exact frozen-weight checksum after an
    evaluation said "frozen weights CHANGED" (seen with QLoRA under DDP, where only rank 0's save converted its
    copy back). The checksum runs on the stored layout, as a saved state dict holds it.
    When it can go: `tests/unit/test_report.py::test_a_cpu_evaluation_does_not_change_frozen_4bit_bytes` passes
    without this call (or bitsandbytes stops re-laying out weights in place).
    """
    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
    except ImportError:
        return 0
    restored = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            restored += 1
    return restored
