"""What the trainer libraries refuse only once the model is loaded, refused here before any weight loads.

transformers' `Trainer.__init__` (with `create_accelerator_and_postprocess`, which builds accelerate's `Accelerator`
and its FSDP plugin), TRL's `SFTTrainer.__init__` and its `_prepare_dataset` all run after `from_pretrained`: a
setting they reject costs a whole model load (minutes at 70B) and ends in a traceback. Each check below names the
library function that raises, in the pinned versions (transformers 5.24, TRL 1.16, accelerate 1.15):

- `Trainer.create_accelerator_and_postprocess` (ValueError): FSDP's own activation checkpointing with
  --gradient_checkpointing; --save_only_model with FSDP SHARDED_STATE_DICT, or with FSDP/DeepSpeed and
  --load_best_model_at_end; --auto_find_batch_size under ZeRO-3; `num_steps` in --accelerator_config's
  gradient_accumulation_kwargs with --gradient_accumulation_steps > 1.
- accelerate `FullyShardedDataParallelPlugin.__post_init__` (ValueError/KeyError, built inside `Accelerator()`):
  fsdp_activation_checkpointing_offload without activation checkpointing or with FSDP1; FSDP2's
  fsdp_reshard_after_forward not a boolean; LOCAL_STATE_DICT under FSDP2; a sharding strategy, auto-wrap policy,
  backward prefetch or state dict type accelerate does not know.
- `Trainer.__init__` (ValueError): --fsdp (the training argument) in one process or with DeepSpeed;
  `Trainer._validate_args`: --save_strategy best without --metric_for_best_model;
  `trainer_utils.validate_quantization_for_training`: a pre-quantized checkpoint without LoRA, or with a
  quantization method transformers cannot train (GPTQ: sft_recipe/train/gptq.py).
- `SFTTrainer.__init__` (ValueError): --eos_token / --pad_token not in the vocabulary; --padding_free without packing
  while max_length is set (--router_aux_loss_coef on a model without router logits: model/family_rules.py, with the
  rest of TRL's router-loss rule); liger's fused cross-entropy;
  more than one GPU in one process (nn.DataParallel); packing under context parallelism; DFT loss or label smoothing
  under DeepSpeed sequence parallelism. Its `_prepare_dataset`: packing without max_length. Settings TRL honours
  behind the recipe's data checks: --chat_template_path (another template, or another tokenizer's tokens and an
  embedding resize) and dataset_kwargs skip_prepare_dataset (untokenized rows reach the collator).
- --assistant_only_loss (`SFTTrainer.__init__` -> `get_training_chat_template`, ValueError; `_prepare_dataset`'s
  tokenize_fn, RuntimeError "at least one example has no assistant tokens"): checked in the data step, which holds
  the tokenizer (sft_recipe/data/chat_templates.py: `assistant_only_loss_template`, `assistant_tokens_problem`).
- --max_seq_len beyond the model's positions: refused where positions are a learned embedding (GPT-2 style: indexing
  past its rows fails in the first forward), warned for RoPE (it runs; quality past the trained length degrades).
"""

from __future__ import annotations

import logging

from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.errors import check_not_run

logger = logging.getLogger(__name__)

TRUTH_VALUES = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")  # accelerate's str_to_bool
POSITION_EMBEDDING_OFFSET_MAX = 2  # OPT's learned positions keep 2 extra rows beyond max_position_embeddings


def _name(value) -> str:
    """An enum-valued argument as the user typed it (SaveStrategy.BEST -> best)."""
    return str(getattr(value, "value", value))


def _deepspeed_zero3(t, launch: LaunchEnv) -> bool:
    ds_config = getattr(t, "hf_deepspeed_config", None)  # --deepspeed ds.json
    return launch.deepspeed_zero_stage == "3" or bool(ds_config is not None and ds_config.is_zero3())


def _fsdp(t, launch: LaunchEnv) -> tuple[str, dict] | None:
    """(where FSDP comes from, its effective settings) or None. The --fsdp training argument's plugin replaces the
    launcher's in `Trainer.create_accelerator_and_postprocess`."""
    if getattr(t, "fsdp_plugin_args", None):
        args = t.fsdp_plugin_args
        return "--fsdp_config", {"activation_checkpointing": bool(args.get("activation_checkpointing")),
                                 "state_dict_type": str(args.get("state_dict_type", "FULL_STATE_DICT")).upper()}
    if not launch.use_fsdp:
        return None
    default_type = "FULL_STATE_DICT" if launch.fsdp_version == 1 else "SHARDED_STATE_DICT"  # accelerate's defaults
    return "the accelerate config", {"activation_checkpointing": launch.fsdp_activation_checkpointing,
                                     "state_dict_type": launch.fsdp_state_dict_type or default_type}


