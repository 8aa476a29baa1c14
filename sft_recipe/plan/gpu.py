"""GPU memory of one rank and host RAM of one machine for a CUDA run, from the components (components.py)."""

from __future__ import annotations

from sft_recipe.plan.components import (
    activation_rows,
    adapter_bytes,
    base_weight_bytes,
    count_trainable,
    fully_trained_bytes,
    gather_bytes,
    mixed_unit_gradient_bytes,
    offloaded_activation_bytes,
    optimizer_bytes,
)
from sft_recipe.plan.inputs import Distribution, Workload
from sft_recipe.plan.result import GIB, Row
from sft_recipe.plan.shape import ModelShape

# ---- GPU overheads beyond the tensors, set against the published figures (tests/published_gpu_memory.csv;
# bench/plan_vs_published.py prints the fit; tests/unit/test_published_figures.py holds the plan to it) ----
# What nvidia-smi shows beyond torch's reserved memory: the CUDA context (~0.5 GiB with lazy module loading), NCCL's
# own buffers (cudaMalloc'd outside torch's allocator, per peer and channel) and library workspaces. Set by the
# guide's three nvidia-smi figures, the only ones of that kind in the table (1.5 leaves the offload run 12% below;
# 2.5 fits the table as well: the smaller is kept).
DEFAULT_CUDA_CONTEXT_GIB = 2.0
# What torch's caching allocator holds beyond what it hands out (max_memory_reserved - max_memory_allocated): a
# floor plus a fraction of the memory that comes and goes in many sizes (the recomputed layer, the backward working
# set, the loss, all-gather buffers), whose freed blocks stay cached in sizes the next request may not fit.
# Answer.AI's paired figures bound the floor: reserved - allocated = 2.0 and 1.1 GiB for Llama-2-7B LoRA at B=1
# (seq 512, 2048); floor and fraction are the pair that puts the most of the table's 24 figures within -10%/+15%
# (22; the search: bench/plan_vs_published.py --fit). Fitted, so checked out of sample too: with each source held
# out of the search, none of its figures lies more than 10% above its plan (--cross_validate: worst 0.92). Under
# pressure the allocator frees cached blocks and retries before it fails, which is why a plan whose reserve does not
# fit is "tight", not "does not fit" (result.MemoryPlan.verdict).
DEFAULT_ALLOCATOR_FLOOR_GIB = 1.1
DEFAULT_ALLOCATOR_RESERVE = 0.40
DEFAULT_HOST_RUNTIME_GIB = 3.0   # host RSS of one CUDA PyTorch process (libraries, kernels, Python)
# bitsandbytes 0.50.2 quantizing bf16 weights to NF4 + double quant on the CPU: 33-40 M weights/s per thread,
# measured on this project's 2-core Zen3 EPYC (4096 x 4096 weights; 2 threads: 1.8x). Scales with threads.
QUANTIZE_WEIGHTS_PER_S_PER_THREAD = 35e6
DEFAULT_QUANTIZE_THREADS_PER_RANK = 8  # a GPU machine's CPUs shared by its ranks (what a CPU quantization gets)
# Where the rank has a GPU, the recipe quantizes each 4-bit weight there as it is read (compat.quantize_each_weight_on):
# the weight crosses to the GPU from pageable host memory (the mmapped checkpoint), bitsandbytes' kernel quantizes it
# at memory bandwidth (TB/s: negligible), and the packed bytes come back. The copies bound it: pageable host<->device
# copies run at ~6-12 GB/s on PCIe 4/5 hosts (CUDA's bandwidthTest, pageable). NOT measured here (no GPU lent yet):
# bench/gpu_check.sh's qlora vs qlora-cpuquant rows measure the load seconds of both paths.
PAGEABLE_COPY_BYTES_PER_S = 8e9
LOAD_PATHS = ("recipe", "upstream")

UPSTREAM_SAVE_ROW = "upstream's final save (rank 0)"


