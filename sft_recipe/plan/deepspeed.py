"""GPU memory of one rank and host RAM of one machine for a DeepSpeed ZeRO-2 / ZeRO-3 run, with and without CPU
offload, from the accelerate YAML the run is launched with (configs/deepspeed_config*.yaml).

What DeepSpeed 0.19 does, read from its code, for a config accelerate builds from the YAML's keys (zero_stage,
offload_optimizer_device, offload_param_device, zero3_init_flag, zero3_save_16bit_model; no bucket sizes, so
DeepSpeed's defaults hold: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold
1e5 elements):

- ZeRO-3 partitions every parameter, frozen or not, over the N ranks (P x b / N each); ZeRO-2 keeps the whole model
  on every GPU and partitions gradients and optimizer state only.
- the optimizer keeps an fp32 master copy of what trains plus Adam's two fp32 moments, partitioned: 12 bytes per
  trainable parameter / N, in host RAM with offload_optimizer_device: cpu (with the fp32 gradients it steps on).
- gradients: one contiguous reduce buffer of reduce_bucket_size elements in the trainable dtype
  (deepspeed/runtime/zero/stage3.py, `bucket.buffer = torch.empty(self.reduce_bucket_size, ...)`; ZeRO-2 the same
  in stage_1_and_2.py), plus the gradient partition (trainable x b_t / N).
- ZeRO-3 gathers each module's weights just before it runs: the module computing (at most the largest linear) plus
  the prefetch bucket, and keeps the parameters below the persistence threshold gathered on every rank.
- a bitsandbytes base under ZeRO-3: transformers 5.x skips zero.Init for quantized models and maps the whole
  quantized base onto each rank's GPU before DeepSpeed partitions it (the load phase, and what
  preflight.load_checks refuses when it exceeds the GPU).
- loading: with zero3_init_flag (ZeRO-3), each weight is partitioned as it is read (file pages only in host RAM);
  without it (ZeRO-2), every process loads the whole model on the CPU, and DeepSpeed moves it to the GPU whole.
"""

from __future__ import annotations

from sft_recipe.plan.components import (
    activation_rows,
    adapter_bytes,
    base_weight_bytes,
    count_trainable,
    fully_trained_bytes,
    offloaded_activation_bytes,
)
from sft_recipe.plan.inputs import Distribution, Workload
from sft_recipe.plan.result import GIB, Row
from sft_recipe.plan.shape import ModelShape

REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed 0.19 default reduce_bucket_size
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size
PERSISTENCE_THRESHOLD_ELEMENTS = 100_000  # stage3_param_persistence_threshold: smaller parameters stay gathered
MASTER_AND_ADAM_BYTES = 12  # fp32 master weight + Adam's exp_avg and exp_avg_sq, per trainable parameter
UPSTREAM_SAVE_ROW = "upstream's final save (rank 0)"


def persistent_params(shape: ModelShape, w: Workload) -> int:
    """Parameters ZeRO-3 keeps gathered on every rank: those under the persistence threshold (norms, biases, and
    LoRA matrices of r x width when that is small), counted per decoder layer."""
    small = sum(lin.in_features * w.lora_r for lin in shape.adapted_per_layer(_targets(w))
                if lin.in_features * w.lora_r < PERSISTENCE_THRESHOLD_ELEMENTS) if w.lora else 0
    small += sum(lin.out_features * w.lora_r for lin in shape.adapted_per_layer(_targets(w))
                 if lin.out_features * w.lora_r < PERSISTENCE_THRESHOLD_ELEMENTS) if w.lora else 0
    norms = 2 * shape.hidden_size  # a Llama-style layer's two norms
    return shape.num_layers * (small + norms)


def _targets(w: Workload):
    return w.lora_targets if isinstance(w.lora_targets, str) else list(w.lora_targets)