def fsdp_plugin_problems(launch: LaunchEnv) -> list[str]:
    """The launcher's FSDP_* values that accelerate 1.15's FullyShardedDataParallelPlugin rejects when `Accelerator()`
    builds it in the trainer, after the model has loaded. Allowed names come from accelerate's own constants."""
    if not launch.use_fsdp:
        return []
    from accelerate.utils.constants import (
        FSDP_AUTO_WRAP_POLICY,
        FSDP_BACKWARD_PREFETCH,
        FSDP_SHARDING_STRATEGY,
        FSDP_STATE_DICT_TYPE,
    )

    late = "accelerate 1.15's FSDP plugin rejects it when the trainer starts, after the model has loaded"
    problems = []
    version = launch.fsdp_version
    known = [("fsdp_auto_wrap_policy", launch.fsdp_auto_wrap_policy, FSDP_AUTO_WRAP_POLICY),
             ("fsdp_backward_prefetch", launch.fsdp_backward_prefetch, FSDP_BACKWARD_PREFETCH),
             ("fsdp_state_dict_type", launch.fsdp_state_dict_type, FSDP_STATE_DICT_TYPE)]
    if version == 1:  # FSDP2 never reads the sharding strategy
        known.append(("fsdp_sharding_strategy", launch.fsdp_sharding_strategy, FSDP_SHARDING_STRATEGY))
    for key, value, allowed in known:
        # torch's enum values 1..n are accepted too; NO_PREFETCH and the wrap policies are names only.
        members = 0 if key == "fsdp_auto_wrap_policy" else len(allowed) - (key == "fsdp_backward_prefetch")
        numbered = value.isdigit() and 1 <= int(value) <= members
        if value and value.upper() not in allowed and not numbered:
            problems.append(f"{key}: {value!r} in the accelerate config is not a value accelerate knows ({late}). "
                            f"Fix: one of {', '.join(allowed)}.")
    if version == 2 and launch.fsdp_reshard_after_forward.strip().lower() not in TRUTH_VALUES:
        problems.append(f"fsdp_reshard_after_forward: {launch.fsdp_reshard_after_forward} under FSDP2: FSDP2 takes "
                        f"true or false ({late}); FULL_SHARD/SHARD_GRAD_OP are FSDP1's names. Fix: "
                        "fsdp_reshard_after_forward: true (FULL_SHARD) or false (SHARD_GRAD_OP).")
    if version == 2 and launch.fsdp_state_dict_type == "LOCAL_STATE_DICT":
        problems.append(f"fsdp_state_dict_type: LOCAL_STATE_DICT under FSDP2: FSDP2 has no local state dict ({late})."
                        " Fix: fsdp_state_dict_type: SHARDED_STATE_DICT.")
    if launch.fsdp_activation_checkpointing_offload and not launch.fsdp_activation_checkpointing:
        problems.append(f"fsdp_activation_checkpointing_offload: true offloads the inputs of checkpointed layers, but "
                        f"fsdp_activation_checkpointing is false ({late}). Fix: fsdp_activation_checkpointing: true "
                        "(without --gradient_checkpointing), or fsdp_activation_checkpointing_offload: false.")
    if launch.fsdp_activation_checkpointing_offload and version != 2:
        problems.append(f"fsdp_activation_checkpointing_offload: true under FSDP{version}: it exists for FSDP2 only "
                        f"({late}). Fix: fsdp_version: 2 (configs/fsdp2_config.yaml), or "
                        "fsdp_activation_checkpointing_offload: false.")
    return problems


def trainer_argument_problems(t, launch: LaunchEnv) -> list[str]:
    """What transformers 5.24's Trainer.__init__ / create_accelerator_and_postprocess / _validate_args reject."""
    late = "transformers 5.24's Trainer refuses this once the model has loaded"
    problems = []
    fsdp = _fsdp(t, launch)
    deepspeed = launch.use_deepspeed or bool(getattr(t, "deepspeed", None))
    checkpointing = getattr(t, "activation_checkpointing", None) or t.gradient_checkpointing  # 5.24's name, alias
    if fsdp and fsdp[1]["activation_checkpointing"] and checkpointing:
        where = "fsdp_activation_checkpointing: true in the accelerate config" if fsdp[0] != "--fsdp_config" else \
            "--fsdp_config activation_checkpointing: true"
        problems.append(f"{where} with --gradient_checkpointing True: two implementations of the same thing ({late}). "
                        "Fix: --gradient_checkpointing False (FSDP's own checkpointing, which saves the extra "
                        "all-gather in backward), or turn fsdp_activation_checkpointing off.")
    if fsdp and t.save_only_model and "SHARDED_STATE_DICT" in fsdp[1]["state_dict_type"]:
        problems.append(f"--save_only_model True with fsdp_state_dict_type: {fsdp[1]['state_dict_type']} (from "
                        f"{fsdp[0]}): sharded checkpoints cannot be model-only ({late}). Fix: drop --save_only_model "
                        "(the recipe's checkpoints hold only the adapter and its optimizer state, no base weights).")
    if (fsdp or deepspeed) and t.save_only_model and t.load_best_model_at_end:
        engine = "FSDP" if fsdp else "DeepSpeed"
        problems.append(f"--save_only_model True with --load_best_model_at_end True under {engine}: the best "
                        f"checkpoint could not be loaded back without its engine state ({late}). Fix: drop "
                        "--save_only_model, or --load_best_model_at_end False.")
    if t.auto_find_batch_size and _deepspeed_zero3(t, launch):
        problems.append(f"--auto_find_batch_size True under DeepSpeed ZeRO-3 ({late}: not supported). Fix: "
                        "--auto_find_batch_size False with an explicit --per_device_train_batch_size, or FSDP.")
    grad_acc = getattr(t.accelerator_config, "gradient_accumulation_kwargs", None) or {}
    if "num_steps" in grad_acc and t.gradient_accumulation_steps > 1:
        problems.append(f"--accelerator_config gradient_accumulation_kwargs num_steps {grad_acc['num_steps']} and "
                        f"--gradient_accumulation_steps {t.gradient_accumulation_steps}: two accumulation settings "
                        f"({late}). Fix: keep --gradient_accumulation_steps and drop num_steps from "
                        "--accelerator_config.")
    if t.fsdp and deepspeed:
        problems.append(f"--fsdp together with DeepSpeed ({late}). Fix: drop --fsdp (and --fsdp_config); "
                        "FSDP comes from the accelerate config: configs/fsdp_config.yaml instead of DeepSpeed's.")
    elif t.fsdp and _name(t.parallel_mode) != "distributed":
        problems.append(f"--fsdp (the training argument) in a process that is not part of a distributed launch "
                        f"({late}: \"Using fsdp only works in distributed training\"). Fix: drop --fsdp and "
                        "launch with an FSDP accelerate config: `accelerate launch --config_file "
                        "configs/fsdp_config.yaml train.py ...` (CPU: configs/cpu/fsdp_config.yaml with "
                        "ACCELERATE_USE_CPU=true).")
    if _name(t.save_strategy) == "best" and t.metric_for_best_model is None:
        problems.append(f"--save_strategy best needs a metric to decide which checkpoint is best ({late}). Fix: "
                        "--metric_for_best_model eval_loss (with --eval_strategy steps or epoch), or --save_strategy "
                        "steps.")
    if t.n_gpu > 1:  # nn.DataParallel: one process driving every visible GPU
        problems.append(f"{t.n_gpu} GPUs are visible to one process: Trainer would wrap the model in nn.DataParallel, "
                        "which TRL 1.16's SFTTrainer refuses after the model has loaded. Fix: `accelerate launch "
                        "--num_processes N train.py ...` (one process per GPU), or CUDA_VISIBLE_DEVICES=0 for one GPU.")
    return problems