def estimate_gpu(shape: ModelShape, w: Workload, d: Distribution,
                 knobs: dict) -> tuple[list[Row], dict, list[Row], float]:
    """GPU memory of one rank: (rows, phase -> bytes), then host RAM of one machine (host_ram_rows).

    train step = base weights/G (0 when offloaded) + replicated 4-bit constants + (trainable + gradients +
                 optimizer)/G (0 when offloaded) + activations + all-gather buffers
                 + allocator_reserve x (activations + buffers) + cuda_context_gib
    load, wrap = see load_phases
    """
    G = d.shard_group
    shardable, replicated, wformula = base_weight_bytes(shape, w)
    trainable, tbytes = count_trainable(shape, w)
    opt, oformula = optimizer_bytes(shape, w, trainable, tbytes)
    on_gpu = 0.0 if d.offload else 1.0
    sharded = G if d.kind == "fsdp" else 1
    rows = [
        Row("base weights", on_gpu * shardable / sharded + replicated,
            f"({wformula})" + (f" / G, G={G}" if sharded > 1 else "") + (" -- offloaded to CPU" if d.offload else "")),
        Row("LoRA/DoRA params" if w.lora else "trainable params", on_gpu * trainable * tbytes / sharded,
            f"{trainable:,} x {tbytes} B" + (f" / {G}" if sharded > 1 else "")),
        Row("gradients", on_gpu * trainable * tbytes / sharded, "same as trainable params"),
        Row("optimizer state", on_gpu * opt / sharded, oformula + (f" / {G}" if sharded > 1 else "")),
    ]
    full, fformula = fully_trained_bytes(shape, w)
    if full:
        rows.append(Row("trained in full", on_gpu * full / sharded, fformula + (f" / {G}" if sharded > 1 else "")))
    unsharded_grad, _, mformula = mixed_unit_gradient_bytes(shape, w, d)
    if unsharded_grad:
        rows.append(Row("FSDP1 gradient of a mixed unit", unsharded_grad, mformula))
    rows += activation_rows(shape, w, "cuda")
    gather, gformula = gather_bytes(shape, w, d)
    if d.offload and d.kind == "fsdp":  # the shard is copied host->device before its all-gather
        gather += shape.layer_params * (2 if d.mixed_precision != "no" else w.load_bytes) / G
        gformula += " + host->device copy of a shard"
    rows.append(Row("FSDP all-gather buffers", gather, gformula))
    # Checkpoints (or saved activations) are blocks of one size, made and freed in the same order every step: the
    # cache serves them again whole. The rest comes and goes in many sizes.
    held = ("activations: checkpoints", "activations: saved")
    transient = sum(r.bytes for r in rows if r.name.startswith("activations") and r.name not in held) + gather
    floor = knobs.get("allocator_floor_gib", DEFAULT_ALLOCATOR_FLOOR_GIB)
    rows.append(Row("allocator reserve", floor * GIB + knobs["allocator_reserve"] * transient,
                    f"{floor:g} GiB + {knobs['allocator_reserve']:.0%} of the transient activations + buffers "
                    "(reserved beyond allocated; --allocator_floor_gib, --allocator_reserve)"))
    rows.append(Row("framework overhead", knobs["cuda_context_gib"] * GIB,
                    "CUDA context, NCCL buffers, workspaces: nvidia-smi beyond torch's reserved (--cuda_context_gib)"))
    step = sum(r.bytes for r in rows)
    load, wrap = load_phases(shape, w, d, knobs)
    phases = {"load": load, "wrap": wrap, "train step": step}
    host_rows, host_peak = host_ram_rows(shape, w, d, knobs)
    return rows, phases, host_rows, host_peak


def layer_bytes_as_loaded(shape: ModelShape, w: Workload) -> float:
    """One decoder layer as loaded: U x b, or with 4-bit weights its packed linears (layer Q/2) + the rest x b."""
    if w.quant == "4bit":
        layer_q = sum(lin.in_features * lin.out_features for lin in shape.layer_linears)
        return layer_q / 2 + (shape.layer_params - layer_q) * w.load_bytes
    return shape.layer_params * w.load_bytes


