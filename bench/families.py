"""Census of every causal-LM model type transformers registers: it trains with the guide's flags, or it is refused
before any weight loads with the reason, or its tiny model cannot be built (with why).

    .venv/bin/python bench/families.py --checks          # up-front checks only, in process (about 2 minutes)
    .venv/bin/python bench/families.py                   # + a 2-step run of each, adapter loaded (about 1 hour)
    .venv/bin/python bench/families.py --types llama,mamba,ctrl --keep /tmp/census

Each type's tiny model is built through its own config class's constructor (hidden 64, 2 layers, 4 heads, the
embedded tokenizer's vocabulary; a nested text config gets the same sizes), so derived fields follow the small sizes.
The run: one process, fp32, the guide's LoRA flags (all-linear, r 8, alpha 16, dropout 0.1, chatml, packing,
gradient checkpointing), two steps; "trained" means exit 0, the recipe's adapter check passed and
AutoPeftModelForCausalLM loaded the adapter; a refusal whose fix is one flag (--packing False, ...) is tried again
with it ("refused; trained with --packing False"). Printed: one row per type, then the counts per outcome.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, n_embd=64, n_layer=2, n_head=4, d_model=64,
             num_layers=2, n_positions=512, ffn_dim=128, embedding_size=64, head_dim=16, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
             decoder_ffn_dim=128, moe_intermediate_size=64)
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
GUIDE = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
         "--lora_target_modules", "all-linear", "--chat_template_format", "chatml", "--max_seq_len", "64",
         "--per_device_train_batch_size", "2", "--packing", "True", "--gradient_checkpointing", "True",
         "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--eval_strategy", "no",
         "--save_strategy", "no", "--bf16", "False", "--seed", "7"]


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _read_only(config_class) -> set[str]:
    """Config fields the class derives (properties without a setter): passing them to the constructor raises."""
    return {k for k in dir(config_class) if isinstance(getattr(config_class, k, None), property)
            and getattr(config_class, k).fset is None}


def _small(config_class, vocab_size: int, tokenizer) -> dict:
    """The constructor arguments of SIZES this class takes (by its signature, or by its defaults' attributes), the
    tokenizer's vocabulary and special-token ids (a default pad id past the small vocabulary cannot embed)."""
    default = config_class()
    names = (set(inspect.signature(config_class.__init__).parameters) | set(vars(default))) - _read_only(config_class)
    kwargs = {k: v for k, v in SIZES.items() if k in names}
    for key in ("num_experts_per_tok",):  # a default left unset (DeepSeek-V2's) that every checkpoint sets
        if key in names and getattr(default, key, 0) is None:
            kwargs[key] = 2
    if "qk_rope_head_dim" in names:  # multi-head latent attention: head size from the rope/nope split, and as
        kwargs.pop("head_dim", None)  # many key/value heads as query heads (every released MLA config has)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for key in ("vocab_size", "n_vocab"):
        if key in names:
            kwargs[key] = vocab_size
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "decoder_start_token_id": tokenizer.pad_token_id}
    for key in SPECIAL_TOKENS:
        if key in names and getattr(default, key, None) is not None:
            kwargs[key] = ids[key] if ids[key] is not None else 0
    if {"num_heads", "expand"} <= names and getattr(default, "head_dim", None):  # an SSM: heads x head_dim = inner
        kwargs["num_heads"] = SIZES["hidden_size"] * default.expand // SIZES["head_dim"]
        kwargs["n_groups"] = 1 if "n_groups" in names else None
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
    _two_layers(kwargs, default, names)
    return kwargs


def tiny_config(model_type: str, tokenizer):
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kwargs = _small(config_class, len(tokenizer), tokenizer)
    default = config_class()
    text = getattr(default, "text_config", None)
    if text is not None and text is not default:  # a multimodal config: the text model gets the small sizes
        # per_layer_config is derived from the layer fields again; the default's is keyed by its 30-odd layers
        text_fields = {k: v for k, v in text.to_dict().items() if k != "per_layer_config"}
        kwargs["text_config"] = {**text_fields, **_small(type(text), len(tokenizer), tokenizer)}
    return config_class(**kwargs)


def _two_layers(kwargs: dict, default, names: set[str]) -> None:
    """Fields with one entry per layer (`layer_types`, a sparsity pattern, ...): keep the family's own mix, cut to
    two layers (one of each kind where it has two kinds: a hybrid keeps its attention and its linear-attention
    layer); a `per_layer_config` keyed by layer index keeps its first override, on the last layer."""
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in vars(default).items():
        if key not in names or not isinstance(value, list) or not value:
            continue
        if key == "layer_types" or (layers and len(value) == layers):
            kinds = list(dict.fromkeys(map(repr, value)))
            firsts = [value[[repr(v) for v in value].index(k)] for k in kinds]
            kwargs[key] = (firsts + firsts)[:2] if len(firsts) > 1 else value[:1] * 2
    per_layer = getattr(default, "per_layer_config", None)
    if "per_layer_config" in names and isinstance(per_layer, dict) and per_layer:
        first = sorted(per_layer)[0]
        kwargs["per_layer_config"] = {1: per_layer[first]}


class TinyModelBroken(Exception):
    """The tiny model fails a plain transformers forward and backward (no recipe, no PEFT): its config, shrunk, is
    not one the family's code runs -- a census builder limit, not a recipe failure."""


