"""The launcher's environment, read once into one typed, frozen object.

`accelerate launch` (and torchrun under it) tells each rank how the run is distributed through environment
variables: RANK/WORLD_SIZE/LOCAL_RANK, ACCELERATE_USE_* for the engine, FSDP_* and ACCELERATE_DEEPSPEED_* for the
accelerate YAML's settings. This module is the only reader of them. Every boolean is read with accelerate's own rule
(`str_to_bool`: y/yes/t/true/on/1 and n/no/f/false/off/0, any case), so the recipe and the launcher can never
disagree about a value such as `FSDP_OFFLOAD_PARAMS=1`; a value accelerate would reject is a ConfigError here,
naming the variable, before anything is loaded.

The entry point reads it once (`read_launch_env()`) and passes it to what needs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accelerate.utils.environment import str_to_bool


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0                      # RANK: this process among all
    local_rank: int = 0                # LOCAL_RANK: this process on its machine
    world_size: int = 1                # WORLD_SIZE: processes in the run
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE: processes on this machine (None: not exported)
    # `accelerate launch` started this process: every accelerate launcher exports ACCELERATE_MIXED_PRECISION, torchrun
    # and python do not (config/launcher_yaml.py then reads the YAML from the launcher's command line).
    accelerate_launched: bool = False
    use_cpu: bool = False              # ACCELERATE_USE_CPU: the CPU switch (also read by transformers)
    use_fsdp: bool = False             # ACCELERATE_USE_FSDP: the accelerate YAML says distributed_type: FSDP
    use_deepspeed: bool = False        # ACCELERATE_USE_DEEPSPEED
    mixed_precision: str = "no"        # ACCELERATE_MIXED_PRECISION
    fsdp_version: int = 1              # FSDP_VERSION (accelerate's default is 1)
    fsdp_sharding_strategy: str = "FULL_SHARD"
    fsdp_reshard_after_forward: str = "true"
    fsdp_offload_params: bool = False
    fsdp_cpu_ram_efficient_loading: bool = False
    fsdp_sync_module_states: bool = False
    fsdp_use_orig_params: bool = False
    fsdp_state_dict_type: str = ""     # "" when the YAML does not say (accelerate's default: FULL_STATE_DICT)
    fsdp_activation_checkpointing: bool = False          # FSDP's own checkpointing (fsdp_activation_checkpointing)
    fsdp_activation_checkpointing_offload: bool = False  # ... with checkpointed inputs offloaded to host RAM
    fsdp_auto_wrap_policy: str = ""    # "" when not exported (accelerate's default: NO_WRAP)
    fsdp_backward_prefetch: str = ""   # "" when not exported
    fsdp_transformer_layer_cls_to_wrap: str = ""  # FSDP_TRANSFORMER_CLS_TO_WRAP: comma-separated class names
    context_parallel_size: int = 1     # PARALLELISM_CONFIG_CP_SIZE, when ACCELERATE_USE_PARALLELISM_CONFIG is on
    sequence_parallel_backend: str = ""  # PARALLELISM_CONFIG_SP_BACKEND when sequence parallelism is on (SP_SIZE > 1)
    deepspeed_zero_stage: str = ""     # ACCELERATE_DEEPSPEED_ZERO_STAGE
    deepspeed_zero3_init: bool = False
    deepspeed_zero3_save_16bit_model: bool = False
    deepspeed_offload_param_device: str = ""      # ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE (none|cpu|nvme)
    deepspeed_offload_optimizer_device: str = ""  # ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE
    gradient_accumulation_steps: str = ""  # ACCELERATE_GRADIENT_ACCUMULATION_STEPS (a DeepSpeed config's own value)
    gradient_clipping: str = ""        # ACCELERATE_GRADIENT_CLIPPING (a DeepSpeed config's own value)
    hub_offline: bool = False          # HF_HUB_OFFLINE, read with huggingface_hub's own rule (it is the hub's)
    hf_token_set: bool = False         # HF_TOKEN is exported (the token's value is never kept)
    # torchrun (and `accelerate launch` through it) forwards SIGINT/SIGTERM to the ranks, then SIGKILLs them this many
    # seconds later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch's default 30); None: not under torchrun.
    launcher_shutdown_timeout_s: int | None = None
    slurm_job_id: str = ""             # SLURM_JOB_ID: a requeued job keeps it (the run hold's "same job, restarted")
    slurm_restart_count: str = ""      # SLURM_RESTART_COUNT ("0" under Slurm before any requeue)

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def fsdp_on_cpu(self) -> bool:
        """FSDP over gloo on a CPU machine (see compat.enable_fsdp_on_cpu)."""
        return self.use_fsdp and self.use_cpu

    @property
    def requested_fsdp_version(self) -> int | None:
        """1 or 2 when the launcher asked for FSDP, else None."""
        return self.fsdp_version if self.use_fsdp else None

    @property
    def cpu_ram_efficient_loading(self) -> bool:
        """Only rank 0 reads the weights; the others receive them once FSDP wraps the model."""
        return self.use_fsdp and self.fsdp_cpu_ram_efficient_loading

    def for_planning_a_gpu_run(self) -> LaunchEnv:
        """The environment as the planner parses train.py's flags for a GPU run on a machine without one: the CPU
        switch on, so transformers accepts bf16 it cannot run here (nothing is run)."""
        return replace(self, use_cpu=True)

    def accelerate_config(self) -> dict[str, Any]:
        """The accelerate YAML rebuilt from what the launcher exported (what the memory plan reads in train.py)."""
        machines = max(1, self.world_size // max(1, self.local_world_size or self.world_size))
        kind = "FSDP" if self.use_fsdp else "DEEPSPEED" if self.use_deepspeed else (
            "MULTI_GPU" if self.world_size > 1 else "NO")
        cfg: dict[str, Any] = {
            "distributed_type": kind,
            "num_processes": self.world_size, "num_machines": machines, "mixed_precision": self.mixed_precision,
        }
        if self.use_fsdp:
            cfg["fsdp_config"] = {
                "fsdp_version": self.fsdp_version,
                "fsdp_sharding_strategy": self.fsdp_sharding_strategy,
                "fsdp_reshard_after_forward": self.fsdp_reshard_after_forward,
                "fsdp_offload_params": self.fsdp_offload_params,
                "fsdp_cpu_ram_efficient_loading": self.fsdp_cpu_ram_efficient_loading,
                "fsdp_use_orig_params": self.fsdp_use_orig_params,
                "fsdp_auto_wrap_policy": self.fsdp_auto_wrap_policy or "TRANSFORMER_BASED_WRAP",
            }
        if self.use_deepspeed:
            cfg["deepspeed_config"] = {
                "zero_stage": self.deepspeed_zero_stage or 2, "zero3_init_flag": self.deepspeed_zero3_init,
                "offload_param_device": self.deepspeed_offload_param_device or "none",
                "offload_optimizer_device": self.deepspeed_offload_optimizer_device or "none",
            }
        return cfg


def loads_4bit_base_once(four_bit: bool, fsdp_version: int | None, cpu_ram_efficient_loading: bool,
                         processes: int) -> bool:
    """Who loads a 4-bit base, the one rule the run (train/quantized_from_rank0.py) and the memory plan
    (plan/inputs.py) both ask: under FSDP1 with cpu_ram_efficient_loading on several ranks, rank 0 alone reads and
    quantizes it and the others receive its quantization state; everywhere else every rank loads its own copy."""
    return bool(four_bit and fsdp_version == 1 and cpu_ram_efficient_loading and processes > 1)


YAML_KEY_OF = {"FSDP_VERSION": "fsdp_version"}  # variables the launcher copies from an accelerate YAML key


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables (os.environ unless given); raises ConfigError naming any unreadable one."""
    env = os.environ if environ is None else environ
    problems: list[str] = []

    def flag(name: str) -> bool:
        raw = env.get(name, "")
        if raw.strip() == "":
            return False
        try:
            return bool(str_to_bool(raw.strip()))
        except ValueError:
            problems.append(f"{name}={raw!r}: not a boolean. Fix: true or false (accelerate also reads 1/0, yes/no, "
                            "on/off).")
            return False

    def number(name: str, default: int) -> int:
        raw = env.get(name, "")
        if raw.strip() == "":
            return default
        try:
            return int(raw)
        except ValueError:
            key = YAML_KEY_OF.get(name)
            problems.append(f"{name}={raw!r} ({key} in the accelerate config): not a whole number. Fix: {key}: 1 or 2."
                            if key else f"{name}={raw!r}: not a whole number. Fix: unset it or let the launcher set "
                            "it.")
            return default

    world_size = number("WORLD_SIZE", 1)
    parallelism = flag("ACCELERATE_USE_PARALLELISM_CONFIG")
    launch = LaunchEnv(
        rank=number("RANK", 0), local_rank=number("LOCAL_RANK", 0), world_size=world_size,
        local_world_size=number("LOCAL_WORLD_SIZE", 0) or None,
        accelerate_launched="ACCELERATE_MIXED_PRECISION" in env,
        use_cpu=flag("ACCELERATE_USE_CPU"), use_fsdp=flag("ACCELERATE_USE_FSDP"),
        use_deepspeed=flag("ACCELERATE_USE_DEEPSPEED"),
        mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no") or "no",
        fsdp_version=number("FSDP_VERSION", 1),
        fsdp_sharding_strategy=env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD") or "FULL_SHARD",
        fsdp_reshard_after_forward=env.get("FSDP_RESHARD_AFTER_FORWARD", "true") or "true",
        fsdp_offload_params=flag("FSDP_OFFLOAD_PARAMS"),
        fsdp_cpu_ram_efficient_loading=flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
        fsdp_sync_module_states=flag("FSDP_SYNC_MODULE_STATES"),
        fsdp_use_orig_params=flag("FSDP_USE_ORIG_PARAMS"),
        fsdp_state_dict_type=env.get("FSDP_STATE_DICT_TYPE", "").upper(),
        fsdp_activation_checkpointing=flag("FSDP_ACTIVATION_CHECKPOINTING"),
        fsdp_activation_checkpointing_offload=flag("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"),
        fsdp_auto_wrap_policy=env.get("FSDP_AUTO_WRAP_POLICY", ""),
        fsdp_backward_prefetch=env.get("FSDP_BACKWARD_PREFETCH", ""),
        fsdp_transformer_layer_cls_to_wrap=env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", ""),
        # accelerate's ParallelismConfig reads these sizes only when the launcher turned the parallelism config on.
        context_parallel_size=number("PARALLELISM_CONFIG_CP_SIZE", 1) if parallelism else 1,
        sequence_parallel_backend=(env.get("PARALLELISM_CONFIG_SP_BACKEND", "") or "deepspeed")
        if parallelism and number("PARALLELISM_CONFIG_SP_SIZE", 1) > 1 else "",
        deepspeed_zero_stage=env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", ""),
        deepspeed_zero3_init=flag("ACCELERATE_DEEPSPEED_ZERO3_INIT"),
        deepspeed_zero3_save_16bit_model=flag("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
        deepspeed_offload_param_device=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", ""),
        deepspeed_offload_optimizer_device=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", ""),
        gradient_accumulation_steps=env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", ""),
        gradient_clipping=env.get("ACCELERATE_GRADIENT_CLIPPING", ""),
        # huggingface_hub's rule, not accelerate's: 1/ON/YES/TRUE are offline, anything else online, never an error.
        hub_offline=env.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"),
        hf_token_set=bool(env.get("HF_TOKEN")),
        launcher_shutdown_timeout_s=number("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30) if "TORCHELASTIC_RUN_ID" in env
        else None,
        slurm_job_id=env.get("SLURM_JOB_ID", ""),
        slurm_restart_count=env.get("SLURM_RESTART_COUNT", "0") if env.get("SLURM_JOB_ID") else "",
    )
    if problems:
        from sft_recipe.errors import ConfigError

        raise ConfigError(problems)
    return launch


def may_use_deepspeed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher started a DeepSpeed run (an accelerate config with DeepSpeed, or sequence parallelism on
    DeepSpeed's Ulysses), read before the libraries load (sft_recipe/compat/unused_imports.py says why); True where a
    variable cannot be read (read_launch_env names it as train.py starts)."""
    from sft_recipe.errors import ConfigError

    try:
        launch = read_launch_env(environ)
    except ConfigError:
        return True
    return launch.use_deepspeed or launch.sequence_parallel_backend == "deepspeed"


def recipe_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the recipe keeps what it can rebuild (compat/models_import_structure.py): `$XDG_CACHE_HOME/sft_recipe`,
    else `~/.cache/sft_recipe`."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sft_recipe"


def gpu_memory_bytes(launch: LaunchEnv) -> int | None:
    """Total memory of this rank's GPU, or None where the run does not train on a CUDA GPU."""
    import torch

    if launch.use_cpu or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(launch.local_rank % torch.cuda.device_count()).total_memory
