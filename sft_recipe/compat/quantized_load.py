"""transformers 5.x: a bitsandbytes-quantized base is loaded whole onto every rank's GPU, before FSDP can shard it."""

from __future__ import annotations

import contextlib

import torch

# Where a quantized base is placed under FSDP: host RAM. Each weight is quantized on the rank's GPU as it is read
# and its packed bytes kept in host RAM (quantize_each_weight_on); only a CPU run quantizes on the CPU.
CPU_DEVICE_MAP = {"": "cpu"}


def quantized_base_device_map(model_args, launch) -> dict[str, str] | None:
    """The `device_map` the recipe passes to `from_pretrained` for a bitsandbytes-quantized base, or None to leave
    the placement to transformers.

    Bug (transformers 5.0-5.24 at least; 4.39-4.4x had the placement, PRs #29587/#32276/#33154): with a 4-bit or
    8-bit `BitsAndBytesConfig` and no `device_map`, `Bnb4BitHfQuantizer.update_device_map(None)` returns
    `{"": torch.cuda.current_device()}`; `caching_allocator_warmup` then reserves the whole quantized size on that
    GPU, and `core_model_loading` materializes and quantizes every weight there. `core_model_loading` has no FSDP
    branch, so under FSDP every rank holds the *whole* 4-bit base on its GPU before wrapping (Llama-2-70B: ~36 GiB,
    on the guide's 24 GB cards). Open upstream: transformers #43032, #43749.
    Fix here: under FSDP (1 or 2), place the base on the CPU. Nothing is warmed up on a GPU (the warm-up skips CPU
    maps), each weight is quantized as it is read (on the rank's GPU, see below; the same bytes on every rank, which
    train/quantized_identity.py checks) and kept in host RAM, and a single-device map sets no
    `hf_device_map`, so accelerate's "loaded on a different device" check does not apply; FSDP then moves each
    wrapped unit to the GPU as it shards it (FSDP1 `_move_module_to_device`, FSDP2 `fully_shard`), and
    `Params4bit.to` moves the quantization state with the packed bytes without quantizing again. Cost: one
    4-bit copy per rank in host RAM until it is sharded (under FSDP1 with cpu_ram_efficient_loading only rank 0
    loads it: sft_recipe/train/quantized_from_rank0.py); the quantizing itself stays on the rank's GPU, a weight at a
    time (quantize_each_weight_on), and only a CPU run quantizes on the CPU (time planned: `sft_recipe.plan`).
    One process and DDP keep the quantizer's map (this rank's GPU): there the whole model trains on each GPU anyway.
    When it can go: `tests/unit/test_quantized_placement.py::
    test_transformers_still_loads_a_quantized_base_onto_the_gpu` fails (the quantizer no longer maps a quantized base
    onto the GPU under FSDP).
    """
    if not (model_args.use_4bit_quantization or model_args.use_8bit_quantization):
        return None
    if not launch.use_fsdp:
        return None
    return dict(CPU_DEVICE_MAP)


@contextlib.contextmanager
def quantize_each_weight_on(device):
    """While a 4-bit base loads onto the CPU (`CPU_DEVICE_MAP`): quantize each weight on `device` (this rank's GPU)
    and bring the packed result back to the CPU, one weight at a time. `device` None: nothing changes (a CPU run;
    the tests run it on a device of real, recorded copies: tests/recording_device.py).

    Why: the CPU map above puts the quantization on bitsandbytes' CPU backend, ~35 M weights/s per thread (a 70B:
    ~33 min on one thread), where transformers 4.4x quantized each weight on the rank's GPU as it was read and moved
    it to the CPU. transformers 5.x quantizes a weight in `Bnb4bitQuantize.convert`
    (`Params4bit(value, ...).to(value.device)`: bitsandbytes quantizes on the device a weight is moved to); this
    wrapper hands `convert` the weight on `device` and moves what it returns to the CPU: `Params4bit.to` of a
    quantized weight moves the packed bytes and its quantization state without quantizing again. The GPU holds one
    weight, its packed copy and its constants at a time (the largest linear: 448 MiB in bf16 for Llama-2-70B);
    `torch.cuda.empty_cache` then gives the allocator's cached blocks back before FSDP wraps.
    When it can go: with quantized_base_device_map (transformers places a 4-bit base for FSDP itself).
    """
    if device is None:
        yield
        return
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize

    convert = Bnb4bitQuantize.convert

    def convert_on_device(self, input_dict, *args, **kwargs):
        there = {name: [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
                 for name, value in input_dict.items()}
        back = {}
        for name, param in convert(self, there, *args, **kwargs).items():
            moved = param.to("cpu")
            moved.module = getattr(param, "module", None)  # bitsandbytes reads the state back through its layer
            back[name] = moved
        return back

    Bnb4bitQuantize.convert = convert_on_device
    try:
        yield
    finally:
        Bnb4bitQuantize.convert = convert
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
