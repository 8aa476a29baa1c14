"""What a model family needs from the recipe, read from its config on the meta device (no weight is read).

- Attention: `--use_flash_attn True` asks for flash_attention_2 and is refused up front for a class transformers
  implements without it; otherwise transformers picks the best its class supports (SDPA where it exists, else eager:
  Gemma-2's soft-capped attention), said once in the log.
- What `all-linear` adapts, and which parameters are routed experts: sft_recipe/model/structure.py, read from the
  module structure. Experts are adapted only when named (`--lora_target_parameters`, through PEFT's ParamWrapper,
  which has no dropout), the router never.
- Tied input/output embeddings: which parameter names share one tensor.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sft_recipe.errors import check_not_run
from sft_recipe.model.structure import (
    LoraTargets,
    fused_expert_parameters,
    lora_targets_of,
    parse_target_parameters,
)

# The flags these checks read (sft_recipe.config.args.ModelArguments), named but not imported: the model room stands
# below the settings it is asked with.
ModelArguments = Any


def attention_implementation(model_args: ModelArguments) -> str | None:
    """flash_attention_2 when asked; None lets transformers choose the best its model class supports."""
    return "flash_attention_2" if model_args.use_flash_attn else None


@lru_cache(maxsize=16)
def _meta(model_name_or_path: str, trust_remote_code: bool):
    from sft_recipe.model.shape import meta_model

    return meta_model(model_name_or_path, trust_remote_code)


def model_class_name(model_name_or_path: str, trust_remote_code: bool = False) -> str:
    return type(_meta(model_name_or_path, trust_remote_code)).__name__


def flash_attention_problem(model_args: ModelArguments, trust_remote_code: bool = False) -> str | None:
    """Why --use_flash_attn True cannot work for this model's class, or None (the package is checked elsewhere)."""
    if not model_args.use_flash_attn:
        return None
    model = _meta(model_args.model_name_or_path, trust_remote_code)
    if getattr(type(model), "_supports_flash_attn", False):
        return None
    best = "SDPA" if getattr(type(model), "_supports_sdpa", False) else "eager"
    return (f"--use_flash_attn True: {type(model).__name__} ({model.config.model_type}) has no flash-attention "
            f"implementation in transformers. Fix: --use_flash_attn False ({best}, the best it supports).")


def attention_note(model) -> str:
    """The attention implementation the loaded model runs, and why."""
    used = getattr(model.config, "_attn_implementation", None) or "default"
    why = "asked with --use_flash_attn True" if used.startswith("flash") else \
        "transformers' choice for this model (--use_flash_attn False)"
    return f"attention: {used} for {type(model).__name__} ({why})"


def lora_targets(model_args: ModelArguments, trust_remote_code: bool = False) -> LoraTargets:
    """What --lora_target_modules means for this model (sft_recipe/model/structure.py): `.target_modules` is what
    LoraConfig gets, `.note()` what all-linear leaves out and why."""
    return lora_targets_of(model_args.lora_target_modules, model_args.model_name_or_path, trust_remote_code)


def lora_target_parameters(model_args: ModelArguments) -> list[str] | None:
    """`target_parameters` (PEFT's ParamWrapper over fused expert weights), only when named."""
    return parse_target_parameters(getattr(model_args, "lora_target_parameters", "")) or None


def target_parameter_problems(model_args: ModelArguments, trust_remote_code: bool = False) -> list[str]:
    """--lora_target_parameters: each name must end a fused parameter of the model; PEFT 0.21's ParamWrapper
    applies no dropout, so --lora_dropout must be 0 with it."""
    if not model_args.use_peft_lora:
        return []
    problems = rewritten_target_problems(model_args, trust_remote_code)
    names = lora_target_parameters(model_args)
    if not names:
        return problems
    if model_args.lora_dropout != 0:
        problems.append(f"--lora_target_parameters {','.join(names)} with --lora_dropout {model_args.lora_dropout}: "
                        "PEFT 0.21 adapts fused expert weights through ParamWrapper, which has no dropout and refuses "
                        "one (\"lora.ParamWrapper does not work with lora_dropout != 0\"). Fix: --lora_dropout 0, or "
                        "leave the experts out (all-linear then adapts attention and shared projections, with "
                        "dropout).")
    try:
        fused = fused_expert_parameters(_meta(model_args.model_name_or_path, trust_remote_code))
    except Exception as e:  # noqa: BLE001 -- said; the problems found above stand
        check_not_run("the --lora_target_parameters check", e)
        return problems
    unknown = [n for n in names if not any(f == n or f.endswith("." + n) for f in fused)]
    if unknown:
        examples = sorted({f.split(".", 3)[-1] for f in fused})[:4] or ["(this model has no fused expert weights)"]
        problems.append(f"--lora_target_parameters: {unknown} name no fused expert parameter of "
                        f"{model_args.model_name_or_path}. Fix: names such as {examples}, or leave it empty.")
    return problems


def rewritten_target_problems(model_args: ModelArguments, trust_remote_code: bool = False) -> list[str]:
    """Names in --lora_target_modules that PEFT 0.21 turns into fused routed-expert parameters for this model type
    (transformers-4 expert names such as gate_proj on DeepSeek-V3), which then refuse a dropout."""
    try:
        rewritten = lora_targets(model_args, trust_remote_code).rewritten
    except Exception as e:  # noqa: BLE001 -- said
        check_not_run("the expert-name check of --lora_target_modules", e)
        return []
    if not rewritten or model_args.lora_dropout == 0:
        return []
    return [f"--lora_target_modules {model_args.lora_target_modules}: PEFT 0.21 reads {', '.join(rewritten)} as this "
            "model's routed experts (its fused parameters, the transformers-4 names) and adapts them through "
            f"ParamWrapper, which refuses --lora_dropout {model_args.lora_dropout}. Fix: --lora_target_modules "
            "all-linear (attention and the other projections), or --lora_dropout 0 to train the experts."]