def load_phases(shape: ModelShape, w: Workload, d: Distribution, knobs: dict) -> tuple[float, float]:
    """GPU memory of one rank (load, wrap): at the end of `from_pretrained`, and through wrapping.

    load = cuda_context_gib + the weights from_pretrained puts on the GPU (the most it holds at once while loading):
           0 without quantization (loaded on the CPU; FSDP or the Trainer moves them);
           with bitsandbytes, the whole quantized base (weights + constants) where transformers 5.x maps it to this
           rank's GPU: one process and DDP (where it trains whole anyway), and under FSDP on upstream's path
           (load_path "upstream": no device_map, and the allocator warmed up to the same size first);
           under FSDP on the recipe's path (compat.quantized_base_device_map loads it on the CPU) one weight at a
           time as it is quantized on the GPU (weight_quantizing_bytes), or the replicated 4-bit constants on ranks
           other than 0 when rank 0 alone loads it (FSDP1 + cpu_ram_efficient_loading: they receive its
           quantization state onto their GPU), whichever is larger.
    wrap = cuda_context_gib + weights/G (0 when offloaded) + replicated 4-bit constants + one decoder layer moved
           whole before it is sharded (U x b, packed when 4-bit); on upstream's FSDP path the whole base is already
           there: + weights x (1 - 1/G) until each unit is sharded.
    """
    ctx = knobs["cuda_context_gib"] * GIB
    shardable, replicated, _ = base_weight_bytes(shape, w)
    whole = shardable + replicated
    quantized_on_gpu = w.quant is not None and (d.kind != "fsdp" or knobs.get("load_path") == "upstream")
    received = replicated if d.loads_quantized_base_once(w.quant) else 0.0  # rank 0's state, sent to the others
    # the recipe's FSDP path quantizes on the GPU a weight at a time (the loading rank; the others receive state)
    at_a_time = weight_quantizing_bytes(shape, w) if w.quant == "4bit" and not quantized_on_gpu else 0.0
    load = ctx + (whole if quantized_on_gpu else max(received, at_a_time))
    on_gpu = 0.0 if d.offload else 1.0
    sharded = d.shard_group if d.kind == "fsdp" else 1
    wrap = ctx + on_gpu * shardable / sharded + replicated + layer_bytes_as_loaded(shape, w)
    if quantized_on_gpu and d.kind == "fsdp":
        wrap = max(wrap, load + layer_bytes_as_loaded(shape, w))
    return load, wrap


def quantizing_bytes_per_weight(w: Workload) -> float:
    """Bytes one weight takes on the GPU while it is quantized there, and crosses to and from it: as read (b), packed
    (half a byte) and its share of the fp32 absmax of its 64-weight block."""
    return w.load_bytes + 0.5 + 4 / 64


def weight_quantizing_bytes(shape: ModelShape, w: Workload) -> float:
    """GPU bytes of the largest quantized weight (a decoder layer's linear; the head stays unquantized) while it is
    quantized there."""
    largest = max((lin.in_features * lin.out_features for lin in shape.layer_linears),
                  default=shape.largest_linear_params)
    return largest * quantizing_bytes_per_weight(w)


def gpu_quantization_seconds(shape: ModelShape, w: Workload) -> float:
    """Seconds for one rank to quantize the base on its GPU a weight at a time: every quantized weight copied there
    as loaded and back packed, at PAGEABLE_COPY_BYTES_PER_S (the checkpoint's read from disk is not counted, as it is
    not in quantization_seconds)."""
    if w.quant != "4bit":
        return 0.0
    return shape.quantizable_params * quantizing_bytes_per_weight(w) / PAGEABLE_COPY_BYTES_PER_S


def quantization_seconds(shape: ModelShape, w: Workload, threads: int = DEFAULT_QUANTIZE_THREADS_PER_RANK) -> float:
    """CPU time for one rank to quantize the base when it loads on the CPU (the recipe's FSDP path): Q weights at
    QUANTIZE_WEIGHTS_PER_S_PER_THREAD x threads (rank 0 alone, with its machine's threads, when it loads the base
    once; otherwise every rank, in parallel, with its share)."""
    if w.quant is None:
        return 0.0
    return shape.quantizable_params / (QUANTIZE_WEIGHTS_PER_S_PER_THREAD * max(1, threads))


