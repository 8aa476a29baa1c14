"""One run's plan (plan_memory), and when it does not fit, the cheapest changes that make it fit (fit_ladder)."""

from __future__ import annotations

import math
from dataclasses import replace

from sft_recipe.errors import ConfigError
from sft_recipe.plan.components import LOSS_IMPLS
from sft_recipe.plan.cpu import estimate_cpu
from sft_recipe.plan.deepspeed import estimate_deepspeed
from sft_recipe.plan.gpu import (
    DEFAULT_ALLOCATOR_FLOOR_GIB,
    DEFAULT_ALLOCATOR_RESERVE,
    DEFAULT_CUDA_CONTEXT_GIB,
    DEFAULT_HOST_RUNTIME_GIB,
    DEFAULT_QUANTIZE_THREADS_PER_RANK,
    LOAD_PATHS,
    PAGEABLE_COPY_BYTES_PER_S,
    QUANTIZE_WEIGHTS_PER_S_PER_THREAD,
    estimate_gpu,
    gpu_quantization_seconds,
    quantization_seconds,
)
from sft_recipe.plan.inputs import Distribution, Workload, check_inputs, distribution, read_accelerate_config, workload
from sft_recipe.plan.result import LadderStep, MemoryPlan, fits_budget
from sft_recipe.plan.shape import ModelShape, model_shape

ADAPTER_DTYPE_BYTES = {None: 0, "float32": 4, "bfloat16": 2}


def plan_memory(model_args, data_args, training_args, accelerate_config: dict | str | None = None,
                num_processes: int | None = None, gpu_memory_gib: float = 80.0, device: str = "cuda", *,
                cuda_context_gib: float = DEFAULT_CUDA_CONTEXT_GIB,
                allocator_reserve: float = DEFAULT_ALLOCATOR_RESERVE,
                allocator_floor_gib: float = DEFAULT_ALLOCATOR_FLOOR_GIB,
                host_runtime_gib: float = DEFAULT_HOST_RUNTIME_GIB, dora: bool = False, ladder: bool = True,
                shape: ModelShape | None = None, load_path: str = "recipe",
                quantize_threads_per_rank: int = DEFAULT_QUANTIZE_THREADS_PER_RANK,
                loss_impl: str = "trl-chunked", adapter_dtype: str | None = None) -> MemoryPlan:
    """Plan one run's memory. `accelerate_config`: YAML path, dict (inside `accelerate launch`:
    LaunchEnv.accelerate_config()) or None (one process). `device`: "cuda" predicts GPU memory per rank; "cpu"
    predicts peak RSS per rank of a CPU run. `load_path`: "recipe" (a quantized base loads on the CPU under FSDP)
    or "upstream" (transformers 5.x's default: on each rank's GPU, as upstream's train.py loads it).
    `loss_impl` (components.LOSS_IMPLS) and `adapter_dtype` ("float32", "bfloat16"; None: as this recipe keeps LoRA
    weights) plan what another stack computed, to set the plan beside figures measured on it."""
    if load_path not in LOAD_PATHS:
        raise ValueError(f"load_path {load_path!r}: one of {LOAD_PATHS}")
    if loss_impl not in LOSS_IMPLS:
        raise ConfigError([f"--loss_impl {loss_impl}: one of {', '.join(LOSS_IMPLS)}."])
    if adapter_dtype not in ADAPTER_DTYPE_BYTES:
        raise ConfigError([f"--adapter_dtype {adapter_dtype}: one of float32, bfloat16 (or leave it out)."])
    cfg = read_accelerate_config(accelerate_config)
    d = distribution(cfg, num_processes, training_args)
    w = replace(workload(model_args, data_args, training_args, device, dora), loss_impl=loss_impl,
                adapter_bytes=ADAPTER_DTYPE_BYTES[adapter_dtype])
    check_inputs(gpu_memory_gib, device, d, w)
    if d.kind == "deepspeed" and w.quant is None:
        # DeepSpeed gives every parameter its config's dtype, whatever --torch_dtype loaded: zero.Init as each is
        # created (partition_parameters.py, Init._set_dtype and the tensor-creation wrappers), the engine's cast
        # otherwise (engine.py, _configure_distributed_model). bf16/fp16 follow the Trainer's flags.
        mixed = bool(getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False))
        w = replace(w, load_bytes=2 if mixed else 4)
    if shape is None:
        shape = model_shape(model_args.model_name_or_path, bool(getattr(training_args, "trust_remote_code", False)),
                            w.extra_vocab)
    knobs = {"cuda_context_gib": cuda_context_gib, "allocator_reserve": allocator_reserve,
             "allocator_floor_gib": allocator_floor_gib,
             "host_runtime_gib": host_runtime_gib, "load_path": load_path,
             "quantize_threads_per_rank": quantize_threads_per_rank}
    plan = _plan(shape, w, d, float(gpu_memory_gib), device, knobs)
    if ladder and not plan.fits:
        plan.ladder = fit_ladder(shape, w, d, float(gpu_memory_gib), device, knobs)
    return plan


def _plan(shape: ModelShape, w: Workload, d: Distribution, budget: float, device: str, knobs: dict) -> MemoryPlan:
    """One plan, without the ladder: the device's estimate, each rank's peak and the notes."""
    notes = []
    flags = [f"B={w.micro_batch} x accumulation {w.grad_accum}", f"seq {w.seq_len}",
             "checkpointing" if w.gradient_checkpointing else "no checkpointing",
             "activation offloading" if w.activation_offloading else "",
             (f"{'DoRA' if w.dora else 'LoRA'} r={w.lora_r}" if w.lora else "full fine-tuning"),
             {"4bit": "4-bit NF4" + (" + double quant" if w.double_quant else ""), "8bit": "8-bit"}.get(w.quant, "") or
             f"weights {w.load_bytes} B", f"activations {w.compute_bytes} B", w.optimizer]
    setup = f"{d.describe()}; " + ", ".join(f for f in flags if f)
    if device == "cuda":
        estimate = estimate_deepspeed if d.kind == "deepspeed" else estimate_gpu
        rows, phases, host_rows, host_peak = estimate(shape, w, d, knobs)
        per_rank = [max(phases.values())] * d.num_processes
        if not w.flash_attention and w.packing:
            notes.append("SDPA with packed rows builds a T x T block mask; --use_flash_attn True avoids it.")
    else:
        rows, phases = estimate_cpu(shape, w, d, 0)
        per_rank = [max(phases.values())]
        for rank in range(1, d.num_processes):
            per_rank.append(max(estimate_cpu(shape, w, d, rank)[1].values()))
        host_rows, host_peak = [], 0.0
        notes.append("CPU mode: constants measured on this stack with glibc malloc (see bench/memory_plan.py).")
    quantize_s = cpu_quantize_s = 0.0
    if w.quant and d.kind == "fsdp" and knobs.get("load_path") != "upstream":
        threads = knobs.get("quantize_threads_per_rank", DEFAULT_QUANTIZE_THREADS_PER_RANK)
        once = d.loads_quantized_base_once(w.quant)
        threads *= d.per_machine if once else 1  # the only rank quantizing gets its machine's CPUs
        cpu_quantize_s = quantization_seconds(shape, w, threads)
        who = "rank 0 alone quantizes the base" if once else "every rank quantizes the base"
        sent = " (FSDP1 sends it to the others as it wraps)" if once else ""
        cpu = (f"~{cpu_quantize_s / 60:.1f} min at {threads} threads{'' if once else ' per rank'} "
               f"({quantization_seconds(shape, w, 1) / 60:.0f} min on one; "
               f"{QUANTIZE_WEIGHTS_PER_S_PER_THREAD / 1e6:.0f} M weights/s per thread measured)")
        if device == "cuda" and w.quant == "4bit":  # train.py quantizes on the rank's GPU (weight_quantization_device)
            quantize_s = gpu_quantization_seconds(shape, w)
            notes.append(f"load: {who} on its GPU, a weight at a time{sent}: {shape.quantizable_params:,} weights, "
                         f"~{quantize_s:.0f} s of host<->GPU copies at {PAGEABLE_COPY_BYTES_PER_S / 1e9:g} GB/s "
                         f"(not measured here); on the CPU it would take {cpu}")
        else:
            quantize_s = cpu_quantize_s
            notes.append(f"load: {who} on the CPU{sent}: {shape.quantizable_params:,} weights, {cpu}")
    notes.append(f"model: {shape.source}: {shape.total_params:,} params, {shape.num_layers} layers")
    return MemoryPlan(device=device, model=shape.source, setup=setup, budget_gib=budget, rows=rows, phases=phases,
                      host_rows=host_rows, host_peak_bytes=host_peak, notes=notes, per_rank_bytes=per_rank,
                      cpu_quantization_seconds=cpu_quantize_s,
                      quantization_seconds=quantize_s)


def _peak(shape, w, d, budget, device, knobs) -> float:
    return _plan(shape, w, d, budget, device, knobs).peak_gib


def fit_ladder(shape: ModelShape, w: Workload, d: Distribution, budget: float, device: str,
               knobs: dict) -> list[LadderStep]:
    """The cheapest changes, applied one after the other, until the run fits:
    1. gradient checkpointing; 2. FULL_SHARD (FSDP over the same GPUs); 3. a smaller micro-batch with more
    accumulation (same global batch); 4. 4-bit weights (QLoRA, with LoRA); 5. CPU offload (GPU only); 6. more GPUs.
    A step is listed only when it lowers the peak."""
    steps: list[LadderStep] = []
    current = _peak(shape, w, d, budget, device, knobs)

    def consider(change: str, how: str, w2: Workload, d2: Distribution) -> bool:
        nonlocal w, d, current
        peak = _peak(shape, w2, d2, budget, device, knobs)
        if peak >= current - 1e-9:
            return False
        w, d, current = w2, d2, peak
        steps.append(LadderStep(change, how, round(peak, 3), fits_budget(peak, budget, device)))
        return fits_budget(peak, budget, device)

    if not w.gradient_checkpointing and consider(
            "gradient checkpointing", "--gradient_checkpointing True", replace(w, gradient_checkpointing=True), d):
        return steps
    if d.kind == "deepspeed" and d.zero_stage == 2 and d.num_processes > 1:
        if consider("ZeRO-3", "--zero_stage 3 (as configs/deepspeed_config.yaml)", w,
                    replace(d, zero_stage=3, zero3_init=True)):
            return steps
    elif d.num_processes > 1 and not (d.kind == "fsdp" and d.sharding == "FULL_SHARD"):
        d2 = replace(d, kind="fsdp", sharding="FULL_SHARD")
        if consider("FULL_SHARD", "--config_file configs/fsdp_config.yaml (fsdp_sharding_strategy: FULL_SHARD)",
                    w, d2):
            return steps
    if w.micro_batch > 1:
        global_batch = w.micro_batch * w.grad_accum
        for b in [x for x in range(w.micro_batch - 1, 0, -1) if w.micro_batch % x == 0]:
            w2 = replace(w, micro_batch=b, grad_accum=global_batch // b)
            if fits_budget(_peak(shape, w2, d, budget, device, knobs), budget, device) or b == 1:
                if consider(f"micro-batch {b}, accumulation {global_batch // b} (same global batch)",
                            f"--per_device_train_batch_size {b} --gradient_accumulation_steps {global_batch // b}",
                            w2, d):
                    return steps
                break
    if w.lora and w.quant is None:
        w2 = replace(w, quant="4bit", double_quant=True,
                     load_bytes=2 if d.kind in ("fsdp", "deepspeed") else w.load_bytes,
                     compute_bytes=2 if device == "cuda" else w.compute_bytes)
        how = ("--use_4bit_quantization True --use_nested_quant True --bnb_4bit_quant_type nf4 "
               "--bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_storage_dtype bfloat16 --bf16 True")
        if consider("4-bit base weights (QLoRA)", how, w2, d):
            return steps
    if device == "cuda" and d.kind == "fsdp" and not d.offload:
        if consider("CPU offload", "fsdp_offload_params: true (as configs/fsdp_config_qlora.yaml)", w,
                    replace(d, offload=True)):
            return steps
    if device == "cuda" and d.kind == "deepspeed" and not (d.offload and d.offload_optimizer):
        if consider("CPU offload", "--offload_optimizer_device cpu" + (" --offload_param_device cpu"
                                                                       if d.zero_stage == 3 else ""), w,
                    replace(d, offload=d.zero_stage == 3, offload_optimizer=True)):
            return steps
    per_machine = 8 if device == "cuda" else d.per_machine
    n = d.num_processes
    for _ in range(12):
        n = n * 2 if n < per_machine else (n // per_machine + 1) * per_machine
        d2 = replace(d, kind=d.kind if d.kind == "deepspeed" else "fsdp", num_processes=n,
                     num_machines=max(1, math.ceil(n / per_machine)),
                     sharding=d.sharding if d.kind == "fsdp" else "FULL_SHARD")
        if fits_budget(_peak(shape, w, d2, budget, device, knobs), budget, device):
            consider(f"{n} GPUs" if device == "cuda" else f"{n} processes",
                     f"--num_processes {n} (global batch grows {n / d.num_processes:g}x: lower "
                     "--gradient_accumulation_steps to keep it)", w, d2)
            break
    return steps
