"""The recipe's arguments: the one home of every default and help text.

Three groups, as in the upstream example: ``ModelArguments`` and ``DataTrainingArguments`` (ours) plus TRL's
``SFTConfig`` (every TrainingArguments flag). Precedence: dataclass defaults < ``--config recipe.yaml`` < command line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sft_recipe.config.command_line import hardware_defaults, value_of
from sft_recipe.config.mixture_yaml import mixture_as_flags
from sft_recipe.errors import ConfigError  # re-exported: forks and tests import it from here


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default="",
        metadata={"help": "Hub id or local folder of the base model (required; recipes/*.yaml name one: "
                          "recipes/tiny_demo.yaml the embedded tiny Llama that `make demo` builds)."},
    )
    chat_template_format: str = field(
        default="none",
        metadata={"help": "chatml|zephyr|none. chatml/zephyr add their special tokens and template to the tokenizer "
                          "and resize the embeddings; none keeps the tokenizer's own template.",
                  "choices": ["chatml", "zephyr", "none"]},
    )
    torch_dtype: str = field(default="", metadata={
        "help": "Base model load dtype: auto (the checkpoint's), bfloat16, float16, float32. Default: bfloat16 for "
                "LoRA/DoRA with --bf16 True (LoRA weights stay fp32), else float32 (upstream's); 4-bit: its storage.",
        "choices": ["", "auto", "bfloat16", "float16", "float32"]})
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.1)
    lora_r: int = field(default=64)
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj",
        metadata={"help": "Comma-separated module names to adapt, or 'all-linear' (every linear layer but the output "
                          "head; on MoE models the attention and shared projections, not the experts or router)."},
    )
    lora_target_parameters: str = field(default="", metadata={
        "help": "Fused MoE expert parameters to adapt too (PEFT target_parameters), e.g. experts.gate_up_proj; needs "
                "--lora_dropout 0."})
    use_dora: bool = field(
        default=False,
        metadata={"help": "DoRA: weight-decomposed LoRA (a learned magnitude per output feature on top of LoRA); "
                          "with 4-bit quantization this is QDoRA. Slower per step than LoRA."},
    )
    adapter_name_or_path: str = field(
        default="",
        metadata={"help": "Train an existing LoRA adapter further (a folder or a Hub id), with a new optimizer and "
                          "schedule: its rank, alpha, targets and weights are the start (LoRA flags that disagree are "
                          "refused). Not a resume: that is --resume_from_checkpoint."},
    )
    lora_modules_to_save: str = field(
        default="",
        metadata={"help": "Comma-separated modules trained in full and saved with the adapter, e.g. "
                          "`embed_tokens,lm_head`. Costs a full copy of each (and its Adam state) per rank."},
    )
    train_new_tokens: bool = field(
        default=False,
        metadata={"help": "When chatml/zephyr add tokens to the vocabulary, train their embedding and output rows "
                          "(PEFT trainable tokens: only those rows, saved with the adapter). One process or FSDP2 "
                          "(FSDP1 and ZeRO-3 are refused, with the reason). Without it, the new rows keep their "
                          "random initialisation, as upstream."},
    )
    use_nested_quant: bool = field(default=False, metadata={"help": "Double quantization of the 4-bit constants."})
    bnb_4bit_compute_dtype: str = field(default="float16", metadata={"help": "Compute dtype of 4-bit layers."})
    bnb_4bit_quant_storage_dtype: str = field(
        default="uint8",
        metadata={"help": "Storage dtype that packs 4-bit weights. Under FSDP it must equal the model dtype "
                          "(e.g. bfloat16), which the recipe then loads the model in."},
    )
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "fp4|nf4", "choices": ["fp4", "nf4"]})
    use_flash_attn: bool = field(default=False, metadata={"help": "flash_attention_2 (needs the flash-attn package "
                                                                  "and a CUDA GPU). Default attention is SDPA."})
    use_peft_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (else: full fine-tuning)."})
    use_8bit_quantization: bool = field(default=False)
    use_4bit_quantization: bool = field(default=False)
    use_reentrant: bool = field(default=False, metadata={"help": "Reentrant activation checkpointing."})
    use_unsloth: bool = field(
        default=False,
        metadata={"help": "Upstream's one-GPU Unsloth path (run_unsloth_peft.sh). Refused before any model load: "
                          "without the unsloth package or a CUDA GPU it cannot run, and this recipe trains through "
                          "PEFT + TRL instead. Alternative: drop the flag (bash run_peft.sh is the same QLoRA run)."},
    )
    gptq_backend: str = field(
        default="auto_trainable",
        metadata={"help": "GPT-QModel kernel for a GPTQ base (run_peft_fsdp_gptq.sh). auto_trainable picks one "
                          "that supports backward; `auto` may pick an inference-only kernel, which is refused."},
    )
    # trust_remote_code is SFTConfig's own flag (default False); upstream hard-codes it on, we never do.

    @property
    def modules_to_save(self) -> list[str]:
        """--lora_modules_to_save as names (the one place the comma list is read)."""
        return [name.strip() for name in self.lora_modules_to_save.split(",") if name.strip()]


@dataclass
class DataTrainingArguments:
    dataset_name: str = field(
        default="timdettmers/openassistant-guanaco",  # upstream's default
        metadata={"help": "Hub dataset name; or a local folder holding one `save_to_disk` folder per split, a "
                          "`save_to_disk` DatasetDict, or files named after the splits (train.jsonl, test.parquet, "
                          "...: jsonl/json/parquet/csv). Several, comma-separated (`a,b`), train one mixture: each "
                          "source recognised and checked on its own, then mixed (see --dataset_proportions)."},
    )
    dataset_proportions: str = field(
        default="",
        metadata={"help": "With several --dataset_name sources: each one's share of the training rows, e.g. 0.7,0.3 "
                          "(TRL's `fraction`: normalised, and the mixture is as large as it can be without repeating "
                          "a row; which rows, by --seed). Empty: every row of every source. Test splits are mixed "
                          "whole."},
    )
    append_concat_token: bool = field(
        default=False,
        metadata={"help": "Upstream: append EOS between packed examples. TRL 1.16 always appends EOS to text "
                          "examples, so False has no effect (a warning says so)."},
    )
    add_special_tokens: bool = field(
        default=False,
        metadata={"help": "Prepend the tokenizer's BOS to each text example. No effect on `messages` data, "
                          "whose chat template decides."},
    )
    splits: str = field(default="train,test", metadata={"help": "Comma-separated split names to load."})
    eval_split_size: float | None = field(
        default=None,
        metadata={"help": "Hold out part of the training rows as the test split, for data that has none: a share "
                          "(0.05) or a row count (500, when >= 1), chosen by --seed, never trained on, named in the "
                          "data report (LLaMA-Factory's val_size, axolotl's val_set_size). Use with --splits train."},
    )
    dataset_format: str = field(
        default="auto",
        metadata={"help": "auto|text|messages|prompt_completion|sharegpt|alpaca. auto recognises the format from the "
                          "columns (a note says which); name one when the columns fit several.",
                  "choices": ["auto", "text", "messages", "prompt_completion", "sharegpt", "alpaca"]},
    )
    dataset_column_map: str = field(
        default="",
        metadata={"help": "Rename columns before the format is recognised, e.g. `dialog=conversations` or "
                          "`question=prompt,answer=completion`."},
    )
    dataset_role_map: str = field(
        default="",
        metadata={"help": "Map role names onto system/user/assistant/tool, e.g. `human=user,bot=assistant` "
                          "(ShareGPT's human/gpt are mapped already)."},
    )
    drop_bad_rows: bool = field(
        default=False,
        metadata={"help": "Drop rows that fail the data checks (the count dropped is reported) instead of "
                          "stopping with the list of problems."},
    )
    dataset_streaming: bool = field(default=False, metadata={
        "help": "Refused with what works instead (TRL's scripts' flag): rows are memory-mapped from disk, so memory "
                "stays flat in the rows without it (docs/data.md)."})
    preview_examples: int = field(
        default=0,
        metadata={"help": "Print this many training examples as the model sees them, loss-carrying tokens marked, "
                          "then exit before any weight is loaded."},
    )


@dataclass
class RecipeArguments:
    """What this recipe adds beyond upstream's flags."""

    config: str | None = field(default=None, metadata={"help": "Recipe YAML whose keys are any of these flags."})
    verify_adapter: bool = field(
        default=True,
        metadata={"help": "After saving, check the adapter holds every LoRA tensor with the right shape and that "
                          "lora_B moved. A failed check stops the run with a non-zero exit."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds a previous run's adapter or checkpoints (its "
                          "checkpoints are moved to output_dir/_previous-run-<time>/). Without it such a run is "
                          "refused; --resume_from_checkpoint latest continues the previous run instead."},
    )
    peak_tflops_per_device: float | None = field(
        default=None,
        metadata={"help": "Peak dense bf16 TFLOPS of one device, for the MFU in the logs. Default: looked up from the "
                          "GPU name (H100/H200 989, A100 312, ...); none on CPU, where MFU is not logged."},
    )
    plan_memory_gib: float | None = field(
        default=None,
        metadata={"help": "Print the per-rank memory plan for GPUs of this many GiB (see python -m sft_recipe.plan) "
                          "and exit before loading any weight: exit 0 if it fits, 3 if not."},
    )
    defer_push_to_hub: bool = field(
        default=False,
        metadata={"help": "With --push_to_hub: train now without Hub access and print the upload command at the end."},
    )
    stop_on_nonfinite: bool = field(default=True, metadata={
        "help": "Stop every rank at the first non-finite loss or gradient norm, saving nothing of it (exit 4)."})
    plot_loss_curve: bool = field(default=True, metadata={
        "help": "Draw loss_curve.png in output_dir at the end (matplotlib: ~0.5 CPU-s of the main process). False "
                "for many short runs whose run_record.json holds the same losses."})