def host_ram_rows(shape: ModelShape, w: Workload, d: Distribution, knobs: dict) -> tuple[list[Row], float]:
    """Host RAM of one machine of a CUDA run: (rows, then notes not in the peak; peak bytes).

    host = runtime (n x host_runtime_gib) + max(loading, offloaded + activations + final save), where
           loading     = one copy of the loaded weights on local rank 0 and none on the others
                         (cpu_ram_efficient_loading, not quantized); a 4-bit base under FSDP1 with
                         cpu_ram_efficient_loading: one copy, on rank 0 (the others get its quantization state on
                         their GPU); any other quantized base under FSDP on the recipe's path: one copy per rank
                         (each keeps its own in host RAM); a quantized base placed on
                         the GPU by transformers (one process, DDP, upstream's FSDP path): none; else one per rank,
           offloaded   = (weights + trainable + gradients + optimizer) x n/G,
           activations = n x what one rank pins for --activation_offloading (components.offloaded_activation_bytes;
                         the pinned blocks stay cached from the first step to the end of the run),
           final save  = 2 x the adapter's bytes on rank 0 (gathered, then written): sft_recipe/artifacts/gather.py
                         gathers only what the adapter holds. Upstream's FULL_STATE_DICT save gathers every
                         weight there instead: listed as a note, not in the peak.
    The checkpoint files also pass through the page cache (reclaimable, listed, not in the peak).
    """
    G, n = d.shard_group, d.per_machine
    shardable, replicated, _ = base_weight_bytes(shape, w)
    trainable, tbytes = count_trainable(shape, w)
    opt, _ = optimizer_bytes(shape, w, trainable, tbytes)
    full_loaded = shardable + replicated
    host = [Row("runtime", n * knobs["host_runtime_gib"] * GIB, f"{n} processes x {knobs['host_runtime_gib']:g} GiB "
                "(CUDA libraries, Python; --host_runtime_gib)", "host")]
    if w.quant and (d.kind != "fsdp" or knobs.get("load_path") == "upstream"):
        load = 0.0
        lformula = "none: each weight is quantized on this rank's GPU as it is read (file pages only)"
    elif d.loads_quantized_base_once(w.quant):
        load = full_loaded
        lformula = ("one copy of the quantized base, on rank 0 (its machine); the other ranks hold only its "
                    "quantization state, on their GPU (FSDP1 sends the packed weights at wrapping)")
    elif w.quant:
        load = n * full_loaded
        why = ("accelerate's FSDP2 preparation broadcasts no 4-bit weights from rank 0" if d.fsdp_version == 2 else
               "FSDP1 loads it once only with cpu_ram_efficient_loading")
        lformula = (f"{n} cop{'y' if n == 1 else 'ies'} of the quantized base: every rank quantizes its own on the "
                    f"CPU ({why})")
    elif d.kind == "fsdp" and d.cpu_ram_efficient_loading:
        load = full_loaded
        lformula = "one copy of the weights as loaded, on local rank 0; 0 on the others (cpu_ram_efficient_loading)"
    else:
        load = n * full_loaded
        lformula = f"{n} cop{'y' if n == 1 else 'ies'} of the weights as loaded (one per process)"
    host.append(Row("loading", load, lformula, "host"))
    offloaded = 0.0
    if d.offload:
        offloaded = (shardable + (2 * trainable * tbytes + opt)) * n / G
        host.append(Row("offloaded shards", offloaded, "(weights + trainable + grads + optimizer) x n/G", "host"))
        mixed = mixed_unit_gradient_bytes(shape, w, d)[1] * n  # the sharded gradient of a mixed unit, per rank
        if mixed:
            offloaded += mixed
            host.append(Row("offloaded gradient of a mixed unit", mixed, "FSDP1 use_orig_params: root unit x n/G",
                            "host"))
    activations, acformula = offloaded_activation_bytes(shape, w)
    activations *= n
    if activations:
        host.append(Row("offloaded activations", activations, f"{n} x ({acformula}) (--activation_offloading)",
                        "host"))
    adapter, aformula = adapter_bytes(shape, w)
    save = 2 * adapter
    host.append(Row("final save (rank 0)", save, f"2 x adapter ({aformula}): only what the adapter holds", "host"))
    notes = [Row("page cache (reclaimable)", shape.checkpoint_bytes, "checkpoint files read through the page cache",
                 "note")]
    if d.kind == "fsdp":
        notes.append(Row(UPSTREAM_SAVE_ROW, shardable + replicated,
                         "FULL_STATE_DICT gathers every weight to rank 0's RAM (not in the peak)", "note"))
    host_peak = host[0].bytes + max(load, offloaded + activations + save)
    return host + notes, host_peak
