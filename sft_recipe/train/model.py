"""Tokenizer, chat templates, quantization, the base model and the LoRA config."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time

import torch

from sft_recipe.compat import keep_present_no_split_modules, quantize_each_weight_on
from sft_recipe.config.args import ModelArguments
from sft_recipe.config.dtypes import model_dtype
from sft_recipe.data.chat_templates import CHAT_FORMATS, PAD_TOKEN
from sft_recipe.measure import live_tensor_mib, quant_state_tensors
from sft_recipe.model.architecture import (
    attention_implementation,
    attention_note,
    lora_target_parameters,
    lora_targets,
    ties_embeddings,
)
from sft_recipe.model.shape import DTYPES, read_config
from sft_recipe.train.load_plan import decide_load
from sft_recipe.train.quantized_from_rank0 import make_4bit_layers, share_quantization_state

logger = logging.getLogger(__name__)

def load_tokenizer(model_args: ModelArguments, trust_remote_code: bool = False):
    """Load the tokenizer; for chatml/zephyr add the format's special tokens and template.

    Tokens are added to the loaded tokenizer with `add_tokens(..., special_tokens=True)`: passing
    `additional_special_tokens=` to `AutoTokenizer.from_pretrained` (what upstream does) is silently ignored by
    transformers 5.24.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=trust_remote_code)
    fmt = CHAT_FORMATS.get(model_args.chat_template_format)
    if fmt is not None:
        new_tokens = [t for t in fmt.extra_special_tokens if t not in tokenizer.get_vocab()]
        if new_tokens:
            tokenizer.add_tokens(new_tokens, special_tokens=True)
        if fmt.eos_token is not None:
            tokenizer.eos_token = fmt.eos_token
        tokenizer.chat_template = fmt.template
    if tokenizer.pad_token is None:
        if fmt is not None:
            tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        else:
            # No new rows in the embedding when the user keeps the tokenizer as it is; padding is masked anyway.
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def bnb_config(model_args: ModelArguments):
    """BitsAndBytesConfig from the flags, or None when not quantizing."""
    if not (model_args.use_4bit_quantization or model_args.use_8bit_quantization):
        return None
    from transformers import BitsAndBytesConfig

    if model_args.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=DTYPES[model_args.bnb_4bit_compute_dtype],
        bnb_4bit_use_double_quant=model_args.use_nested_quant,
        bnb_4bit_quant_storage=DTYPES[model_args.bnb_4bit_quant_storage_dtype],
    )


def attention_kwargs(model_args: ModelArguments) -> dict:
    """`attn_implementation` for from_pretrained/from_config: only when flash-attn is asked; otherwise transformers
    picks the best its model class supports (SDPA, or eager where the model requires it: Gemma-2)."""
    implementation = attention_implementation(model_args)
    return {"attn_implementation": implementation} if implementation else {}


def flash_attn_problem() -> str | None:
    """Why flash_attention_2 cannot run here, or None."""
    if importlib.util.find_spec("flash_attn") is None:
        return ("--use_flash_attn True: the flash-attn package is not installed. Fix: `pip install flash-attn "
                "--no-build-isolation` on a CUDA machine (see README), or --use_flash_attn False for PyTorch SDPA.")
    if not torch.cuda.is_available():
        return "--use_flash_attn True needs a CUDA GPU and none is visible. Fix: --use_flash_attn False (SDPA)."
    return None


def load_model(model_args: ModelArguments, training_args, tokenizer, launch):
    """Load the base model in the right dtype/quantization/attention, then fit its embeddings to the tokenizer, as
    `decide_load` says this rank takes part (reads the weights or builds the model without them; where a quantized
    base goes and is quantized; whether rank 0's 4-bit state is shared)."""
    plan = decide_load(model_args, launch, training_args.trust_remote_code)
    if plan.reads_weights:
        started = time.perf_counter()
        with (cpu_quantization_threads(launch, plan.quantizes_on_cpu, plan.sole_loader) as threads,
              quantize_each_weight_on(plan.quantize_on)):
            model = read_base(model_args, training_args, plan.device_map)
        seconds = time.perf_counter() - started
    else:
        model = model_without_weights(model_args, training_args.trust_remote_code)
        if plan.builds_4bit_layers:  # the same Linear4bit layers; packed weights arrive when FSDP1 wraps them
            make_4bit_layers(model, bnb_config(model_args))
    shared = share_quantization_state(model, launch, plan.training_device) if plan.shares_4bit_state else None
    if plan.reads_weights and launch.is_main_process:
        logger.info(attention_note(model))
        if plan.device_map is not None:
            quantized_by = (f"quantized on {plan.quantize_on}, a weight at a time" if plan.quantize_on is not None
                            else f"quantized on the CPU, {threads} thread{'s' if threads > 1 else ''}")
            logger.info(quantized_load_note(model, launch, seconds, quantized_by, shared))
    fit_embeddings_to_tokenizer(model, tokenizer)
    keep_present_no_split_modules(model)  # what FSDP wraps: the layer classes this model has
    return model