ALIASES = {"max_seq_len": "max_length", "dtype": "torch_dtype"}
# Library defaults this recipe changes. hub_private_repo: the Hub would create a PUBLIC repository by default.
# logging_nan_inf_filter: transformers would log a NaN loss as the mean of earlier ones (a diverged run shows 0);
# the recipe stops at the first non-finite value instead (train/divergence.py), and the log shows it as it is.
RECIPE_DEFAULTS = {"hub_private_repo": True, "logging_nan_inf_filter": False}


def _sft_config_class():
    from trl import SFTConfig  # imported lazily: importing TRL costs ~10 s

    return SFTConfig


def build_parser():
    from transformers import HfArgumentParser

    # allow_abbrev=False: a misspelled prefix like --lora_al must fail, not silently match --lora_alpha.
    parser = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, RecipeArguments, _sft_config_class()), allow_abbrev=False
    )
    show_aliases_in_help(parser)
    return parser


def show_aliases_in_help(parser: argparse.ArgumentParser) -> None:
    """List each guide name (--max_seq_len) as an option string of the flag it stands for, so `--help` shows it:
    a user grepping the help for the guide's flag must find it. Parsing still goes through _rewrite_aliases."""
    for alias, target in ALIASES.items():
        action = next(a for a in parser._actions if a.dest == target)
        action.option_strings.append(f"--{alias}")
        parser._option_string_actions[f"--{alias}"] = action
        action.help = f"{action.help or ''} `--{alias}` is the upstream guide's name for this flag.".strip()


