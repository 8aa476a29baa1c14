"""What the run does, from what training reads: the accelerate YAML (or the launcher's environment) says how it is
spread (Distribution), the train.py flags say what one rank computes (Workload)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sft_recipe.errors import ConfigError

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class Distribution:
    """How the run is spread, from the accelerate YAML (or the launcher's environment) and --num_processes."""

    kind: str  # "single", "ddp", "fsdp" or "deepspeed"
    num_processes: int
    num_machines: int = 1
    fsdp_version: int = 1
    sharding: str = "FULL_SHARD"
    offload: bool = False
    cpu_ram_efficient_loading: bool = False
    mixed_precision: str = "no"  # accelerate's mixed_precision: no|bf16|fp16
    zero_stage: int = 0  # DeepSpeed: 2 or 3 (offload = offload_param_device cpu)
    offload_optimizer: bool = False  # DeepSpeed offload_optimizer_device: cpu
    zero3_init: bool = False  # DeepSpeed zero3_init_flag
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"  # fsdp_auto_wrap_policy: a unit per decoder layer, by size, or none
    min_num_params: int = 100_000_000  # fsdp_min_num_params of SIZE_BASED_WRAP (accelerate's launcher default)
    use_orig_params: bool = False  # FSDP1's fsdp_use_orig_params (accelerate's default false; FSDP2 has no flat params)

    def loads_quantized_base_once(self, quant: str | None) -> bool:
        """FSDP1 with cpu_ram_efficient_loading on several ranks: rank 0 alone loads a 4-bit base, the others receive
        its quantization state (config.launch_env.loads_4bit_base_once, the rule the run asks too)."""
        from sft_recipe.config.launch_env import loads_4bit_base_once

        return loads_4bit_base_once(quant == "4bit", self.fsdp_version if self.kind == "fsdp" else None,
                                    self.cpu_ram_efficient_loading, self.num_processes)

    @property
    def per_machine(self) -> int:
        return max(1, self.num_processes // max(1, self.num_machines))

    @property
    def shard_group(self) -> int:
        """G: ranks each parameter is split over."""
        if self.kind == "deepspeed":
            return self.num_processes if self.zero_stage == 3 else 1
        if self.kind != "fsdp" or self.sharding == "NO_SHARD":
            return 1
        if self.sharding.startswith("HYBRID"):
            return self.per_machine
        return self.num_processes

    @property
    def reshards_after_forward(self) -> bool:
        return self.sharding in ("FULL_SHARD", "HYBRID_SHARD")

    def describe(self) -> str:
        if self.kind == "single":
            return "1 process"
        if self.kind == "ddp":
            return f"DDP, {self.num_processes} processes"
        off = ", CPU offload" if self.offload else ""
        if self.kind == "deepspeed":
            off = ", ".join(x for x in ("parameters" if self.offload else "",
                                        "optimizer" if self.offload_optimizer else "") if x)
            return (f"DeepSpeed ZeRO-{self.zero_stage}, {self.num_processes} processes"
                    + (f", CPU offload of {off}" if off else ""))
        return f"FSDP{self.fsdp_version} {self.sharding}, {self.num_processes} processes{off}"


@dataclass(frozen=True)
class Workload:
    """What one rank computes, from the train.py flags."""

    micro_batch: int
    grad_accum: int
    seq_len: int
    packing: bool
    gradient_checkpointing: bool
    lora: bool
    lora_r: int
    lora_targets: str | tuple[str, ...]
    lora_dropout: float
    dora: bool
    quant: str | None  # None, "4bit", "8bit"
    double_quant: bool
    load_bytes: int  # b: bytes per base weight as loaded
    compute_bytes: int  # a
    optimizer: str
    flash_attention: bool
    extra_vocab: int
    activation_offloading: bool = False  # TRL's SFTConfig option: saved activations go to pinned host RAM
    reentrant_checkpointing: bool = False  # --use_reentrant: the recomputation runs under the offloading hooks too
    # How another stack ran what train.py runs, for a like-for-like comparison (bench/plan_vs_published.py):
    loss_impl: str = "trl-chunked"  # components.LOSS_IMPLS; train.py always computes TRL's chunked loss
    adapter_bytes: int = 0  # bytes per LoRA weight (and its gradient and Adam moments); 0: as this recipe keeps them
    modules_to_save: tuple[str, ...] = ()  # --lora_modules_to_save: trained in full beside the adapter
    train_new_tokens: bool = False  # --train_new_tokens: the added tokens' rows of the embedding and head trained

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def read_accelerate_config(accelerate_config: dict | str | os.PathLike | None) -> dict:
    """The accelerate YAML as a dict: a path, a dict (train.py passes `LaunchEnv.accelerate_config()`, what the
    launcher exported), or None (one process)."""
    if accelerate_config is None:
        return {"distributed_type": "NO", "num_processes": 1}
    if isinstance(accelerate_config, dict):
        return accelerate_config
    path = Path(accelerate_config)
    if not path.is_file():
        raise ConfigError([f"--config_file {accelerate_config}: no such file. Fix: pass an accelerate YAML, e.g. "
                           "configs/fsdp_config.yaml."])
    import yaml

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"--config_file {accelerate_config}: not valid YAML ({e})."]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"--config_file {accelerate_config}: must be a mapping (accelerate's YAML), "
                           f"not {type(raw).__name__}."])
    from sft_recipe.config.launcher_yaml import yaml_problems

    problems = yaml_problems(raw, path)  # a misspelt key would plan the default the user meant to change
    if problems:
        raise ConfigError(problems)
    return raw