def sft_argument_problems(t, launch: LaunchEnv) -> list[str]:
    """What TRL 1.16's SFTTrainer.__init__ and _prepare_dataset reject (or silently change) once the model is loaded."""
    late = "TRL 1.16's SFTTrainer refuses this once the model has loaded"
    problems = []
    if t.padding_free and not t.packing and t.max_length is not None:
        problems.append(f"--padding_free True without packing: padding-free batches are never cut at --max_length "
                        f"{t.max_length} ({late}). Fix: --packing True (its bfd strategy is padding-free already), "
                        "or --padding_free False.")
    if t.packing and t.max_length is None:
        problems.append("--packing True with no max_length: packing fills rows of max_length tokens (TRL 1.16's data "
                        "preparation stops on it once the model has loaded). Fix: --max_seq_len 2048 (the guide's).")
    if t.chat_template_path:
        problems.append(f"--chat_template_path {t.chat_template_path}: TRL would swap the chat template after the "
                        "recipe checked, measured and previewed every row with the tokenizer's own (from another "
                        "tokenizer it also adds that tokenizer's tokens and resizes the embeddings to a multiple of "
                        "64). Fix: drop it and use --chat_template_format chatml|zephyr, or put the template in the "
                        "model folder (chat_template.jinja) so the tokenizer carries it.")
    if (t.dataset_kwargs or {}).get("skip_prepare_dataset"):
        problems.append("--dataset_kwargs skip_prepare_dataset: true: TRL would train on the recipe's rows without "
                        "tokenizing them (the recipe hands it text and messages, never input_ids), and the collator "
                        "fails at the first step. Fix: drop skip_prepare_dataset.")
    liger = t.liger_kernel_config or {}
    if t.use_liger_kernel and liger.get("fused_linear_cross_entropy"):
        problems.append(f"--liger_kernel_config fused_linear_cross_entropy: true replaces the model's forward, which "
                        f"TRL 1.16 patches with its own fused LM head ({late}). Fix: drop fused_linear_cross_entropy "
                        "(TRL's head already avoids the full logits).")
    if launch.context_parallel_size > 1 and (t.packing or t.eval_packing):
        problems.append(f"--packing True with context parallelism (cp_size {launch.context_parallel_size} in the "
                        "accelerate config): context parallelism drops the block-diagonal mask that keeps packed "
                        f"examples apart ({late}). Fix: --packing False (and --eval_packing False), or cp_size 1.")
    if launch.sequence_parallel_backend == "deepspeed" and (t.loss_type == "dft" or t.label_smoothing_factor > 0):
        what = "--loss_type dft" if t.loss_type == "dft" else f"--label_smoothing_factor {t.label_smoothing_factor}"
        problems.append(f"{what} under DeepSpeed sequence parallelism (sp_size > 1 in the accelerate config): the loss "
                        f"there is the model's own NLL reduced across ranks ({late}). Fix: --loss_type nll and "
                        "--label_smoothing_factor 0, or sp_size 1.")
    return problems


def tokenizer_flag_problems(m, t) -> list[str]:
    """--eos_token / --pad_token must be tokens of the tokenizer the run uses (its chat format's tokens included).
    The tokenizer is loaded only when one of them is given; a missing tokenizer is reported by the file checks."""
    flags = [(flag, getattr(t, flag)) for flag in ("eos_token", "pad_token") if getattr(t, flag, None)]
    if not flags:
        return []
    try:
        from sft_recipe.train.model import load_tokenizer

        vocab = load_tokenizer(m, t.trust_remote_code).get_vocab()
    except Exception as e:  # noqa: BLE001 -- said; a missing tokenizer is named by the file checks
        check_not_run("the --eos_token/--pad_token check", e)
        return []
    fixes = {"eos_token": "drop --eos_token (the tokenizer's own EOS; <|im_end|> with --chat_template_format chatml)",
             "pad_token": "drop --pad_token (the recipe pads with the tokenizer's pad token, or its EOS where it has "
                          "none: padding carries no loss)"}
    return [f"--{flag} {token!r} is not a token of this tokenizer (TRL 1.16's SFTTrainer refuses it once the model "
            f"has loaded). Fix: {fixes[flag]}, or name a token it has." for flag, token in flags if token not in vocab]


