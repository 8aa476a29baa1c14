"""The whole-config check, run before any weight is loaded: collect every problem, raise once."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sft_recipe.artifacts.checkpoints import previous_results, resolve_resume, resume_layout_problems
from sft_recipe.compat.cpu_module_sync import fsdp1_module_sync_allowed_on_cpu
from sft_recipe.config.args import DataTrainingArguments, ModelArguments, RecipeArguments
from sft_recipe.config.launch_env import LaunchEnv, read_launch_env
from sft_recipe.config.optional_deps import bitsandbytes_optimizers, optional_dependency_problems
from sft_recipe.data.mixture import mixture_problems
from sft_recipe.errors import ConfigError
from sft_recipe.model.shape import DTYPES, linear_module_names, module_names
from sft_recipe.model.structure import parse_target_modules
from sft_recipe.preflight.file_checks import config_file_problems, file_problems
from sft_recipe.preflight.launcher_checks import (
    deepspeed_value_problems,
    launcher_yaml_problems,
    precision_problems,
    wrap_class_problems,
    wrap_policy_problems,
)
from sft_recipe.preflight.trainer_checks import trainer_problems
from sft_recipe.train.model import flash_attn_problem

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
logger = logging.getLogger(__name__)


def _model_problems(m: ModelArguments, t, launch: LaunchEnv) -> list[str]:
    from sft_recipe.config.launch_checks import activation_offloading_problems, ddp_problems, unsloth_problems

    problems = unsloth_problems(m)
    problems += ddp_problems(m, t, launch)
    problems += activation_offloading_problems(t, launch)
    if m.use_4bit_quantization and m.use_8bit_quantization:
        problems.append("--use_4bit_quantization and --use_8bit_quantization are both True. Fix: keep one (4-bit is "
                        "the QLoRA recipe).")
    if (m.use_4bit_quantization or m.use_8bit_quantization) and not m.use_peft_lora:
        problems.append("quantized weights cannot be fine-tuned directly. Fix: add --use_peft_lora True (QLoRA).")
    if m.use_8bit_quantization and launch.use_fsdp:
        problems.append("--use_8bit_quantization True does not work with FSDP (bitsandbytes 8-bit weights cannot be "
                        "sharded). Fix: --use_4bit_quantization True with --bnb_4bit_quant_storage_dtype bfloat16.")
    for flag in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage_dtype"):
        value = getattr(m, flag)
        if value not in DTYPES:
            problems.append(f"--{flag} '{value}' is not a dtype. Fix: one of {sorted(DTYPES)}.")
    if m.bnb_4bit_compute_dtype == "uint8" and m.use_4bit_quantization:
        problems.append("--bnb_4bit_compute_dtype uint8: computation needs a float dtype. Fix: e.g. bfloat16.")
    if m.use_4bit_quantization and launch.requested_fsdp_version == 1 and \
            m.bnb_4bit_quant_storage_dtype == "float32":
        problems.append("--bnb_4bit_quant_storage_dtype float32 under FSDP1: TRL casts the LoRA weights of a quantized "
                        "model to bf16, and FSDP1 then multiplies bf16 by float32 (\"expected m1 and m2 to have the "
                        "same dtype\") at the first step. Fix: --bnb_4bit_quant_storage_dtype bfloat16 with --bf16 "
                        "True (the guide's), or FSDP2.")
    if m.use_4bit_quantization and launch.use_fsdp:
        storage = m.bnb_4bit_quant_storage_dtype
        if storage not in FLOAT_DTYPES:
            problems.append(f"--bnb_4bit_quant_storage_dtype {storage} under FSDP: FSDP flattens parameters of one "
                            "dtype, so 4-bit weights must be packed in the model's dtype. Fix: "
                            "--bnb_4bit_quant_storage_dtype bfloat16 (with --bf16 True) or float32.")
        elif storage == "bfloat16" and not t.bf16:
            problems.append("--bnb_4bit_quant_storage_dtype bfloat16 loads the model in bfloat16, but --bf16 is off "
                            "(fp16/fp32 training). Fix: --bf16 True, or (FSDP2) --bnb_4bit_quant_storage_dtype "
                            "float32.")
    if m.use_flash_attn:
        problem = flash_attn_problem()
        if problem:
            problems.append(problem)
    if m.use_peft_lora:
        if m.lora_alpha <= 0:
            problems.append(f"--lora_alpha {m.lora_alpha}: must be positive. Fix: e.g. 16 (the guide's, twice lora_r).")
        if m.lora_r <= 0:
            problems.append(f"--lora_r {m.lora_r}: the rank must be a positive integer. Fix: e.g. 8 (the guide's).")
        if not 0.0 <= m.lora_dropout < 1.0:
            problems.append(f"--lora_dropout {m.lora_dropout}: must be in [0, 1). Fix: e.g. 0.1 (the guide's).")
        if not m.lora_target_modules.strip():
            problems.append("--lora_target_modules is empty. Fix: name modules (q_proj,v_proj,...) or 'all-linear'.")
    return problems


def _half_base(m: ModelArguments) -> str | None:
    """'bfloat16' or 'float16' where the base loads in half precision (config/dtypes.py), else None."""
    import torch

    from sft_recipe.config.dtypes import model_dtype

    dtype = model_dtype(m)
    return str(dtype).removeprefix("torch.") if dtype in (torch.bfloat16, torch.float16) else None


def _adapter_variant_problems(m: ModelArguments, t, launch: LaunchEnv) -> list[str]:
    """DoRA, modules_to_save, trainable new tokens, 8-bit optimizers: where each works on this stack."""
    problems = []
    fsdp_version = launch.requested_fsdp_version
    extras = [f for f in ("use_dora", "train_new_tokens") if getattr(m, f)]
    extras += ["lora_modules_to_save"] if m.modules_to_save else []
    if extras and not m.use_peft_lora:
        problems.append(f"--{extras[0]} configures the LoRA adapter, but --use_peft_lora is False. Fix: "
                        "--use_peft_lora True.")
    if m.use_dora and m.use_8bit_quantization:
        problems.append("--use_dora True with --use_8bit_quantization True: DoRA recomputes the norm of every "
                        "adapted weight each step, which means dequantizing the int8 weights every forward, and its "
                        "merge back into int8 is lossy. Fix: --use_4bit_quantization True (QDoRA) or no quantization.")
    if m.use_dora and m.use_4bit_quantization and fsdp_version:
        problems.append(f"--use_dora True with --use_4bit_quantization True (QDoRA) under FSDP{fsdp_version}: PEFT "
                        "keeps DoRA's magnitude vectors in float32 beside the bf16-packed 4-bit weights, and FSDP "
                        "fails at the first step (FSDP2: \"expects uniform original parameter dtype\"; FSDP1: a "
                        "bf16/float32 matmul), also with float32 storage. Fix: DoRA without quantization under FSDP, "
                        "or QDoRA in one process.")
    if m.train_new_tokens and fsdp_version == 1 and not launch.fsdp_use_orig_params:
        problems.append("--train_new_tokens True under FSDP1 with fsdp_use_orig_params: false: PEFT keeps the new "
                        "rows in a parameter of their own beside the frozen embedding, and FSDP1 then flattens a "
                        "unit's parameters into one tensor of one requires_grad (\"Must flatten tensors with uniform "
                        "`requires_grad`\"). Fix: fsdp_use_orig_params: true in the accelerate config (or `accelerate "
                        "launch --fsdp_use_orig_params true ...`), with which FSDP1 keeps each parameter's own (its "
                        "cost: a gradient of the whole embedding and head through the backward, ~1 GiB per GPU for "
                        "Llama-2-70B; the memory plan shows it, docs/memory-and-speed.md); or FSDP2 "
                        "(configs/fsdp2_config.yaml), which trains the rows without it; or one process.")
    if m.train_new_tokens and fsdp_version == 1 and launch.fsdp_use_orig_params and not (
            m.use_4bit_quantization or m.use_8bit_quantization) and _half_base(m):
        problems.append(f"--train_new_tokens True under FSDP1 with a {_half_base(m)} "
                        "base: the recipe trains the new rows in float32 beside it, FSDP1 cannot flatten two dtypes "
                        "into one unit and gives the rows a unit of their own, and PEFT then reads them outside that "
                        "unit's forward (IndexError in index_copy at the first step: measured, bench/"
                        "use_orig_params.py). Fix: FSDP2 (configs/fsdp2_config.yaml), which trains them; or "
                        "--torch_dtype float32 (the rows then share the embedding's unit). QLoRA keeps them in the "
                        "4-bit storage dtype and trains them under FSDP1.")
    if m.modules_to_save and fsdp_version == 1:
        problems.append("--lora_modules_to_save under FSDP1: TRL's fused LM head reads lm_head's weight outside "
                        "the FSDP1 unit that owns it, and saving an embed_tokens copy hangs the final gather. Fix: "
                        "FSDP2 (configs/fsdp2_config.yaml; CPU: configs/cpu/fsdp2_config.yaml), or one process.")
    optim = getattr(t.optim, "value", t.optim)  # an OptimizerNames enum once parsed
    if optim in bitsandbytes_optimizers() and fsdp_version:
        problems.append(f"--optim {optim} under FSDP{fsdp_version}: bitsandbytes' optimizer state does not shard "
                        "(FSDP2: its update kernel has no DTensor rule and fails at the first step; FSDP1: "
                        "checkpoints save but resuming fails while flattening its nested quantisation state -- "
                        "upstream's guide reports a crash at the first checkpoint). Fix: --optim adamw_torch (the LoRA "
                        "optimizer state is small and FSDP shards it), or train in one process with the 8-bit "
                        "optimizer.")
    return problems


def _fsdp_env_problems(m: ModelArguments, launch: LaunchEnv) -> list[str]:
    """The accelerate config as the launcher exported it (FSDP_* variables)."""
    if not launch.use_fsdp:
        return []
    problems = []
    sync, version = launch.fsdp_sync_module_states, launch.fsdp_version
    if version == 1 and launch.fsdp_cpu_ram_efficient_loading and not sync:
        problems.append("fsdp_cpu_ram_efficient_loading: true needs fsdp_sync_module_states: true (only rank 0 loads "
                        "weights; the others receive them by that sync). Fix: set fsdp_sync_module_states: true.")
    if launch.fsdp_on_cpu and version == 1 and sync and not fsdp1_module_sync_allowed_on_cpu():  # (tests only)
        problems.append("fsdp_sync_module_states: true does not work for FSDP1 on CPU (torch syncs module states only "
                        "from GPU tensors). Fix: use configs/cpu/fsdp_config.yaml (sync and efficient loading off) "
                        "or FSDP2 (configs/cpu/fsdp2_config.yaml).")
    if launch.fsdp_on_cpu and launch.fsdp_offload_params:
        problems.append("fsdp_offload_params: true on a CPU run: offloading moves shards from GPU memory to host RAM; "
                        "here they already live in host RAM, and torch's offload needs an accelerator for its pinned "
                        "buffers (\"Cannot access accelerator device\" at the first step). Fix: "
                        "fsdp_offload_params: false (configs/cpu/*.yaml); offload is for GPU runs "
                        "(configs/fsdp_config_qlora.yaml).")
    if not launch.fsdp_on_cpu and torch_cuda_count() and (launch.local_world_size or 1) > torch_cuda_count():
        problems.append(f"num_processes per machine is {launch.local_world_size} but only {torch_cuda_count()} GPUs "
                        "are visible. Fix: --num_processes (or num_processes: in the accelerate config) at most the "
                        "number of GPUs, or check CUDA_VISIBLE_DEVICES.")
    return problems


def _deepspeed_env_problems(m: ModelArguments, t, launch: LaunchEnv) -> list[str]:
    """The DeepSpeed part of the accelerate config, as the launcher exported it (ACCELERATE_DEEPSPEED_* variables)."""
    if not launch.use_deepspeed:
        return []
    problems = []
    zero_stage = launch.deepspeed_zero_stage
    if launch.use_cpu or t.use_cpu:
        problems.append("ACCELERATE_USE_CPU=true (or --use_cpu True) with a DeepSpeed config: accelerate 1.15 then "
                        "turns DeepSpeed off and runs DDP over ZeRO-3-partitioned weights, which fails at the first "
                        "step (\"The size of tensor a (0) must match the size of tensor b\"). Fix: unset "
                        "ACCELERATE_USE_CPU; without GPUs pass --ddp_backend gloo instead "
                        "(see configs/cpu/deepspeed_config.yaml).")
    elif not torch_cuda_count() and t.ddp_backend != "gloo":
        problems.append(f"--ddp_backend {t.ddp_backend}: DeepSpeed on a machine without CUDA GPUs needs --ddp_backend "
                        "gloo; otherwise accelerate counts one process and DeepSpeed stops with \"train_batch_size is "
                        "not equal to micro_batch_per_gpu * gradient_acc_step * world_size\". Fix: --ddp_backend gloo "
                        "(with --bf16 False).")
    config_steps = launch.gradient_accumulation_steps
    if config_steps.isdigit() and int(config_steps) != t.gradient_accumulation_steps:
        problems.append(f"--gradient_accumulation_steps {t.gradient_accumulation_steps} but the DeepSpeed config says "
                        f"gradient_accumulation_steps: {config_steps}; DeepSpeed refuses the mismatch once the model "
                        f"is loaded. Fix: --gradient_accumulation_steps {config_steps}, or change the config.")
    if zero_stage == "3" and not launch.deepspeed_zero3_save_16bit_model:
        problems.append("zero_stage: 3 with zero3_save_16bit_model: false: the final adapter cannot be gathered from "
                        "the ZeRO-3 shards, so the run would fail after training (\"Cannot get 16bit model "
                        "weights\"). Fix: zero3_save_16bit_model: true in the accelerate config.")
    if m.use_4bit_quantization and zero_stage == "3" and not launch.deepspeed_zero3_init:
        logger.warning("QLoRA with ZeRO-3 and zero3_init_flag: false: upstream's guide requires zero3_init_flag: true "
                       "(configs/deepspeed_config_z3_qlora.yaml) so that transformers loads the model ZeRO-3-aware.")
    save_strategy = str(t.save_strategy).split(".")[-1].lower()
    if zero_stage == "3" and not torch_cuda_count() and m.use_4bit_quantization and save_strategy != "no":
        problems.append(f"--save_strategy {save_strategy} with QLoRA under DeepSpeed ZeRO-3 on CPU: bitsandbytes "
                        "repacks 4-bit weights for its CPU kernels and cannot save the ZeRO-3 partitions of them "
                        "(\"packed_weight should be [N, K/2]\"), so every checkpoint save fails. Fix: "
                        "--save_strategy no for CPU dry runs (the final adapter still saves; this bitsandbytes path is "
                        "CPU-only).")
    return problems


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _lora_target_problems(m: ModelArguments, t) -> list[str]:
    """Named LoRA target modules must exist in the model: checked on the meta device from its config (no weights)."""
    to_save = m.modules_to_save
    if not m.use_peft_lora or (m.lora_target_modules.strip() in ("", "all-linear") and not to_save):
        return []
    try:
        names = linear_module_names(m.model_name_or_path, t.trust_remote_code)
        all_names = module_names(m.model_name_or_path, t.trust_remote_code)
    except Exception as e:  # offline Hub id, custom code not trusted, broken config
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " Fix: --trust_remote_code True if you trust that repository's code." \
            if "trust_remote_code" in str(e) else ""
        return [f"--model_name_or_path {m.model_name_or_path}: its config could not be read ({first_line}).{hint}"]
    problems = []
    parsed = parse_target_modules(m.lora_target_modules)
    wanted = [] if parsed == "all-linear" else [x for x in parsed if x != "all-linear"]
    missing = [x for x in wanted if x not in names]
    if missing:
        problems.append(f"--lora_target_modules: {missing} match no linear layer of this model. Fix: choose from "
                        f"{sorted(names)} (or all-linear).")
    missing = [x for x in to_save if x not in all_names]
    if missing:
        problems.append(f"--lora_modules_to_save: {missing} match no module of this model. Fix: usual choices are "
                        f"{sorted(all_names & {'embed_tokens', 'lm_head', 'norm'})}.")
    return problems


def _training_problems(m: ModelArguments, d: DataTrainingArguments, r: RecipeArguments, t,
                       launch: LaunchEnv) -> list[str]:
    problems = []
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(t, flag) < 1:
            problems.append(f"--{flag} {getattr(t, flag)}: must be at least 1. Fix: --{flag} 1 or more.")
    if t.learning_rate <= 0:
        problems.append(f"--learning_rate {t.learning_rate}: must be positive. Fix: e.g. 1e-4 (the guide's).")
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        problems.append("nothing to train: --num_train_epochs and --max_steps are both 0. Fix: --num_train_epochs 1.")
    from sft_recipe.data.prepare import requested_splits, split_role

    has_test_split = any(split_role(s) == "test" for s in requested_splits(d)) or \
        getattr(d, "eval_split_size", None) is not None  # carved from train
    if str(t.eval_strategy).split(".")[-1].lower() != "no" and not has_test_split:
        problems.append(f"--eval_strategy {str(t.eval_strategy).split('.')[-1].lower()} needs a test split, but "
                        f"--splits is '{d.splits}'. Fix: --splits train,test, --eval_split_size 0.05 (held out "
                        "of train), or --eval_strategy no.")
    if d.dataset_streaming:
        problems.append("--dataset_streaming True: every row is checked, the data report measured and the rows "
                        "tokenized once before any weight loads, which needs the whole split; a stream would give "
                        "the first rows only. Without it memory does not grow with the rows: `datasets` memory-maps "
                        "them from disk (docs/data.md). Fix: drop the flag; for a Hub dataset larger than the disk, "
                        "save a slice (`load_dataset(name, split='train[:N]').save_to_disk(folder)`) and pass "
                        "--dataset_name folder.")
    fsdp1_on_cpu = launch.fsdp_on_cpu and launch.fsdp_version == 1
    if fsdp1_on_cpu and t.bf16 and t.gradient_checkpointing and not m.use_reentrant:
        problems.append("FSDP1 on CPU with --bf16 True and --gradient_checkpointing True --use_reentrant False fails "
                        "in backward (recomputed activations come back bf16 where fp32 was saved). Fix: "
                        "--use_reentrant True, or --bf16 False, or FSDP2 (configs/cpu/fsdp2_config.yaml).")
    if t.max_length is not None and t.max_length <= 0:
        problems.append(f"--max_seq_len/--max_length {t.max_length}: must be a positive number of tokens. Fix: e.g. "
                            "2048 (the guide's).")
    out = Path(t.output_dir)
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        problems.append(f"--output_dir {t.output_dir}: {probe} is not writable. Fix: choose a folder you can write.")
    if launch.use_fsdp and launch.fsdp_state_dict_type == "FULL_STATE_DICT" and \
            str(t.save_strategy).split(".")[-1].lower() != "no":
        problems.append("fsdp_state_dict_type: FULL_STATE_DICT with checkpoints (--save_strategy "
                        f"{str(t.save_strategy).split('.')[-1].lower()}): accelerate then gathers every weight onto "
                        "rank 0 at each checkpoint (a whole model copy in its RAM; FSDP1 on CPU crashes) and writes it "
                        "with torch.save pickles. The final adapter is a full adapter whatever this setting. Fix: "
                        "fsdp_state_dict_type: SHARDED_STATE_DICT (every shipped config), or --save_strategy no.")
    resume_from, resume_problems = resolve_resume(t.resume_from_checkpoint, t.output_dir)
    world_size = launch.world_size
    problems += resume_problems + resume_layout_problems(resume_from, t.per_device_train_batch_size,
                                                         t.gradient_accumulation_steps, world_size)
    previous = previous_results(t.output_dir)
    if previous and not t.resume_from_checkpoint and not r.overwrite_output_dir:
        problems.append(f"--output_dir {t.output_dir} holds a previous run ({', '.join(previous[:4])}). Fix: "
                        "--resume_from_checkpoint latest to continue it, --overwrite_output_dir True to train anew "
                        "there, or another --output_dir.")
    if getattr(t, "hub_token", None):
        problems.append("--hub_token: a token on the command line ends up in shell history, logs and the saved "
                        "training arguments. Fix: drop it and log in once (`hf auth login`) or export HF_TOKEN.")
    if t.push_to_hub and not r.defer_push_to_hub:
        offline = launch.hub_offline
        if offline or not _hub_token_present(launch):
            why = "HF_HUB_OFFLINE is set" if offline else "no Hugging Face token was found"
            problems.append(f"--push_to_hub: {why}, so the push would fail after training. Fix: log in "
                            "(`hf auth login` or HF_TOKEN=...), or --push_to_hub False, or --defer_push_to_hub True "
                            "to train now and upload later with the command printed at the end.")
        else:
            problems += hub_access_problems(t)
    return problems


def hub_access_problems(t) -> list[str]:
    """With a token and the Hub reachable: can this token write the repository the run will push to?"""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    api = HfApi()
    fix = "Fix: a token with write access (`hf auth login`), another --hub_model_id, or --defer_push_to_hub True."
    try:
        me = api.whoami()
    except Exception as e:
        return [f"--push_to_hub: the Hub did not accept the token or could not be reached ({type(e).__name__}). {fix}"]
    repo_id = t.hub_model_id or f"{me['name']}/{Path(t.output_dir).name}"
    role = me.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        return [f"--push_to_hub: the token of {me['name']} is read-only, so pushing to {repo_id} would fail. {fix}"]
    try:
        api.auth_check(repo_id, write=True)
    except RepositoryNotFoundError:
        return []  # created at the first push, in a namespace the token can write
    except GatedRepoError:
        return [f"--push_to_hub: no write access to {repo_id}. {fix}"]
    except Exception as e:  # HfHubHTTPError 403 and the like
        return [f"--push_to_hub: no write access to {repo_id} ({type(e).__name__}). {fix}"]
    return []


def _hub_token_present(launch: LaunchEnv) -> bool:
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:
        return launch.hf_token_set


def validate(m: ModelArguments, d: DataTrainingArguments, r: RecipeArguments, t,
             launch: LaunchEnv | None = None) -> None:
    """Raise ConfigError listing every problem in the configuration and the launcher's settings (`launch`: read from
    this process when not given); cheap, loads no weights."""
    launch = read_launch_env() if launch is None else launch
    from sft_recipe.preflight.load_checks import dtype_problems

    problems = _model_problems(m, t, launch) + _adapter_variant_problems(m, t, launch) + dtype_problems(m, t)
    problems += _training_problems(m, d, r, t, launch)
    problems += launcher_yaml_problems(launch)  # the accelerate YAML's keys and values, as accelerate reads them
    problems += precision_problems(t, launch) + deepspeed_value_problems(t, launch)  # the YAML against the flags
    problems += wrap_policy_problems(m, launch)  # a wrap policy a LoRA run would not keep
    problems += _fsdp_env_problems(m, launch)
    problems += _deepspeed_env_problems(m, t, launch)
    problems += optional_dependency_problems(m, t, launch)  # every optional package a setting implies
    problems += trainer_problems(m, t, launch)  # what Trainer/SFTTrainer/accelerate refuse after loading
    problems += mixture_problems(d)  # each --dataset_name source located, and the proportions
    local_model = Path(m.model_name_or_path)
    if not m.model_name_or_path:
        problems.append("--model_name_or_path is required: the base model to fine-tune. Fix: a Hub id (the guide's: "
                        "meta-llama/Llama-2-70b-hf) or a local folder; or --config recipes/tiny_demo.yaml for the "
                        "embedded tiny model (`make demo` builds it).")
    elif m.model_name_or_path.startswith((".", "/")) and not local_model.exists():
        problems.append(f"--model_name_or_path {m.model_name_or_path}: no such folder. Fix: a local model folder "
                        "or a Hub id (the embedded tiny model is built by `python -m sft_recipe.tiny --output_dir "
                        ".tiny`).")
    problems += config_file_problems(m)  # a local folder's config.json readable: the checks below read it
    if not any("--model_name_or_path" in p for p in problems):
        from sft_recipe.model.architecture import architecture_problems
        from sft_recipe.preflight.load_checks import zero3_quantized_load_problems
        from sft_recipe.train.gptq import gptq_problems

        problems += file_problems(m, d, r, t)  # weights, tokenizer files whole; a resume's base and LoRA shape the same
        problems += _lora_target_problems(m, t)
        problems += wrap_class_problems(m, t, launch)  # the YAML's layer class to wrap, in this model
        from sft_recipe.config.args import ModelArguments
        from sft_recipe.train.start_adapter import start_adapter_problems

        problems += start_adapter_problems(m, ModelArguments())  # an adapter trained further: its kind, base, shape
        problems += gptq_problems(m, t, launch)
        problems += zero3_quantized_load_problems(m, d, t, launch)  # needs the model's config
        problems += architecture_problems(m, t, launch)  # what this family allows
        from sft_recipe.preflight.disk_space import disk_space_problems

        problems += disk_space_problems(m, d, t, launch)  # the first save fits on output_dir's disk (warns: all)
    if problems:
        raise ConfigError(problems)
