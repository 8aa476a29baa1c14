"""Will the base load where the launch puts it? Checked from the model config before any weight is read."""

from __future__ import annotations

import logging

from sft_recipe.config.args import DataTrainingArguments, ModelArguments
from sft_recipe.config.launch_env import LaunchEnv, gpu_memory_bytes
from sft_recipe.errors import check_not_run

logger = logging.getLogger(__name__)

GIB = 2 ** 30
FSDP_QLORA_COMMAND = ("accelerate launch --config_file configs/fsdp_config_qlora.yaml train.py ... "
                      "(bash run_peft_qlora_fsdp.sh)")


def quantized_base_bytes(m: ModelArguments, d: DataTrainingArguments, t) -> float:
    """The whole quantized base as loaded (packed weights, the rest in the load dtype, quantization constants):
    the memory planner's formula (sft_recipe/plan/components.py), from the config on the meta device."""
    from sft_recipe.plan.components import base_weight_bytes
    from sft_recipe.plan.inputs import workload
    from sft_recipe.plan.shape import model_shape

    w = workload(m, d, t, "cuda")
    shape = model_shape(m.model_name_or_path, bool(getattr(t, "trust_remote_code", False)), w.extra_vocab)
    shardable, replicated, _ = base_weight_bytes(shape, w)
    return shardable + replicated


def zero3_quantized_load_problems(m: ModelArguments, d: DataTrainingArguments, t, launch: LaunchEnv,
                                  gpu_bytes: int | None = None) -> list[str]:
    """DeepSpeed ZeRO-3 with a bitsandbytes base, on GPUs: every GPU loads the whole quantized base before DeepSpeed
    partitions it (transformers 5.24: quantized models skip `zero.Init`, the quantizer maps them onto this rank's
    GPU, and `from_pretrained` refuses a user `device_map` under ZeRO-3, so the recipe cannot place it as it does
    for FSDP: compat.quantized_base_device_map). The memory plan's load phase of this launch
    (sft_recipe/plan/deepspeed.py: the whole base + the framework overhead) is the number: refused when it exceeds
    the GPU, said once otherwise. `gpu_bytes`: this rank's GPU memory (None: read it; no GPU: nothing to check)."""
    quantized = m.use_4bit_quantization or m.use_8bit_quantization
    if not (quantized and launch.use_deepspeed and launch.deepspeed_zero_stage == "3"):
        return []
    gpu_bytes = gpu_memory_bytes(launch) if gpu_bytes is None else gpu_bytes
    if gpu_bytes is None:  # a CPU dry run: device memory is host memory
        return []
    try:
        from sft_recipe.plan.planner import plan_memory

        plan = plan_memory(m, d, t, launch.accelerate_config(), None, gpu_bytes / GIB, "cuda", ladder=False)
    except Exception as e:  # noqa: BLE001 -- said; a bad model path is named by the model-path checks
        check_not_run("the QLoRA + ZeRO-3 load-memory check", e)
        return []
    need = plan.phases["load"]
    if need <= gpu_bytes:
        if launch.is_main_process:
            logger.warning(f"QLoRA under DeepSpeed ZeRO-3: every GPU holds the whole quantized base while loading "
                           f"({need / GIB:.1f} GiB with the CUDA context), before DeepSpeed partitions it; it fits "
                           f"this GPU ({gpu_bytes / GIB:.1f} GiB). FSDP loads it on the CPU and shards it unit by "
                           f"unit: {FSDP_QLORA_COMMAND}.")
        return []
    return [f"QLoRA under DeepSpeed ZeRO-3: every GPU must first hold the whole quantized base ({need / GIB:.1f} GiB "
            f"with the CUDA context: the memory plan's load phase) before DeepSpeed partitions it, and this GPU has "
            f"{gpu_bytes / GIB:.1f} GiB. transformers 5.x skips zero.Init for quantized models, maps them onto each "
            "rank's GPU and refuses a device_map under ZeRO-3, so the recipe cannot load it elsewhere. Fix: FSDP, "
            f"which the recipe loads on the CPU and shards one unit at a time: {FSDP_QLORA_COMMAND}; or a GPU with "
            "more memory."]


def dtype_problems(m: ModelArguments, t) -> list[str]:
    """--torch_dtype against the rest of the run: a half-precision base is for adapters over a frozen base under the
    matching mixed precision (fp32 LoRA weights and optimizer state); 4-bit loads in its storage dtype."""
    dtype = m.torch_dtype
    half = dtype in ("bfloat16", "float16")
    problems = []
    if half and not m.use_peft_lora:
        problems.append(f"--torch_dtype {dtype} without LoRA trains the weights themselves in {dtype}, with no fp32 "
                        "master copy. Fix: --torch_dtype float32 for full fine-tuning, or --use_peft_lora True.")
    mixed = "bfloat16" if getattr(t, "bf16", False) else "float16" if getattr(t, "fp16", False) else None
    if half and m.use_peft_lora and not m.use_4bit_quantization and mixed != dtype:
        flag = {"bfloat16": "--bf16 True", "float16": "--fp16 True"}
        fix, now = flag[dtype], "no mixed precision" if mixed is None else flag[mixed]
        problems.append(f"--torch_dtype {dtype} with {now}: the base's matmuls would run in another precision than "
                        f"its weights. Fix: {fix}, or --torch_dtype float32.")
    storage = m.bnb_4bit_quant_storage_dtype
    floats = ("bfloat16", "float16", "float32")
    if m.use_4bit_quantization and dtype not in ("", "auto", storage) and storage in floats:
        problems.append(f"--torch_dtype {dtype} with --bnb_4bit_quant_storage_dtype {storage}: a 4-bit base loads in "
                        f"its storage dtype (FSDP flattens one dtype). Fix: --torch_dtype {storage}, or unset it.")
    return problems