def read_base(model_args: ModelArguments, training_args, device_map: dict | None):
    """`from_pretrained` of the base: quantized by the flags, else as the checkpoint says (GPTQ), in `device_map`."""
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.gptq import loading_kwargs

    # quantization_config only when quantizing here: transformers 5.24 treats an explicit None as "load unquantized",
    # so a pre-quantized (GPTQ) checkpoint would load as plain Linear layers with random weights, no error.
    quantization = bnb_config(model_args)
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        **({"quantization_config": quantization} if quantization is not None else
           loading_kwargs(model_args, training_args.trust_remote_code)),
        **({"device_map": device_map} if device_map is not None else {}),
        **attention_kwargs(model_args),
        dtype=model_dtype(model_args),
        trust_remote_code=training_args.trust_remote_code,
    )


def quantization_threads(launch, available_cpus: int, current_threads: int, sole_loader: bool = False) -> int:
    """Threads for bitsandbytes' CPU quantization on this rank: the machine's CPUs shared between the ranks that
    quantize (all of them when this rank is the only one: `sole_loader`), never fewer than torch already uses.
    `torchrun` (under `accelerate launch`) sets OMP_NUM_THREADS=1, which would make a 70B base take about half an
    hour per rank (~35 M weights/s per thread, measured with bitsandbytes 0.50.2)."""
    ranks_here = 1 if sole_loader else launch.local_world_size or launch.world_size or 1
    return max(current_threads, available_cpus // max(1, ranks_here), 1)


@contextlib.contextmanager
def cpu_quantization_threads(launch, enabled: bool = True, sole_loader: bool = False):
    """While a quantized base loads on the CPU: torch's intra-op threads (bitsandbytes quantizes with torch ops)
    raised to this rank's share of the machine, then put back. Yields the thread count used."""
    before = torch.get_num_threads()
    if not enabled:
        yield before
        return
    threads = quantization_threads(launch, len(os.sched_getaffinity(0)), before, sole_loader)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def quantized_load_note(model, launch, seconds: float, quantized_by: str, shared: str | None = None) -> str:
    """What loading a quantized base for FSDP cost, said once: where it is, host RAM per rank, quantization time.
    `quantized_by`: where and how it was quantized; `shared`: what share_quantization_state said when rank 0 alone
    loaded it."""
    tensors = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
    mib = live_tensor_mib(tensors)
    head = (f"quantized base loaded on the CPU for FSDP in {seconds:.1f} s ({quantized_by}): {mib:,.1f} MiB on this "
            "rank.")
    tail = " FSDP then moves the base to the training device one wrapped unit at a time, so no GPU holds all of it."
    if shared:
        return f"{head} {shared}.{tail}"
    ranks = launch.local_world_size or launch.world_size
    why = ("accelerate's FSDP2 preparation broadcasts no 4-bit weights from rank 0" if launch.fsdp_version == 2
           else "without fsdp_cpu_ram_efficient_loading FSDP1 syncs nothing from rank 0")
    return (f"{head} Each of the {ranks} ranks on this machine holds its own copy ({ranks * mib / 1024:,.2f} GiB of "
            f"host RAM) until FSDP shards it: {why}, so every rank quantizes the base itself.{tail}")


def model_without_weights(model_args: ModelArguments, trust_remote_code: bool = False):
    """The model's architecture with parameters on the meta device, in the dtype and attention `load_model` uses.
    Buffers stay real (`include_buffers=False`): non-persistent ones such as rotary frequencies are computed at
    construction, are not in any checkpoint, and FSDP2's broadcast does not carry them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = read_config(model_args.model_name_or_path, trust_remote_code)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=model_dtype(model_args), **attention_kwargs(model_args),
                                                trust_remote_code=trust_remote_code)


def materialize_meta_parameters(model) -> int:
    """Give every meta-device parameter (the model of `model_without_weights`, and the LoRA layers PEFT built on it)
    uninitialised CPU storage; returns how many there were.

    Why: accelerate's FSDP2 preparation hands the optimizer the new sharded parameters by matching `data_ptr()`,
    and every meta tensor has data_ptr 0 -- with meta parameters the optimizer silently kept the old ones and this
    rank stopped updating its shards (measured: losses drifted from the second step, exit code 0). `torch.empty`
    storage is never written before accelerate replaces it with rank 0's weights, so its pages stay unresident:
    host RAM is not spent. This is the state accelerate expects ("non-main ranks only have torch.empty").
    Tied parameters stay tied: a parameter shared by several modules (the input embedding and the output head of
    Gemma, Llama-3.2, small Qwen) gets one new storage, registered under every name. Untying them on these ranks
    alone made accelerate's FSDP2 preparation miss `lm_head.weight` after wrapping, which rank 0 (tied) never had.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "meta":
                if id(param) not in replaced:
                    empty = torch.empty_like(param, device="cpu")
                    replaced[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
                module.register_parameter(name, replaced[id(param)])
    return len(replaced)


def materialize_meta_buffers(model) -> list[str]:
    """Give every meta-device buffer uninitialised CPU storage, persistence kept; returns their names.

    Why: a buffer computed from the base weight when PEFT wraps the model (trainable tokens'
    `trainable_tokens_original`, the rows the new tokens' delta started from) is on meta where the rank built the
    model without weights, and accelerate's FSDP2 preparation copies every non-persistent buffer to the device
    ("Cannot copy out of meta tensor"). Its value is rank 0's: the trainer broadcasts these buffers from rank 0 when
    training starts (BuffersFromRank0)."""
    names = []
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.device.type == "meta":
                persistent = name not in module._non_persistent_buffers_set
                module.register_buffer(name, torch.empty_like(buffer, device="cpu"), persistent=persistent)
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def fit_embeddings_to_tokenizer(model, tokenizer) -> bool:
    """Grow the embeddings to exactly len(tokenizer) when tokens were added; never shrink, never pad.

    Upstream pads to a multiple of 8; the saved adapter then holds more embedding rows than the saved tokenizer has
    tokens, and `AutoPeftModelForCausalLM.from_pretrained` (which resizes the base to len(tokenizer)) fails with a size
    mismatch. Exact sizing keeps the standard loader working.
    `mean_resizing=False`: under `cpu_ram_efficient_loading` non-main ranks hold meta tensors (no values to average),
    and their rows are overwritten from rank 0 when FSDP syncs module states anyway. New rows start from the
    initializer; they are trained only when embed_tokens/lm_head are trained.
    """
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:
        return False
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return True


def added_token_ids(model_args: ModelArguments, tokenizer, trust_remote_code: bool = False) -> list[int]:
    """Ids the tokenizer has beyond the base model's vocabulary (chatml/zephyr tokens, <pad>): rows that start
    random and that only training can make useful. Read from the model config; no weights are loaded."""
    config = read_config(model_args.model_name_or_path, trust_remote_code)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None) or len(tokenizer)
    return list(range(vocab_size, len(tokenizer)))


def untrained_token_note(model_args: ModelArguments, new_token_ids: list[int]) -> str | None:
    """A warning when the chat format added tokens whose rows nothing will train."""
    trained = model_args.train_new_tokens or {"embed_tokens", "lm_head"} & set(
        model_args.modules_to_save)
    if not new_token_ids or not model_args.use_peft_lora or trained:
        return None
    return (f"{len(new_token_ids)} tokens added for --chat_template_format {model_args.chat_template_format} keep "
            "random embedding and output rows (LoRA does not train them). To learn them: --train_new_tokens True "
            "(one process or FSDP2: just those rows) or --lora_modules_to_save embed_tokens,lm_head (both matrices "
            "in full).")


def lora_config(model_args: ModelArguments, new_token_ids: list[int] | None = None, trust_remote_code: bool = False):
    """The LoRA config SFTTrainer wraps the model with, or None for full fine-tuning.

    `new_token_ids` (with --train_new_tokens): PEFT trainable tokens on the input embedding and the output layer, so
    the rows of tokens the chat format added are learned; only those rows train and are saved. Modules already
    trained in full (`--lora_modules_to_save`) are left to that.
    """
    if not model_args.use_peft_lora:
        return None
    from peft import LoraConfig

    modules_to_save = model_args.modules_to_save or None
    trainable_tokens = None
    if model_args.train_new_tokens and new_token_ids:
        layers = [name for name in ("embed_tokens", "lm_head") if name not in (modules_to_save or [])]
        trainable_tokens = {name: list(new_token_ids) for name in layers} or None
    config = LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=lora_targets(model_args, trust_remote_code).target_modules,  # all-linear, for this family
        target_parameters=lora_target_parameters(model_args),
        use_dora=model_args.use_dora,
        modules_to_save=modules_to_save,
        trainable_token_indices=trainable_tokens,
        # A tied head and embedding trained in full or by rows stay one tensor (PEFT ties the copies it makes);
        # without it PEFT trains two copies, and FSDP2's re-tying after its meta move fails on them.
        ensure_weight_tying=bool(modules_to_save or trainable_tokens) and ties_embeddings(model_args,
                                                                                          trust_remote_code),
        bias="none",
        task_type="CAUSAL_LM",
    )
    if getattr(model_args, "adapter_name_or_path", ""):  # an adapter trained further: its shape, not the flags'
        from sft_recipe.train.start_adapter import start_lora_config

        config = start_lora_config(model_args, config)
    return config