def as_if_pretrained(model) -> int:
    """Give every parameter whose elements are all equal (a gate or temperature initialised to 0, a scale to 1) a
    little noise, as a released checkpoint has learnt values there. A random init's exact zeros can make a path's
    gradient numerically zero (Doge's `A` multiplies `dt_proj`'s output, Zaya's attention temperature `temp`
    multiplies q.k): the adapter on it would stay at zero, which no real checkpoint shows. Returns how many."""
    import torch

    changed = 0
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            if flat.numel() > 1 and torch.equal(flat, flat[:1].expand_as(flat)):
                param.add_(torch.randn_like(param) * 0.02)
                changed += 1
    return changed


def build(model_type: str, root: Path, tokenizer) -> Path:
    """A seeded random tiny model of the type (`as_if_pretrained`), with the tokenizer, saved under root/<type>,
    after one plain forward and backward of 16 tokens with labels (TinyModelBroken when that fails)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = root / model_type
    config = tiny_config(model_type, tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    as_if_pretrained(model)
    ids = torch.randint(3, len(tokenizer), (1, 16))
    try:
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # as training runs it
    except Exception as e:  # noqa: BLE001 -- whatever the family's own code raises on the shrunk config
        raise TinyModelBroken(f"plain transformers forward/backward fails: {type(e).__name__}: {e}") from None
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def check(path: Path, data_dir: Path) -> str | None:
    """The recipe's up-front checks with the guide's flags: the first problem, or None when it would train."""
    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.errors import ConfigError
    from sft_recipe.preflight.validate import validate

    argv = ["--model_name_or_path", str(path), "--dataset_name", str(data_dir), "--output_dir", str(path / "out"),
            *GUIDE]
    try:
        m, d, r, t = parse_args(argv, launch=LaunchEnv())
        validate(m, d, r, t, LaunchEnv())
    except ConfigError as e:
        return e.problems[0] if getattr(e, "problems", None) else str(e)
    return None


def train(path: Path, data_dir: Path, extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """(outcome, detail) of a 2-step one-process run and the adapter's load."""
    out = path / ("run" + "".join(extra).replace("-", "_"))
    cmd = [sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(path), "--dataset_name",
           str(data_dir), "--output_dir", str(out), *GUIDE, *extra]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    text = proc.stdout + proc.stderr
    if "Traceback" in text:
        last = [line for line in text.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
        return "traceback", (last[-1] if last else text.strip().splitlines()[-1])[:160]
    if proc.returncode == 2:
        lines = text.splitlines()
        error = next((line for line in lines if line.startswith("  - ") and "Fix:" in line), None) or \
            next((line for line in lines if line.startswith("error")), "")
        return "refused", error.strip()
    if proc.returncode != 0 or "adapter check OK" not in text:
        return "failed", f"exit {proc.returncode}: {text.strip().splitlines()[-1][:140]}"
    try:
        from peft import AutoPeftModelForCausalLM

        AutoPeftModelForCausalLM.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 -- the census reports whatever the load raises
        return "traceback", f"adapter load: {type(e).__name__}: {e}"[:160]
    return "trained", ""


BUILD_SECONDS = 120  # a type whose tiny model takes longer (a default sized for the real model) is listed as such


def _too_slow(signum, frame):
    raise TimeoutError(f"its tiny model took over {BUILD_SECONDS} s to build and check")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", action="store_true", help="up-front checks only (no training)")
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--keep", default="", help="build the models here and keep them")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sft_recipe.tiny import build_tiny

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    root = Path(args.keep or tempfile.mkdtemp(prefix="census-"))
    root.mkdir(parents=True, exist_ok=True)
    tiny = build_tiny(root / ".tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    types = [t for t in args.types.split(",") if t] or causal_lm_types()
    counts: collections.Counter = collections.Counter()
    start = time.time()
    print("| model type | outcome | detail |\n|---|---|---|")
    signal.signal(signal.SIGALRM, _too_slow)
    for model_type in types:
        try:
            signal.alarm(BUILD_SECONDS)
            path = build(model_type, root, tokenizer)
        except Exception as e:  # noqa: BLE001 -- a type whose tiny model cannot be built is listed with why
            outcome, detail = "not buildable", f"{type(e).__name__}: {' '.join(str(e).split())}"
        else:
            problem = check(path, tiny.jsonl_dir)
            signal.alarm(0)
            if problem is not None:
                outcome, detail = "refused", problem
            elif args.checks:
                outcome, detail = "passes checks", ""
            else:
                outcome, detail = train(path, tiny.jsonl_dir)
            fix = re.search(r"Fix: (--\w+) (False|True|0|none)\b", detail) if outcome == "refused" else None
            if fix and not args.checks:  # the refusal's own fix, tried: it must train
                again, why = train(path, tiny.jsonl_dir, fix.groups())
                outcome, detail = (f"refused; {again} with {' '.join(fix.groups())}",
                                   detail if again == "trained" else f"{why} (refused for: {detail})")
            if not args.keep:
                shutil.rmtree(path, ignore_errors=True)
        counts[outcome] += 1
        print(f"| {model_type} | {outcome} | {detail[:160].replace('|', '/')} |", flush=True)
    print(f"\n{len(types)} types in {time.time() - start:.0f} s: " +
          ", ".join(f"{n} {o}" for o, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
