"""Workarounds for library bugs and gaps: the one place the recipe patches or steps around a library.

`install(launch)` is the single entry point: called once by the entry point (train.py, and the test/bench workers
that build a trainer without it), it installs every process-wide patch whose library version is affected.
Call-site workarounds (a function used in one place instead of the library's own) are listed too, so that one
table -- `WORKAROUNDS`, printed by `python -m sft_recipe.compat` -- says for each: the library and the versions it
was written for, whether it is active here, and the test that shows when it can go.

`TRAINER_OVERRIDES` lists the private `transformers.Trainer` methods `RecipeSFTTrainer` overrides: the real upgrade
risk, since a private method may change its signature or stop being called without notice. `install` checks their
signatures against the ones they were written for and warns, naming them, when transformers has moved.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sft_recipe.compat.accelerate_fsdp import (
    enable_fsdp_on_cpu,
    gather_full_state_dict,
    init_optimizer_state_before_fsdp1_load,
    keep_present_no_split_modules,
)
from sft_recipe.compat.cpu_module_sync import allow_fsdp1_module_sync_on_cpu, fsdp1_module_sync_allowed_on_cpu
from sft_recipe.compat.deepspeed_cpu import skip_cpu_inference_op_build
from sft_recipe.compat.deferred_compile import (
    import_bitsandbytes_compiling_on_first_use,
    import_muon_compiling_on_first_use,
)
from sft_recipe.compat.fsdp1_dtype_units import wrap_other_dtypes_apart
from sft_recipe.compat.fsdp2_adapters import (
    adapter_parameters,
    check_optimizer_covers,
    disable_adapter_fsdp2,
    reshard_fsdp2_units,
    set_adapter_fsdp2,
    set_requires_grad_fsdp2,
)
from sft_recipe.compat.fsdp2_buffers import load_persistent_buffers_apart
from sft_recipe.compat.gptq_kernels import check_trainability_before_building
from sft_recipe.compat.models_import_structure import cache_models_import_structure
from sft_recipe.compat.peft_embeddings import save_embedding_layers_for
from sft_recipe.compat.peft_names import (
    fsdp1_checkpoint_model_io_with_clean_names,
    module_names_without_fsdp_segments,
    strip_wrapper_segments,
    trainable_tokens_lm_head_bias,
)
from sft_recipe.compat.process import exit_skipping_teardown, restore_bnb_4bit_storage_layout
from sft_recipe.compat.quantized_load import quantize_each_weight_on, quantized_base_device_map
from sft_recipe.compat.trainable_tokens import collect_token_rows_off_cuda, merge_trainable_tokens_on_dtensor
from sft_recipe.compat.trl_fused_head import fused_head_reads_what_it_needs
from sft_recipe.compat.trl_prepare import without_rank_barriers
from sft_recipe.compat.unused_imports import (
    skip_unused_bitsandbytes,
    skip_unused_deepspeed,
    skip_unused_mlflow,
    skip_unused_wandb,
    skipped_imports,
)
from sft_recipe.model.kernels import packing_kernel_gaps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workaround:
    name: str                 # the function in this package
    library: str              # the distribution whose bug it works around
    affected: str             # the versions it applies to (a PEP 440 specifier); open-ended until a fix is released
    written_for: str          # the version it was written and tested against
    can_go_when: str          # the test (or check) that shows the library no longer needs it
    install: Callable | None = None  # process-wide patches: called by install(launch); None for call-site ones

    def applies(self) -> bool:
        return installed_version(self.library) in SpecifierSet(self.affected)


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround("enable_fsdp_on_cpu", "accelerate", ">=1.0", "1.15.0",
               "ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp_config.yaml reports "
               "DistributedType.FSDP without it (tests/e2e/test_train.py runs FSDP on CPU)",
               install=enable_fsdp_on_cpu),
    Workaround("load_persistent_buffers_apart", "accelerate", ">=1.0", "1.15.0",
               "the deepseek-v3-fsdp2 cell of tests/e2e/test_families.py (a router with a persistent buffer, FSDP2 "
               "with cpu_ram_efficient_loading) trains without it", install=load_persistent_buffers_apart),
    Workaround("wrap_other_dtypes_apart", "peft", ">=0.21", "0.21.2",
               "the deepseek-v3-qlora-fsdp1 cell of tests/e2e/test_families.py (an fp32 router beside a bf16-stored "
               "4-bit base, FSDP1) wraps without it", install=wrap_other_dtypes_apart),
    Workaround("fused_head_reads_what_it_needs", "trl", ">=1.16", "1.16.0",
               "tests/e2e/test_census.py trains Llama-4-text (its base_model_prefix names no child) and GraniteMoE "
               "(num_local_experts) without it", install=fused_head_reads_what_it_needs),
    Workaround("without_rank_barriers", "trl", ">=1.16", "1.16.0",
               "tests/unit/test_prepared_copy.py::test_trl_preparation_still_orders_ranks fails (TRL's "
               "_prepare_dataset no longer waits for every rank)"),
    Workaround("packing_kernel_gaps", "transformers", ">=5.0", "5.24.0",
               "transformers says which kernels a model class falls back on (tests/unit/test_model_reach.py reads "
               "the closure of its hub-kernel wrapper)"),
    Workaround("fsdp1_checkpoint_model_io_with_clean_names", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_resume.py FSDP1 matches the uninterrupted run without it",
               install=lambda launch: fsdp1_checkpoint_model_io_with_clean_names() or True),
    Workaround("trainable_tokens_lm_head_bias", "trl", ">=1.16", "1.16.0",
               "tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp passes "
               "without it",
               install=lambda launch: trainable_tokens_lm_head_bias() or True),
    Workaround("merge_trainable_tokens_on_dtensor", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_adapter_variants.py::test_new_token_rows_train_in_one_process_and_under_fsdp passes "
               "without it",
               install=lambda launch: launch.requested_fsdp_version == 2
               and (merge_trainable_tokens_on_dtensor() or True)),
    Workaround("collect_token_rows_off_cuda", "peft", ">=0.21", "0.21.2",
               "the zero3 case of tests/e2e/test_adapter_variants.py::"
               "test_new_token_rows_train_in_one_process_and_under_fsdp passes without it",
               install=lambda launch: launch.use_deepspeed and collect_token_rows_off_cuda()),
    Workaround("module_names_without_fsdp_segments", "peft", ">=0.21", "0.21.2",
               "FSDP1 runs in tests/e2e stop logging 'adapter keys needed the FSDP1 name fix'"),
    Workaround("gather_full_state_dict", "accelerate", ">=1.0", "1.15.0",
               "accelerate passes offload_to_cpu only for non-CPU devices (tests/e2e/test_adapter_gather.py compares "
               "against it)"),
    Workaround("init_optimizer_state_before_fsdp1_load", "accelerate", ">=1.0", "1.15.0",
               "tests/e2e/test_resume.py FSDP1 matches the uninterrupted run without it"),
    Workaround("exit_skipping_teardown", "torch", ">=2.0", "2.13.0",
               "bench/parity.py in a loop (about 80 launches) shows no SIGABRT without it"),
    Workaround("restore_bnb_4bit_storage_layout", "bitsandbytes", ">=0.49", "0.50.2",
               "tests/unit/test_record.py::test_a_cpu_evaluation_does_not_change_frozen_4bit_bytes passes without "
               "it"),
    Workaround("skip_unused_wandb", "trl", ">=1.16", "1.16.0",
               "tests/unit/test_compat.py::test_importing_trls_trainer_still_imports_wandb fails (TRL no longer "
               "imports wandb at import: nothing left to save by not importing it)"),
    Workaround("skip_unused_mlflow", "deepspeed", ">=0.19", "0.19.8",
               "tests/unit/test_compat.py::test_deepspeeds_config_still_imports_mlflow_through_its_autotuner fails "
               "(DeepSpeed no longer imports mlflow with its config: nothing left to save by not importing it)"),
    Workaround("skip_unused_deepspeed", "accelerate", ">=1.0", "1.15.0",
               "tests/test_compat_fresh_process.py::test_accelerates_unwrapping_still_imports_deepspeed fails "
               "(accelerate no longer imports DeepSpeed to unwrap a model: nothing left to save by not importing it)"),
    Workaround("import_bitsandbytes_compiling_on_first_use", "bitsandbytes", ">=0.50", "0.50.2",
               "tests/test_compat_fresh_process.py::test_importing_bitsandbytes_still_imports_inductor fails "
               "(bitsandbytes no longer compiles its kernels at import: nothing left to defer)"),
    Workaround("skip_unused_bitsandbytes", "bitsandbytes", ">=0.50", "0.50.2",
               "tests/test_compat_fresh_process.py::test_importing_bitsandbytes_still_imports_inductor fails "
               "(bitsandbytes no longer compiles its kernels at import: nothing left to save by not importing it)"),
    Workaround("skip_cpu_inference_op_build", "deepspeed", ">=0.19", "0.19.8",
               "tests/unit/test_compat.py::test_deepspeed_still_builds_its_cpu_inference_op_at_init fails "
               "(DeepSpeed's TorchBackend no longer builds its CPU inference op while it starts)"),
    Workaround("import_muon_compiling_on_first_use", "deepspeed", ">=0.19", "0.19.8",
               "tests/test_compat_fresh_process.py::test_deepspeeds_zero_optimizer_check_still_imports_inductor fails "
               "(DeepSpeed's ZeRO optimizer check no longer imports a module that compiles at import)"),
    Workaround("cache_models_import_structure", "transformers", ">=5.0", "5.24.0",
               "tests/unit/test_compat.py::test_transformers_still_scans_every_model_file_to_import_its_models fails "
               "(transformers.models no longer reads every model file when it is imported)"),
    Workaround("keep_present_no_split_modules", "accelerate", ">=1.0", "1.15.0",
               "the gemma3-multimodal FSDP2 cell of tests/e2e/test_families.py wraps without it"),
    Workaround("save_embedding_layers_for", "peft", ">=0.21", "0.21.2",
               "the gemma3-multimodal cell of tests/e2e/test_families.py saves the resized embedding rows without "
               "it"),
    Workaround("allow_fsdp1_module_sync_on_cpu", "torch", ">=2.0", "2.13.0",
               "test-only (bench/train_syncing_module_states_on_cpu.py installs it, never a user's run): "
               "tests/unit/test_cpu_module_sync.py "
               "finds torch and accelerate no longer refuse FSDP1 sync_module_states on CPU"),
    Workaround("quantized_base_device_map", "transformers", ">=5.0", "5.24.0",
               "tests/unit/test_quantized_placement.py::test_transformers_still_loads_a_quantized_base_onto_the_gpu "
               "fails (the quantizer no longer maps a 4-bit base onto each rank's GPU under FSDP)"),
    Workaround("quantize_each_weight_on", "transformers", ">=5.0", "5.24.0",
               "goes with quantized_base_device_map (the CPU map it speeds up); tests/unit/"
               "test_quantized_placement.py::test_each_weight_quantized_on_a_device_comes_back_as_the_cpu_load shows "
               "it still hooks transformers' Bnb4bitQuantize.convert"),
    Workaround("reshard_fsdp2_units", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_fsdp2_adapters.py::test_pitfall_plain_set_adapter_after_an_eval_forward_trains_the_"
               "lm_head_lora_once fails (PEFT reshards a gathered FSDP2 unit before it flips requires_grad)"),
    Workaround("set_adapter_fsdp2", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_fsdp2_adapters.py::test_pitfall_plain_set_adapter_after_an_eval_forward_trains_the_"
               "lm_head_lora_once fails (PEFT reshards a gathered FSDP2 unit before it flips requires_grad)"),
    Workaround("set_requires_grad_fsdp2", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_fsdp2_adapters.py::test_pitfall_plain_set_adapter_after_an_eval_forward_trains_the_"
               "lm_head_lora_once fails (PEFT reshards a gathered FSDP2 unit before it flips requires_grad)"),
    Workaround("check_trainability_before_building", "gptqmodel", ">=7.7", "7.7.0",
               "tests/test_gptq.py::test_gpt_qmodel_builds_no_kernel_it_cannot_train_with finds GPT-QModel's own "
               "validate reads SUPPORTS_TRAINING before it builds a kernel (called by train/gptq.py's loading)"),
    Workaround("disable_adapter_fsdp2", "peft", ">=0.21", "0.21.2",
               "tests/e2e/test_fsdp2_adapters.py::test_pitfall_plain_set_adapter_after_an_eval_forward_trains_the_"
               "lm_head_lora_once fails (PEFT reshards a gathered FSDP2 unit before it flips requires_grad)"),
)

# Not workarounds themselves: what they are built from (used by gather.py), and what validation asks.
HELPERS = ("skipped_imports", "cached_structure", "compile_on_first_call", "strip_wrapper_segments",
           "fsdp1_module_sync_allowed_on_cpu", "other_dtype_modules", "with_units_for", "adapter_parameters",
           "check_optimizer_covers")


@dataclass(frozen=True)
class TrainerOverride:
    method: str          # private transformers.Trainer method RecipeSFTTrainer overrides
    parameters: tuple    # its parameter names in the version below (what our override accepts and passes on)
    why: str


TRAINER_OVERRIDES_FIT = SpecifierSet("==5.24.*")  # the transformers versions the overrides were checked against
TRAINER_OVERRIDES: tuple[TrainerOverride, ...] = (
    TrainerOverride("_save_checkpoint", ("self", "model", "trial"),
                    "mark a checkpoint complete once every rank wrote it, rotate (transformers' rotate_checkpoints) "
                    "only then; a full disk on any rank ends every rank; record its memory cost"),
    TrainerOverride("_get_grad_norm", ("self", "model", "grad_norm"),
                    "watch the step's gradient norm for non-finite values (train/divergence.py)"),
    TrainerOverride("_save_rng_state", ("self", "output_dir"), "RNG state as safetensors, not a pickle"),
    TrainerOverride("_load_rng_state", ("self", "checkpoint"), "read it back; tolerate a resume on other ranks"),
    TrainerOverride("_save_optimizer_and_scheduler", ("self", "output_dir"),
                    "pickle-free optimizer/scheduler; FSDP1 SHARDED writes only the adapter's shards"),
    TrainerOverride("_load_from_checkpoint", ("self", "resume_from_checkpoint", "model"),
                    "refuse unsafe DCP metadata; fail when no trainable weight was loaded"),
    TrainerOverride("_load_optimizer_and_scheduler", ("self", "checkpoint"),
                    "pickle-free load; FSDP1 moments kept (init_optimizer_state_before_fsdp1_load)"),
)


def installed_version(distribution: str) -> Version:
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return Version("0")


def trainer_override_drift() -> list[str]:
    """The overridden private Trainer methods whose signature is no longer the one they were written for."""
    from transformers import Trainer

    drift = []
    for override in TRAINER_OVERRIDES:
        method = getattr(Trainer, override.method, None)
        if method is None:
            drift.append(f"{override.method}: no longer on transformers.Trainer")
            continue
        parameters = tuple(inspect.signature(method).parameters)
        if parameters != override.parameters:
            drift.append(f"{override.method}{parameters}: written for {override.parameters}")
    return drift


_state = {"done": False, "names": []}


def install(launch) -> list[str]:
    """Install every process-wide workaround whose library version is affected; idempotent. Returns their names.
    Raises ConfigError where the launch cannot run as asked (FSDP without a GPU and without the CPU switch)."""
    if _state["done"]:
        return list(_state["names"])
    for workaround in WORKAROUNDS:
        if workaround.install is not None and workaround.applies() and workaround.install(launch):
            _state["names"].append(workaround.name)
    transformers_version = installed_version("transformers")
    if launch.is_main_process and transformers_version not in TRAINER_OVERRIDES_FIT:
        drift = trainer_override_drift()
        if drift:
            logger.warning(f"transformers {transformers_version}: RecipeSFTTrainer overrides private Trainer methods "
                           f"checked against transformers{TRAINER_OVERRIDES_FIT}, and these changed: "
                           f"{'; '.join(drift)}. Checkpoints may not save or resume as tested.")
    _state["done"] = True
    return list(_state["names"])


def installed() -> bool:
    return _state["done"]


__all__ = [
    "TRAINER_OVERRIDES", "WORKAROUNDS", "adapter_parameters", "allow_fsdp1_module_sync_on_cpu",
    "check_trainability_before_building",
    "check_optimizer_covers", "disable_adapter_fsdp2", "reshard_fsdp2_units", "set_adapter_fsdp2",
    "set_requires_grad_fsdp2", "enable_fsdp_on_cpu",
    "exit_skipping_teardown", "gather_full_state_dict",
    "fsdp1_module_sync_allowed_on_cpu", "fused_head_reads_what_it_needs", "init_optimizer_state_before_fsdp1_load",
    "install", "installed", "keep_present_no_split_modules",
    "load_persistent_buffers_apart", "wrap_other_dtypes_apart", "merge_trainable_tokens_on_dtensor",
    "module_names_without_fsdp_segments", "packing_kernel_gaps",
    "quantize_each_weight_on", "quantized_base_device_map", "save_embedding_layers_for", "without_rank_barriers",
    "restore_bnb_4bit_storage_layout", "strip_wrapper_segments", "trainable_tokens_lm_head_bias",
    "trainer_override_drift", "import_bitsandbytes_compiling_on_first_use", "skip_unused_bitsandbytes",
    "skip_unused_deepspeed", "skip_unused_mlflow", "skip_unused_wandb",
    "skip_cpu_inference_op_build", "import_muon_compiling_on_first_use",
    "cache_models_import_structure", "collect_token_rows_off_cuda", "skipped_imports",
]