def _read_config(m, t):
    """The model's config (None where it cannot be read: validate names that problem itself)."""
    try:
        from sft_recipe.model.shape import read_config

        return read_config(m.model_name_or_path, t.trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- said; validate names an unreadable config as a problem
        check_not_run("the checks that read the model's config (quantized checkpoint, positions)", e)
        return None


def quantized_checkpoint_problems(m, config) -> list[str]:
    """A checkpoint quantized before this run (its config carries a quantization_config), as transformers 5.24's
    `validate_quantization_for_training` judges it in Trainer.__init__. GPTQ has its own checks (train/gptq.py)."""
    from sft_recipe.train.gptq import config_quant_method

    method = config_quant_method(config)
    if method in (None, "gptq") or m.use_4bit_quantization or m.use_8bit_quantization:
        return []
    try:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    except Exception as e:  # noqa: BLE001 -- a method this transformers does not know: from_pretrained names it
        check_not_run("the pre-quantized checkpoint check", e)
        return []
    trainable, qat = quantizer.is_trainable, getattr(quantizer, "is_qat_trainable", False)
    trainable = trainable() if callable(trainable) else trainable
    flag = f"--model_name_or_path {m.model_name_or_path}"
    if not trainable:
        return [f"{flag} is quantized with {method}, which transformers 5.24 cannot train (its Trainer refuses it once "
                "the model has loaded). Fix: the model's unquantized checkpoint, with --use_4bit_quantization True "
                "for QLoRA."]
    if not m.use_peft_lora and not qat:
        return [f"{flag} is quantized with {method}: its quantized weights cannot be fine-tuned directly "
                "(transformers 5.24's Trainer refuses it once the model has loaded). Fix: --use_peft_lora True."]
    return []


def _rope_scaling(text_config) -> tuple[dict, float, int | None]:
    """(the rope parameters with the largest scaling factor, that factor, their original_max_position_embeddings or
    None). transformers 5 keeps `rope_parameters` (older configs: `rope_scaling`), per layer type in some families
    (Gemma-3)."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return {}, 1.0, None
    parts = [p for p in rope.values() if isinstance(p, dict)] or [rope]
    scaled = max(parts, key=lambda p: float(p.get("factor") or 1.0))  # the layer type that reaches furthest
    original = scaled.get("original_max_position_embeddings")
    return scaled, float(scaled.get("factor") or 1.0), int(original) if original else None


def _position_kind(m, t, positions: int) -> str | None:
    """"learned" (an embedding with a row per position, besides the token embedding), "rope" (rotary frequencies),
    or None (e.g. ALiBi: no position limit). Read from the model's modules, built on the meta device (no weights)."""
    import torch

    from sft_recipe.model.shape import meta_model

    model = meta_model(m.model_name_or_path, t.trust_remote_code)
    tokens = model.get_input_embeddings()
    for module in model.modules():
        rows = getattr(module, "num_embeddings", None)
        if isinstance(module, torch.nn.Embedding) and module is not tokens and rows is not None and \
                0 <= rows - positions <= POSITION_EMBEDDING_OFFSET_MAX:
            return "learned"
    if any(name.endswith("inv_freq") for name, _ in model.named_buffers()):
        return "rope"
    return None


def position_problems(m, t, config) -> list[str]:
    """--max_seq_len against the positions the model has: refused for learned absolute positions, warned for RoPE."""
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    if t.max_length is None or not isinstance(positions, int) or t.max_length <= positions:
        return []
    rope, factor, original = _rope_scaling(text)
    scaled = int((original or positions) * factor) if factor > 1 else positions
    if t.max_length <= scaled:
        return []  # within what the rope scaling extends the positions to
    try:
        kind = _position_kind(m, t, positions)
    except Exception as e:  # noqa: BLE001 -- the config was read but the model cannot be built: said
        check_not_run(f"the --max_seq_len {t.max_length} position check", e)
        return []
    if kind == "learned":
        return [f"--max_seq_len {t.max_length}: {type(config).__name__} learns one position embedding per position "
                f"and has {positions} (max_position_embeddings); a longer sequence indexes past that table and the "
                f"first forward fails. Fix: --max_seq_len {positions} or less."]
    if kind == "rope":
        scaling = (f" with rope scaling {rope.get('rope_type', rope.get('type', '?'))} factor {factor:g}"
                   f"{f' over {original} original positions' if original else ''} ({scaled} positions)"
                   if factor > 1 else " and no rope scaling (rope_parameters has no factor)")
        logger.warning(f"--max_seq_len {t.max_length} is longer than the model was trained for: "
                       f"max_position_embeddings {positions}{scaling}. RoPE runs at any length, but quality beyond "
                       f"the trained positions degrades. Fix: --max_seq_len {max(positions, scaled)}, or a model (or "
                       "rope scaling in its config) made for this length.")
    return []


def trainer_problems(m, t, launch: LaunchEnv) -> list[str]:
    """validate's hook: every check of this module but the data step's. The model's config is read once (one that
    cannot be read is validate's to report); the tokenizer is loaded only for --eos_token / --pad_token."""
    problems = fsdp_plugin_problems(launch) + trainer_argument_problems(t, launch) + sft_argument_problems(t, launch)
    problems += tokenizer_flag_problems(m, t)
    config = _read_config(m, t) if m.model_name_or_path else None
    if config is not None:
        problems += quantized_checkpoint_problems(m, config)
        problems += position_problems(m, t, config)
    return problems