def known_option_names(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest != "help"}


def _suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f" Did you mean `{close[0]}`?" if close else ""


def _rewrite_aliases(argv: list[str], problems: list[str]) -> list[str]:
    """--max_seq_len N -> --max_length N. Repeating one name is fine (the last wins, so extra flags appended to the
    launch scripts override theirs); the two names given different values is a mistake."""
    out: list[str] = []
    last_by_name: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name in ALIASES or name in ALIASES.values():
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            last_by_name[name] = value
            out += [f"--{ALIASES.get(name, name)}", value]
            i += 1 if eq else 2
            continue
        out.append(token)
        i += 1
    for alias, target in ALIASES.items():
        if alias in last_by_name and target in last_by_name and last_by_name[alias] != last_by_name[target]:
            problems.append(f"--{alias} and --{target} are the same setting but were given different values "
                            f"({last_by_name[alias]} vs {last_by_name[target]}). Fix: keep one of them.")
    return out


def read_recipe_yaml(path: str, known: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Load a recipe YAML into {option: value}, collecting unknown keys and bad files as problems."""
    problems: list[str] = []
    p = Path(path)
    if not p.is_file():
        return {}, [f"--config: file `{path}` does not exist. Fix: pass the path of a recipe YAML (see recipes/)."]
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        return {}, [f"--config: `{path}` is not valid YAML ({e})."]
    if not isinstance(raw, dict):
        return {}, [f"--config: `{path}` must hold a mapping of flag: value, not {type(raw).__name__}."]
    raw = mixture_as_flags(raw, f"--config {path}", problems)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        target = ALIASES.get(key, key)
        if target not in known or target == "config":
            problems.append(f"--config {path}: unknown key `{key}`.{_suggest(key, known)}")
            continue
        if target in values and values[target] != value:
            problems.append(f"--config {path}: `{key}` repeats a setting given another value ({values[target]}).")
        values[target] = value
    return values, problems


def parse_args(argv: list[str] | None = None, launch=None):
    """Parse command line (+ optional recipe YAML) into (model_args, data_args, recipe_args, training_args).
    `launch` (a LaunchEnv; read from this process when not given) decides the machine-dependent defaults.

    Raises ConfigError listing every problem found in the arguments themselves; semantic checks live in
    ``sft_recipe.preflight.validate``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known = known_option_names(parser)
    problems: list[str] = []

    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            if name not in known and name not in ALIASES and name != "help":
                problems.append(f"unknown flag `--{name}`.{_suggest(name, known)} Fix: use a flag that "
                                "`python train.py --help` lists.")
    argv = _rewrite_aliases(argv, problems)

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    config_path = pre.parse_known_args(argv)[0].config
    if config_path:
        yaml_values, yaml_problems = read_recipe_yaml(config_path, known)
        problems += yaml_problems
        if not yaml_problems:
            parser.set_defaults(**yaml_values)
    else:
        yaml_values = {}
    from sft_recipe.config.optional_deps import engine_problems

    if launch is None:
        from sft_recipe.config.launch_env import read_launch_env

        launch = read_launch_env()
    parser.set_defaults(**RECIPE_DEFAULTS, **hardware_defaults(argv, yaml_values, problems, launch))
    problems += engine_problems(value_of(argv, "deepspeed", yaml_values.get("deepspeed")), launch)
    if problems:
        raise ConfigError(problems)

    try:
        model_args, data_args, recipe_args, training_args = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=False
        )
    except SystemExit as e:  # argparse already printed the reason (bad value type, bad choice)
        if e.code == 0:  # --help
            raise
        raise ConfigError(["the command line could not be parsed (see the argparse message above). Fix: correct "
                           "the value argparse names there."]) from None
    except ValueError as e:  # a dataclass __post_init__ refused a value
        raise ConfigError([f"{e}. Fix: change the setting named here (`python train.py --help`)."]) from None
    resolve_derived_settings(model_args, recipe_args, training_args)
    return model_args, data_args, recipe_args, training_args