def distribution(cfg: dict, num_processes: int | None = None, training_args=None) -> Distribution:
    kind_raw = str(cfg.get("distributed_type", "NO")).upper()
    kinds = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
    if kind_raw not in kinds:
        raise ConfigError([f"accelerate config: distributed_type {kind_raw} is not planned here (NO, MULTI_GPU, "
                           "MULTI_CPU, FSDP, DEEPSPEED are). Fix: use one of configs/*.yaml."])
    n = int(num_processes or cfg.get("num_processes") or 1)
    if n < 1:
        raise ConfigError([f"--num_processes {n}: must be at least 1."])
    machines = int(cfg.get("num_machines") or 1)
    kind = kinds[kind_raw] if n > 1 or kind_raw in ("FSDP", "DEEPSPEED") else "single"
    mp = str(cfg.get("mixed_precision", "no")).lower()
    if training_args is not None and getattr(training_args, "bf16", False):
        mp = "bf16"
    elif training_args is not None and getattr(training_args, "fp16", False):
        mp = "fp16"
    if kind == "deepspeed":
        return deepspeed_distribution(cfg, n, machines, mp)
    fc = cfg.get("fsdp_config") or {}
    version = int(fc.get("fsdp_version", 1))
    sharding = "FULL_SHARD"
    if version == 2:
        raf = fc.get("fsdp_reshard_after_forward", True)
        sharding = "FULL_SHARD" if str(raf).lower() in ("true", "1", "full_shard") else "SHARD_GRAD_OP"
    else:
        raw = fc.get("fsdp_sharding_strategy", fc.get("fsdp_reshard_after_forward", "FULL_SHARD"))
        raw = str(raw).upper()
        if raw.isdigit() and 1 <= int(raw) <= len(SHARDING_STRATEGIES):
            raw = SHARDING_STRATEGIES[int(raw) - 1]
        if raw in ("TRUE",):
            raw = "FULL_SHARD"
        if raw not in SHARDING_STRATEGIES:
            raise ConfigError([f"accelerate config: fsdp_sharding_strategy {raw} is unknown. Fix: one of "
                               f"{', '.join(SHARDING_STRATEGIES)}."])
        sharding = raw
    return Distribution(
        kind=kind, num_processes=n, num_machines=machines, fsdp_version=version, sharding=sharding,
        offload=kind == "fsdp" and bool(fc.get("fsdp_offload_params", False)),
        cpu_ram_efficient_loading=kind == "fsdp" and bool(fc.get("fsdp_cpu_ram_efficient_loading", False)),
        mixed_precision=mp,
        wrap_policy=str(fc.get("fsdp_auto_wrap_policy") or "TRANSFORMER_BASED_WRAP").upper(),
        min_num_params=int(fc.get("fsdp_min_num_params") or 100_000_000),
        use_orig_params=version == 1 and str(fc.get("fsdp_use_orig_params", False)).lower() in ("true", "1"),
    )


def deepspeed_distribution(cfg: dict, n: int, machines: int, mixed_precision: str) -> Distribution:
    """The accelerate YAML's deepspeed_config keys (accelerate builds DeepSpeed's config from them); a
    deepspeed_config_file is read for the same keys under zero_optimization."""
    dc = cfg.get("deepspeed_config") or {}
    stage, off_param, off_opt, init = (dc.get("zero_stage"), dc.get("offload_param_device"),
                                       dc.get("offload_optimizer_device"), dc.get("zero3_init_flag"))
    if dc.get("deepspeed_config_file"):
        import json

        try:
            zo = json.loads(Path(dc["deepspeed_config_file"]).read_text()).get("zero_optimization") or {}
        except (OSError, ValueError) as e:
            raise ConfigError([f"deepspeed_config_file {dc['deepspeed_config_file']}: cannot be read ({e})."]) from None
        stage = zo.get("stage", stage)
        off_param = (zo.get("offload_param") or {}).get("device", off_param)
        off_opt = (zo.get("offload_optimizer") or {}).get("device", off_opt)
    try:
        stage = int(stage if stage is not None else 2)
    except (TypeError, ValueError):
        stage = -1
    if stage not in (2, 3):
        raise ConfigError([f"deepspeed_config: zero_stage {dc.get('zero_stage')!r} is not planned here (2 and 3 are; "
                           "the recipe ships ZeRO-3: configs/deepspeed_config.yaml)."])
    return Distribution(kind="deepspeed", num_processes=n, num_machines=machines, zero_stage=stage,
                        offload=str(off_param).lower() == "cpu" and stage == 3,
                        offload_optimizer=str(off_opt).lower() == "cpu",
                        zero3_init=stage == 3 and str(init).lower() in ("true", "1"), mixed_precision=mixed_precision)


def workload(model_args, data_args, training_args, device: str, dora: bool = False) -> Workload:
    from sft_recipe.config.dtypes import model_dtype
    from sft_recipe.data.chat_templates import CHAT_FORMATS
    from sft_recipe.model.shape import DTYPES
    from sft_recipe.model.structure import parse_target_modules

    quant = "4bit" if model_args.use_4bit_quantization else ("8bit" if model_args.use_8bit_quantization else None)
    load_bytes = model_dtype(model_args).itemsize
    bf16 = bool(getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False))
    compute = 2 if (bf16 or load_bytes == 2) else 4
    if quant == "4bit" and DTYPES[model_args.bnb_4bit_compute_dtype].itemsize == 2:
        compute = 2
    fmt = CHAT_FORMATS.get(model_args.chat_template_format)
    extra_vocab = (len(fmt.extra_special_tokens) + 1) if fmt else 0  # + pad
    targets = parse_target_modules(model_args.lora_target_modules)
    seq = training_args.max_length or 1024
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name mirrors it).
    checkpointing = getattr(training_args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = training_args.gradient_checkpointing
    return Workload(
        micro_batch=training_args.per_device_train_batch_size,
        grad_accum=training_args.gradient_accumulation_steps,
        seq_len=seq,
        packing=bool(training_args.packing),
        gradient_checkpointing=bool(checkpointing),
        lora=bool(model_args.use_peft_lora),
        lora_r=model_args.lora_r,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        lora_dropout=model_args.lora_dropout,
        dora=bool(dora or getattr(model_args, "use_dora", False)),
        quant=quant,
        double_quant=bool(model_args.use_nested_quant),
        load_bytes=load_bytes,
        compute_bytes=compute,
        optimizer=str(getattr(training_args.optim, "value", training_args.optim)),
        flash_attention=bool(model_args.use_flash_attn) and device == "cuda",
        extra_vocab=extra_vocab,
        activation_offloading=bool(getattr(training_args, "activation_offloading", False)),
        reentrant_checkpointing=bool(checkpointing) and bool(getattr(model_args, "use_reentrant", False)),
        modules_to_save=tuple(getattr(model_args, "modules_to_save", ())),
        train_new_tokens=bool(getattr(model_args, "train_new_tokens", False)),
    )


def check_inputs(gpu_memory_gib, device: str, d: Distribution, w: Workload) -> None:
    """Every problem with the budget, the device and the batch shape, listed at once (ConfigError)."""
    problems = []
    if device not in ("cuda", "cpu"):
        problems.append(f"device {device!r}: must be 'cuda' (GPU memory) or 'cpu' (peak RSS of a CPU run).")
    try:
        budget = float(gpu_memory_gib)
        if not budget > 0:
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"--gpu_memory_gib {gpu_memory_gib!r}: must be a positive number of GiB (e.g. 80 for an "
                        "80 GB GPU, 24 for a 24 GB one).")
    if w.micro_batch < 1 or w.grad_accum < 1 or w.seq_len < 1:
        problems.append(f"--per_device_train_batch_size {w.micro_batch} / --gradient_accumulation_steps "
                        f"{w.grad_accum} / --max_length {w.seq_len}: each must be at least 1.")
    if device == "cpu" and d.offload:
        problems.append("fsdp_offload_params: true on a CPU run: torch pins the offloaded shards in page-locked "
                        "memory, which needs a GPU (\"Cannot access accelerator device\"). Fix: plan it with "
                        "--device cuda, or drop fsdp_offload_params for the CPU run.")
    if device == "cpu" and w.activation_offloading:
        problems.append("--activation_offloading True on a CPU run: TRL 1.16 offloads activations from an accelerator "
                        "to host RAM and fails without one. Fix: plan it with --device cuda, or drop the flag.")
    if device == "cpu" and d.kind == "deepspeed":
        problems.append("DeepSpeed on a CPU run: the CPU plan is measured for one process, DDP and FSDP. Fix: plan "
                        "the GPU run with --device cuda.")
    if w.activation_offloading and d.kind == "deepspeed":
        problems.append("--activation_offloading True under DeepSpeed: train.py refuses it (TRL 1.16 would offload "
                        "the gathered ZeRO-3 weights as activations). Fix: FSDP2 (configs/fsdp2_config.yaml), or "
                        "--activation_offloading False.")
    elif w.activation_offloading and d.kind == "fsdp" and d.fsdp_version == 1:
        problems.append("--activation_offloading True under FSDP1: train.py refuses it (TRL 1.16 would offload every "
                        "gathered layer's weights as activations). Fix: FSDP2 (configs/fsdp2_config.yaml) or one "
                        "process, or --activation_offloading False.")
    if problems:
        raise ConfigError(problems)


def parse_train_flags(train_argv: list[str], device: str):
    """train.py's own parser. Planning a GPU run on a machine without one: the CPU switch keeps transformers from
    refusing bf16, and bf16 defaults to on as TRL does on a bf16 GPU unless the flags say otherwise."""
    from sft_recipe.config.args import build_parser, known_option_names, parse_args, read_recipe_yaml
    from sft_recipe.config.command_line import explicitly_set
    from sft_recipe.config.launch_env import read_launch_env

    argv = list(train_argv)
    if not any(t == "--output_dir" or t.startswith("--output_dir=") for t in argv):
        argv += ["--output_dir", os.path.join(os.getcwd(), "plan-output")]  # never written
    launch = read_launch_env()
    model_args, data_args, recipe_args, training_args = parse_args(
        argv, launch.for_planning_a_gpu_run() if device == "cuda" else launch)
    if device == "cuda":
        yaml_values = {}
        config = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--config"), None)
        if config:
            yaml_values = read_recipe_yaml(config, known_option_names(build_parser()))[0]
        if not explicitly_set(argv, yaml_values, "bf16"):
            training_args.bf16 = True
    return model_args, data_args, recipe_args, training_args