def estimate_deepspeed(shape: ModelShape, w: Workload, d: Distribution,
                       knobs: dict) -> tuple[list[Row], dict, list[Row], float]:
    """(GPU rows, phase -> bytes, host rows, host peak bytes), as gpu.estimate_gpu returns them."""
    from sft_recipe.plan.gpu import DEFAULT_ALLOCATOR_FLOOR_GIB

    N, stage = d.num_processes, d.zero_stage
    shardable, replicated, wformula = base_weight_bytes(shape, w)
    trainable, tbytes = count_trainable(shape, w)
    params_on_gpu = 0.0 if d.offload else 1.0
    optimizer_on_gpu = 0.0 if d.offload_optimizer else 1.0
    weights = params_on_gpu * (shardable / N if stage == 3 else shardable) + replicated
    trainable_split = N if stage == 3 else 1
    rows = [
        Row("base weights", weights, f"({wformula})" + (f" / N, N={N} (ZeRO-3)" if stage == 3 else " (ZeRO-2: whole)")
            + (" -- offloaded to CPU" if d.offload else "")),
        Row("LoRA/DoRA params" if w.lora else "trainable params", params_on_gpu * trainable * tbytes / trainable_split,
            f"{trainable:,} x {tbytes} B" + (f" / {N}" if stage == 3 else "")),
        Row("gradients", trainable * tbytes / N + REDUCE_BUCKET_ELEMENTS * tbytes,
            f"partition {trainable:,} x {tbytes} B / {N} + reduce bucket 5e8 x {tbytes} B"),
        Row("optimizer state", optimizer_on_gpu * trainable * MASTER_AND_ADAM_BYTES / N,
            f"{trainable:,} x 12 B (fp32 master + Adam) / {N}" + (" -- offloaded to CPU" if d.offload_optimizer
                                                                  else "")),
    ]
    full, fformula = fully_trained_bytes(shape, w)
    if full:  # ZeRO-3 partitions them with the rest; ZeRO-2 keeps the weights whole, the optimizer state split
        rows.append(Row("trained in full", params_on_gpu * full / N if stage == 3 else full,
                        fformula + (f" / {N}" if stage == 3 else " (ZeRO-2: whole)")))
    rows += activation_rows(shape, w, "cuda")
    if stage == 3:
        gathered = (shape.largest_linear_params + PREFETCH_BUCKET_ELEMENTS) * w.compute_bytes
        gathered += persistent_params(shape, w) * w.load_bytes
        if w.quant == "4bit":
            gathered += shape.largest_linear_params * w.compute_bytes  # the linear computing, dequantized
        rows.append(Row("ZeRO-3 gathered parameters", gathered,
                        "(largest linear + prefetch bucket 5e7) x a + persistent small params"
                        + (" + dequantized largest linear" if w.quant == "4bit" else "")))
    held = ("activations: checkpoints", "activations: saved")
    transient = sum(r.bytes for r in rows if r.name.startswith("activations") and r.name not in held)
    transient += rows[-1].bytes if stage == 3 else 0.0
    floor = knobs.get("allocator_floor_gib", DEFAULT_ALLOCATOR_FLOOR_GIB)
    rows.append(Row("allocator reserve", floor * GIB + knobs["allocator_reserve"] * transient,
                    f"{floor:g} GiB + {knobs['allocator_reserve']:.0%} of the transient activations + buffers"))
    rows.append(Row("framework overhead", knobs["cuda_context_gib"] * GIB,
                    "CUDA context, NCCL buffers, workspaces: nvidia-smi beyond torch's reserved (--cuda_context_gib)"))
    step = sum(r.bytes for r in rows)
    ctx = knobs["cuda_context_gib"] * GIB
    whole = shardable + replicated
    quantized_whole = w.quant is not None and stage == 3  # transformers maps it onto this GPU, no zero.Init
    if quantized_whole:
        load = ctx + whole
        wrap = load + shape.largest_linear_params * w.load_bytes / N  # partitioned in place, one weight at a time
    elif stage == 3 and d.zero3_init:
        load = ctx + params_on_gpu * shardable / N + replicated
        wrap = load + shape.largest_linear_params * w.load_bytes
    else:  # ZeRO-2, or ZeRO-3 without zero.Init: loaded on the CPU, moved whole, then partitioned
        load = ctx
        wrap = ctx + whole + trainable * tbytes + optimizer_on_gpu * trainable * MASTER_AND_ADAM_BYTES / N
    phases = {"load": load, "wrap": wrap, "train step": step}
    host_rows, host_peak = host_ram_rows(shape, w, d, knobs, trainable, tbytes)
    return rows, phases, host_rows, host_peak


def host_ram_rows(shape: ModelShape, w: Workload, d: Distribution, knobs: dict, trainable: int,
                  tbytes: int) -> tuple[list[Row], float]:
    """Host RAM of one machine: runtime + max(loading, offloaded partitions + final save).

    loading     = none with zero.Init (each weight partitioned as it is read: file pages only) or a quantized base
                  (mapped to the GPU); else one copy of the weights per process (n x P x b),
    offloaded   = parameters (offload_param_device: cpu): P x b x n/N; optimizer (offload_optimizer_device: cpu):
                  (12 + 4) B per trainable x n/N (master, moments, fp32 gradients),
    final save  = 2 x the adapter on rank 0 (gathered, then written); upstream's stage3_gather_16bit_weights_on_
                  model_save gathers every weight there in 16 bits: a note, not in the peak.
    """
    n, N = d.per_machine, d.num_processes
    shardable, replicated, _ = base_weight_bytes(shape, w)
    host = [Row("runtime", n * knobs["host_runtime_gib"] * GIB,
                f"{n} processes x {knobs['host_runtime_gib']:g} GiB (--host_runtime_gib)", "host")]
    if w.quant is not None and d.zero_stage == 3:
        load, lformula = 0.0, "none: the quantized base is mapped to each GPU as it is read (file pages only)"
    elif d.zero_stage == 3 and d.zero3_init:
        load, lformula = 0.0, "none: zero.Init partitions each weight as it is read (file pages only)"
    else:
        load = n * (shardable + replicated)
        lformula = f"{n} copies of the weights as loaded (every process loads the whole model)"
    host.append(Row("loading", load, lformula, "host"))
    offloaded = 0.0
    if d.offload:
        offloaded += shardable * n / N
        host.append(Row("offloaded parameters", shardable * n / N, "P x b x n/N (offload_param_device: cpu)", "host"))
    if d.offload_optimizer:
        opt = trainable * (MASTER_AND_ADAM_BYTES + 4) * n / N
        offloaded += opt
        host.append(Row("offloaded optimizer", opt, "16 B per trainable x n/N (offload_optimizer_device: cpu)",
                        "host"))
    activations, _ = offloaded_activation_bytes(shape, w)
    adapter, aformula = adapter_bytes(shape, w)
    host.append(Row("final save (rank 0)", 2 * adapter, f"2 x adapter ({aformula}): only what the adapter holds",
                    "host"))
    notes = [Row("page cache (reclaimable)", shape.checkpoint_bytes, "checkpoint files read through the page cache",
                 "note"),
             Row(UPSTREAM_SAVE_ROW, shape.total_params * 2,
                 "stage3_gather_16bit_weights_on_model_save gathers every weight to rank 0 in 16 bits (not in the "
                 "peak)", "note")]
    peak = host[0].bytes + max(load, offloaded + n * activations + 2 * adapter)
    return host + notes, peak