def architecture_problems(model_args: ModelArguments, t, launch=None) -> list[str]:
    """What this model's family cannot do as asked (`t`: the training arguments), found from its config before any
    weight loads."""
    trust_remote_code = bool(getattr(t, "trust_remote_code", False))
    try:
        if (problem := unbuildable_problem(model_args, trust_remote_code)) is not None:
            return [problem]
    except Exception as e:  # noqa: BLE001 -- a config error of a kind not foreseen: said, the checks below go on
        check_not_run("the check that the model can be built", e)
    from sft_recipe.model.family_rules import family_problems

    checks = (("the model's forward on the meta device", lambda: forward_problem(model_args, trust_remote_code)),
              ("the flash-attention check", lambda: flash_attention_problem(model_args, trust_remote_code)),
              ("the tied-embedding check", lambda: tied_training_problem(model_args, trust_remote_code, launch)),
              ("the model family's rules", lambda: family_problems(
                  model_args, t, _meta(model_args.model_name_or_path, trust_remote_code))))
    problems = []
    for name, check in checks:  # each on its own: one that cannot run takes no other's findings with it
        try:
            found = check()
        except Exception as e:  # noqa: BLE001 -- said, by name
            check_not_run(name, e)
            continue
        problems += [found] if isinstance(found, str) else list(found or [])
    return problems + target_parameter_problems(model_args, trust_remote_code)


def forward_problem(model_args: ModelArguments, trust_remote_code: bool = False) -> str | None:
    """The model's own forward failing on its config, seen on the meta device (model/reach.py forward_failure): the
    first training step would fail the same way, after every weight loaded."""
    from sft_recipe.model.reach import forward_failure

    error = forward_failure(_meta(model_args.model_name_or_path, trust_remote_code))
    if error is None:
        return None
    return (f"--model_name_or_path {model_args.model_name_or_path}: the model's own forward fails on its config, "
            f"before any weight loads ({error}); the first training step would stop there. Fix: correct its "
            "config.json (num_key_value_heads must divide num_attention_heads, a rotary dimension must fit the "
            "head, ...), or use the checkpoint's own config.")


def unbuildable_problem(model_args: ModelArguments, trust_remote_code: bool = False) -> str | None:
    """A config that reads but that AutoModelForCausalLM cannot build (Emu3's saved text config is registered for no
    causal-LM class in transformers 5.24): said before the load, in the library's words. None when it builds, or
    when the config itself cannot be read (the model-path checks name that)."""
    from sft_recipe.model.shape import read_config

    try:
        config = read_config(model_args.model_name_or_path, trust_remote_code)
    except (OSError, ValueError):  # no config there, or transformers cannot read it: the model-path checks name that
        return None
    try:
        _meta(model_args.model_name_or_path, trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises, quoted
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"--model_name_or_path {model_args.model_name_or_path}: transformers cannot build a causal LM from "
                f"its config (model_type {getattr(config, 'model_type', '?')}: {first}). Fix: a checkpoint whose "
                "config.json names a model type AutoModelForCausalLM maps (docs/models.md#every-causal-lm-type).")
    return None


def tied_training_problem(model_args: ModelArguments, trust_remote_code: bool = False, launch=None) -> str | None:
    """A tied embedding/head trained in full (--lora_modules_to_save) or by rows (--train_new_tokens) under FSDP2
    with cpu_ram_efficient_loading: accelerate 1.15 moves the model to the meta device and calls the model's
    `tie_weights()`, which fails on PEFT's wrappers ("attribute 'weight' already exists") after loading."""
    if launch is None or launch.requested_fsdp_version != 2 or not launch.cpu_ram_efficient_loading:
        return None
    saved = set(model_args.modules_to_save)
    embedding_trained = bool(saved & {"embed_tokens", "lm_head", "wte", "embed_out"}) or model_args.train_new_tokens
    if not (model_args.use_peft_lora and embedding_trained and ties_embeddings(model_args, trust_remote_code)):
        return None
    return (f"{model_args.model_name_or_path} ties its output head to its input embedding, and training them "
            f"(--lora_modules_to_save {model_args.lora_modules_to_save or '-'}, --train_new_tokens "
            f"{model_args.train_new_tokens}) under FSDP2 with fsdp_cpu_ram_efficient_loading: true fails when "
            "accelerate 1.15 re-ties the weights after its meta-device move. Fix: fsdp_cpu_ram_efficient_loading: "
            "false in the accelerate config (every rank then reads the weights), or one process.")


def ties_embeddings(model_args: ModelArguments, trust_remote_code: bool = False) -> bool:
    """Whether the model's output head is its input embedding (Gemma, Llama-3.2, small Qwen)."""
    if not model_args.model_name_or_path:
        return False
    model = _meta(model_args.model_name_or_path, trust_remote_code)
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def tied_parameter_names(model) -> dict[str, str]:
    """{alias: first name} for every parameter registered under more than one name (a tied output head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases
