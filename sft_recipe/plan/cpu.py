"""Peak RSS of one rank of a CPU run (fp32, gloo), from the components (components.py) and constants measured on
this stack (bench/memory_plan.py re-measures them against real `accelerate launch` runs)."""

from __future__ import annotations

from sft_recipe.plan.components import (
    activation_bytes_per_token_per_layer,
    adapter_bytes,
    base_weight_bytes,
    count_trainable,
    fully_trained_bytes,
    mixed_unit_gradient_bytes,
    optimizer_bytes,
)
from sft_recipe.plan.inputs import Distribution, Workload
from sft_recipe.plan.result import MIB, Row
from sft_recipe.plan.shape import ModelShape

# ---- CPU calibration (peak RSS per rank, Linux glibc malloc, torch 2.13 CPU, 1 thread per rank) ----
# Process after importing torch + transformers + trl + peft and building tokenizer, data and trainer (the tiny 64 x 2
# model under FSDP1 on 2 ranks: 488-510 MiB over three launches, 2026-12-05; 557-570 before DeepSpeed was kept out of
# the runs that are not DeepSpeed's, sft_recipe/compat/unused_imports.py):
CPU_FIXED_MIB = 500.0
# A DeepSpeed launch imports DeepSpeed (a two-rank FSDP2 launch that imported it: 576 against 512 MiB at its peak).
CPU_DEEPSPEED_IMPORT_MIB = 64.0
# glibc keeps freed activation memory in the heap: the RSS growth of a training step is this many times the saved
# activations of ALL layers without checkpointing (L*T*c). Fitted on 77M-parameter 1024x8 Llama runs with T = 256 and
# 1024 tokens (bench/memory_plan.py): without checkpointing 1.9-2.1; with it 1.0 (T=256) to 1.3 (T=1024) -- the
# heap keeps more than the live activations, so checkpointing lowers CPU peaks less than GPU peaks.
CPU_HEAP_FACTOR_NO_CHECKPOINTING = 2.0
CPU_HEAP_FACTOR_CHECKPOINTING = 1.2
# 4-bit runs, relative to the same LoRA run: with checkpointing they grew 0.56x (in-process) to 0.74-0.79x (FSDP2);
# without it 1.0-1.8x (three launches of one setup: 249, 369 and 439 MiB). Measured averages, not derived.
CPU_HEAP_FACTOR_4BIT = {True: 0.8, False: 1.4}  # keyed by gradient checkpointing
# FSDP on gloo: extra heap per rank during a step: a part that does not grow with the model (the malloc arenas of
# gloo's and FSDP's threads) plus unsharded decoder layers (all-gather buffers, gloo's flat copies, gradient
# reduce-scatter inputs). Without checkpointing, fitted on three shapes (2 ranks, T=256; the heap the step leaves
# above the other rows): hidden 768 x 4 layers 166 MiB, 1024 x 8 185 MiB, 1536 x 4 259 MiB -> 135 MiB + 1.5 layers.
# With it 0-1.6 layers and no fixed part (the activation heap absorbs them). FSDP2's ranks differ from each other by
# up to ~100 MiB from launch to launch, either way.
CPU_FSDP_STEP_FIXED_MIB = {False: 135.0, True: 0.0}  # keyed by gradient checkpointing
CPU_FSDP_STEP_UNITS = {False: 1.5, True: 1.0}


def estimate_cpu(shape: ModelShape, w: Workload, d: Distribution, rank: int) -> tuple[list[Row], dict]:
    """Peak RSS of one rank of a CPU run (fp32, gloo), measured behaviour of this stack:

    - fixed: CPU_FIXED_MIB (imports + tokenizer, data, trainer), CPU_DEEPSPEED_IMPORT_MIB more under DeepSpeed.
    - checkpoint pages: safetensors are memory-mapped; every rank that reads them has the file's pages resident.
      Without FSDP the loaded tensors *are* those pages (same dtype) or keep the mapping alive (quantized models
      keep their embeddings/head in it), for the whole run. FSDP copies weights into flat shards and drops the
      mapping after wrapping. FSDP2 with cpu_ram_efficient_loading: only rank 0 reads (LoRA); QLoRA loads on every
      rank. FSDP1 with cpu_ram_efficient_loading: only rank 0 reads, QLoRA too (the others receive the 4-bit
      quantization state).
    - loaded copies: 4-bit: the packed weights + constants (anonymous memory); a dtype change: a copy.
    - FSDP shards: base weights / G. Wrapping also holds one unsharded unit.
    - step: trainable + gradients + optimizer state, plus the heap the step's activations leave behind: glibc keeps
      freed activation memory, so RSS grows by CPU_HEAP_FACTOR x L*T*c (c: bytes per token per layer, fp32) --
      checkpointing lowers it less than it lowers the live activations (x CPU_HEAP_FACTOR_4BIT for 4-bit runs);
      plus CPU_FSDP_STEP_FIXED_MIB and CPU_FSDP_STEP_UNITS unsharded decoder layers of gloo/FSDP buffers.
    - final save (rank 0): 2 x the adapter's bytes above the train step's memory (the adapter gathered, then
      written); upstream's full gather would add every weight (the `upstream's final save` host row on GPU).
    """
    shardable, replicated, _ = base_weight_bytes(shape, w)
    trainable, tbytes = count_trainable(shape, w)
    opt, _ = optimizer_bytes(shape, w, trainable, tbytes)
    G = d.shard_group
    fsdp = d.kind == "fsdp"
    receives = rank > 0 and d.loads_quantized_base_once(w.quant)  # rank 0's quantization state, nothing else
    reads_file = not (fsdp and d.fsdp_version == 2 and d.cpu_ram_efficient_loading and rank > 0 and not w.quant
                      or receives)
    file_pages = shape.checkpoint_bytes if reads_file else 0.0
    ckpt_dtype_bytes = shape.checkpoint_bytes / max(1, shape.total_params)
    same_dtype = abs(ckpt_dtype_bytes - w.load_bytes) < 0.05 * w.load_bytes
    loaded_copy = (shardable + replicated) if w.quant else (0.0 if same_dtype else shardable)
    if receives:
        loaded_copy = replicated
    elif w.quant == "4bit":  # embeddings/head stay views of the mapping
        loaded_copy -= (shape.total_params - shape.quantizable_params) * w.load_bytes if same_dtype else 0.0
    layer_q = sum(lin.in_features * lin.out_features for lin in shape.layer_linears)
    unit = (layer_q / 2 + (shape.layer_params - layer_q) * w.load_bytes if w.quant == "4bit"
            else shape.layer_params * w.load_bytes)  # one unsharded decoder layer as stored
    fixed = (CPU_FIXED_MIB + (CPU_DEEPSPEED_IMPORT_MIB if d.kind == "deepspeed" else 0.0)) * MIB
    c = activation_bytes_per_token_per_layer(shape, w, "cpu")
    heap_factor = CPU_HEAP_FACTOR_CHECKPOINTING if w.gradient_checkpointing else CPU_HEAP_FACTOR_NO_CHECKPOINTING
    if w.quant:
        heap_factor *= CPU_HEAP_FACTOR_4BIT[w.gradient_checkpointing]
    heap = heap_factor * shape.num_layers * w.tokens * c
    train_state = trainable * tbytes * 2 + opt + fully_trained_bytes(shape, w)[0]  # + modules trained in full
    rows = [Row("fixed (imports, tokenizer, data, trainer)", fixed, f"{fixed / MIB:g} MiB measured")]
    if fsdp:
        shard = (shardable + replicated) / G
        units = CPU_FSDP_STEP_UNITS[w.gradient_checkpointing]
        step_fixed_mib = CPU_FSDP_STEP_FIXED_MIB[w.gradient_checkpointing]
        fsdp_step = step_fixed_mib * MIB + units * unit if G > 1 else 0.0
        mixed = mixed_unit_gradient_bytes(shape, w, d)[0]
        rows += [
            Row("checkpoint pages + loaded copies", file_pages + loaded_copy,
                "mmapped safetensors (+ 4-bit weights), load+wrap phase only"),
            Row("base weights (shard)", shard, f"(P*b)/G, G={G}"),
            Row("trainable + grads + optimizer", train_state / G, "(2*trainable + optimizer)/G"),
            Row("activations (heap after a step)", heap, f"{heap_factor:g} x L*T*c, T={w.tokens}, c={c:,.0f}"),
            Row("FSDP step buffers", fsdp_step, f"{step_fixed_mib:g} MiB + {units:g} x one unsharded layer"),
        ]
        if mixed:
            rows.append(Row("FSDP1 gradient of a mixed unit", mixed, mixed_unit_gradient_bytes(shape, w, d)[2]))
        wrap = fixed + file_pages + loaded_copy + shard + unit
        step = fixed + shard + train_state / G + heap + fsdp_step + mixed
        phases = {"load+wrap": wrap, "train step": step}
        if rank == 0:
            phases["final save"] = step + 2 * adapter_bytes(shape, w)[0]
        return rows, phases
    rows += [
        Row("checkpoint pages (mmap)", file_pages, "safetensors file size"),
        Row("loaded copies", loaded_copy, "quantized weights / dtype conversions"),
        Row("trainable + grads + optimizer", train_state, "2*trainable + optimizer"),
        Row("activations (heap after a step)", heap, f"{heap_factor:g} x L*T*c, T={w.tokens}, c={c:,.0f}"),
    ]
    step = sum(r.bytes for r in rows)
    return rows, {"load": fixed + file_pages + loaded_copy, "train step": step}
