"""Who loads and quantizes what, on this rank: decided once, before anything loads (`decide_load`), and followed top
to bottom by `train.model.load_model`. The mechanisms live elsewhere: the CPU placement of a quantized base and the
quantizing on the GPU (compat/quantized_load.py), the 4-bit base loaded once (train/quantized_from_rank0.py); the
rules of who reads what are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sft_recipe.compat import quantized_base_device_map
from sft_recipe.config.args import ModelArguments
from sft_recipe.model.shape import read_config


@dataclass(frozen=True)
class LoadPlan:
    reads_weights: bool  # this rank reads the checkpoint (from_pretrained); else it builds the model on meta
    builds_4bit_layers: bool  # a rank that does not read a once-loaded 4-bit base: rank 0's Linear4bit layers
    shares_4bit_state: bool  # FSDP1 QLoRA loaded once: rank 0 sends each weight's quantization state (a collective)
    device_map: dict | None  # where from_pretrained puts a quantized base: the CPU under FSDP (None: transformers')
    quantize_on: torch.device | None  # each 4-bit weight quantized there as it is read (None: where it loads)
    sole_loader: bool  # no other rank on this machine reads the base: its CPUs are all this rank's
    training_device: torch.device  # where this rank's layers compute once wrapped

    @property
    def quantizes_on_cpu(self) -> bool:
        """bitsandbytes' CPU backend quantizes the base: torch's threads raised while it loads."""
        return self.device_map is not None and self.quantize_on is None


def decide_load(model_args: ModelArguments, launch, trust_remote_code: bool = False) -> LoadPlan:
    """This rank's part in loading the base: every rank of a run decides the same from the same flags and launch."""
    once = quantized_base_from_rank0(model_args, launch)
    reads = not (weights_arrive_from_rank0(model_args, launch, trust_remote_code) or (once and launch.rank != 0))
    quantized = model_args.use_4bit_quantization or model_args.use_8bit_quantization
    device_map = quantized_base_device_map(model_args, launch) if quantized and reads else None
    return LoadPlan(reads_weights=reads, builds_4bit_layers=once and not reads, shares_4bit_state=once,
                    device_map=device_map, quantize_on=weight_quantization_device(model_args, launch, device_map),
                    sole_loader=once, training_device=training_device(launch))


def quantized_base_from_rank0(model_args: ModelArguments, launch) -> bool:
    """Whether this run loads its 4-bit base once, on rank 0 (train/quantized_from_rank0.py)."""
    from sft_recipe.config.launch_env import loads_4bit_base_once

    return loads_4bit_base_once(bool(model_args.use_4bit_quantization), launch.fsdp_version,
                                launch.cpu_ram_efficient_loading, launch.world_size)


def weights_arrive_from_rank0(model_args: ModelArguments, launch, trust_remote_code: bool = False) -> bool:
    """Whether this rank should build the model without reading any weight: FSDP with cpu_ram_efficient_loading,
    on a rank other than its machine's rank 0, and a model that is not quantized.

    Why here: transformers 5.24's `from_pretrained` reads every weight on every rank even with the option on (it only
    skips re-initialising them), so an 8-GPU machine held 8 host copies of the model while loading. accelerate then
    keeps rank 0's weights and broadcasts them into the others' shards when it wraps the model (FSDP2:
    `fsdp2_load_full_state_dict`; FSDP1: `sync_module_states` with a meta `param_init_fn`), so the other ranks only
    need the architecture. Quantized models are excluded: their 4-bit layers carry quantization state that is not
    part of what accelerate broadcasts (FSDP1 4-bit bases come from rank 0 another way: quantized_from_rank0).
    """
    if not launch.cpu_ram_efficient_loading or launch.local_rank == 0:
        return False
    if model_args.use_4bit_quantization or model_args.use_8bit_quantization:
        return False
    config = read_config(model_args.model_name_or_path, trust_remote_code)
    return getattr(config, "quantization_config", None) is None  # pre-quantized checkpoints (GPTQ) load as usual


def weight_quantization_device(model_args: ModelArguments, launch, device_map) -> torch.device | None:
    """Where each 4-bit weight of a base that loads onto the CPU (`device_map`, compat.quantized_base_device_map) is
    quantized: this rank's GPU when it trains on one (seconds for a 70B, where the CPU takes minutes), None for
    bitsandbytes' CPU backend (a CPU run). 8-bit is left alone: it is refused under FSDP."""
    if device_map is None or not model_args.use_4bit_quantization:
        return None
    device = training_device(launch)
    return device if device.type == "cuda" else None


def training_device(launch) -> torch.device:
    """Where this rank's layers compute once wrapped: its GPU, or the CPU on a CPU run."""
    if launch.use_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