def resolve_derived_settings(model_args: ModelArguments, recipe_args: RecipeArguments, training_args) -> None:
    """Settings that follow from others, decided once here so that nothing changes the arguments after they are
    validated: `--defer_push_to_hub` trains without the Hub (the upload command is printed at the end), the base
    model's dtype (`--torch_dtype`, default_torch_dtype), and the checkpointing implementation (`--use_reentrant`)
    goes where transformers 5.24 reads it (activation_checkpointing_kwargs) and where TRL 1.16 still reads it
    (gradient_checkpointing_kwargs)."""
    if training_args.push_to_hub and recipe_args.defer_push_to_hub:
        training_args.push_to_hub = False
    if not model_args.torch_dtype:
        model_args.torch_dtype = default_torch_dtype(model_args, training_args)
    training_args.activation_checkpointing_kwargs = {"use_reentrant": model_args.use_reentrant}
    training_args.gradient_checkpointing_kwargs = training_args.activation_checkpointing_kwargs


def default_torch_dtype(model_args: ModelArguments, training_args) -> str:
    """The base's load dtype when --torch_dtype is not given. LoRA/DoRA under bf16 mixed precision: bfloat16 -- the
    frozen base only ever enters a matmul in bf16, so an fp32 copy holds nothing a bf16 one lacks and costs twice the
    memory (tests/e2e/test_dtype.py: the same losses and adapter as upstream's fp32 load). 4-bit: its float storage
    dtype (what FSDP's flat parameters need). Otherwise float32, as upstream loads."""
    storage = model_args.bnb_4bit_quant_storage_dtype
    if model_args.use_4bit_quantization:
        return storage if storage in ("bfloat16", "float16", "float32") else "float32"
    if model_args.use_peft_lora and not model_args.use_8bit_quantization and getattr(training_args, "bf16", False):
        return "bfloat16"
    return "float32"
