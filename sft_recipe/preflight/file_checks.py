"""Damaged and mismatched files, found before any weight loads: each named with what is wrong and the fix.

- The base model folder (a local path): config.json readable (`config_file_problems`), weights present and whole
  (every safetensors file's size against its header, every shard its index names, and those shards hold the tensors
  the index says), tokenizer files present and readable (`file_problems`). A Hub id's files are checked by its
  download.
- The checkpoint a resume continues: trained on this base, with this LoRA shape (`resume_match`).
- Once the tokenizer is loaded (`check_tokenizer`, still before any weight): a tokenizer far smaller than the
  model's embeddings (another model's), and a resume with another tokenizer size.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from sft_recipe.artifacts.integrity import INDEX_FILE, HeaderError, json_problem, safetensors_header
from sft_recipe.config.args import ModelArguments
from sft_recipe.errors import ConfigError, check_not_run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tekken.json")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")  # sentencepiece (spiece.model, sentencepiece.bpe.model, ...), tiktoken
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
SMALLER_VOCAB_RATIO = 0.9  # padded embeddings have a few hundred spare rows (Phi-2: 905 of 51200), never 10%


def _fetch_again(m: ModelArguments, what: str) -> str:
    return (f"Fix: download or copy {what} again (e.g. `hf download <repo> --local-dir {m.model_name_or_path}`, "
            "which fetches only what is missing or differs).")


def _safetensors_problems(m: ModelArguments, folder: Path) -> list[str]:
    index = folder / INDEX_FILE
    flag = f"--model_name_or_path {m.model_name_or_path}"
    if (folder / "model.safetensors").exists() or not index.is_file():  # transformers' order: the single file first
        path = folder / "model.safetensors"
        try:
            safetensors_header(path)
        except HeaderError as e:
            return [f"{flag}: {path} {e} (an interrupted download or copy). {_fetch_again(m, 'it')}"]
        return []
    if (why := json_problem(index)) is not None:
        return [f"{flag}: {index} {why}. {_fetch_again(m, 'it')}"]
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{flag}: {index} has no weight_map naming the shards. {_fetch_again(m, 'it')}"]
    problems = []
    for shard in sorted(set(weight_map.values())):
        path = folder / shard
        if not path.is_file():
            problems.append(f"{flag}: {index} names {shard}, which is absent (an interrupted download or copy). "
                            f"{_fetch_again(m, 'the missing shard')}")
            continue
        try:
            header = safetensors_header(path)[1]
        except HeaderError as e:
            problems.append(f"{flag}: {path} {e} (an interrupted download or copy). {_fetch_again(m, 'that shard')}")
            continue
        missing = sorted(name for name, file in weight_map.items() if file == shard and name not in header)
        if missing:
            problems.append(f"{flag}: {index} puts {len(missing)} tensor(s) in {shard} that it does not hold "
                            f"(first: {missing[0]}): the index and the shards do not belong together. "
                            f"{_fetch_again(m, 'the index and its shards')}")
    return problems


def _pickle_weight_problems(m: ModelArguments, folder: Path) -> list[str]:
    """pytorch_model.bin (a zip archive, torch.save): whether the archive is whole, read from its directory only."""
    names = ["pytorch_model.bin"]
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        if (why := json_problem(index)) is not None:
            return [f"--model_name_or_path {m.model_name_or_path}: {index} {why}. {_fetch_again(m, 'it')}"]
        names = sorted(set((json.loads(index.read_text()).get("weight_map") or {}).values()))
    problems = []
    for name in names:
        path = folder / name
        if not path.is_file():
            problems.append(f"--model_name_or_path {m.model_name_or_path}: {index.name} names {name}, which is absent. "
                            f"{_fetch_again(m, 'the missing shard')}")
        elif not zipfile.is_zipfile(path):
            problems.append(f"--model_name_or_path {m.model_name_or_path}: {path} is truncated or damaged (not a whole "
                            f"torch.save archive, {path.stat().st_size:,} bytes). {_fetch_again(m, 'it')}")
    return problems


def _local_base(m: ModelArguments) -> tuple[Path | None, set[str]]:
    """(the base model's folder, its file names); None where it is not a local base model folder (a Hub id, no such
    path, or an adapter folder, whose base transformers resolves)."""
    folder = Path(m.model_name_or_path) if m.model_name_or_path else None
    if folder is None or not folder.is_dir():
        return None, set()
    files = {p.name for p in folder.iterdir()}
    if "adapter_config.json" in files and "config.json" not in files:
        return None, set()
    return folder, files


def config_file_problems(m: ModelArguments) -> list[str]:
    """A local base folder's config.json present and readable: every check of the model's shape reads it."""
    folder, _ = _local_base(m)
    if folder is None:
        return []
    config = folder / "config.json"
    if not config.is_file():
        return [f"--model_name_or_path {m.model_name_or_path}: no config.json, so this is not a model folder (or an "
                f"incomplete download). {_fetch_again(m, 'the model')}"]
    if (why := json_problem(config)) is not None:
        return [f"--model_name_or_path {m.model_name_or_path}: {config} {why}. {_fetch_again(m, 'it')}"]
    return []


def base_folder_problems(m: ModelArguments, weights: bool = True, tokenizer: bool = True) -> list[str]:
    """A local base folder's weights and tokenizer files present and whole. Reads headers only."""
    folder, files = _local_base(m)
    if folder is None:
        return []
    problems = []
    if not weights:
        pass
    elif "model.safetensors" in files or INDEX_FILE in files:
        problems += _safetensors_problems(m, folder)
    elif "pytorch_model.bin" in files or "pytorch_model.bin.index.json" in files:
        problems += _pickle_weight_problems(m, folder)
    elif not any(name.endswith(WEIGHT_SUFFIXES) for name in files):
        problems.append(f"--model_name_or_path {m.model_name_or_path}: no weights there (model.safetensors, "
                        f"{INDEX_FILE} with its shards, or pytorch_model.bin). {_fetch_again(m, 'the model')}")
    if tokenizer:
        problems += _tokenizer_file_problems(m, folder, files)
    return problems


def _tokenizer_file_problems(m: ModelArguments, folder: Path, files: set[str]) -> list[str]:
    flag = f"--model_name_or_path {m.model_name_or_path}"
    fix = (f"Fix: copy the base model's own tokenizer files into {folder} (e.g. `hf download <repo> --include "
           f"'tokenizer*' --local-dir {folder}`); the recipe loads the tokenizer from --model_name_or_path.")
    present = [name for name in files if name in TOKENIZER_FILES or name.endswith(TOKENIZER_SUFFIXES)]
    if not present:
        return [f"{flag}: no tokenizer files there (looked for {', '.join(TOKENIZER_FILES[:4])}, ...). {fix}"]
    problems = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name in files and (why := json_problem(folder / name)) is not None:
            problems.append(f"{flag}: {folder / name} {why}. {fix}")
    return problems


def file_problems(m: ModelArguments, d, r, t) -> list[str]:
    """validate's hook (its config.json read): the base folder's weights and tokenizer files, then (with the files
    whole) the resume's base and LoRA shape. --plan_memory_gib reads the config alone (a config-only folder plans),
    --preview_examples the tokenizer: what they never load is not asked for."""
    plan, preview = bool(getattr(r, "plan_memory_gib", None)), bool(getattr(d, "preview_examples", 0))
    if plan:
        return []
    problems = base_folder_problems(m, weights=not preview)
    if problems or not getattr(t, "resume_from_checkpoint", None):
        return problems
    from sft_recipe.artifacts.checkpoints import resolve_resume
    from sft_recipe.artifacts.resume_match import resume_mismatch_problems

    checkpoint = resolve_resume(t.resume_from_checkpoint, t.output_dir)[0]  # its own problems: validate's
    return resume_mismatch_problems(checkpoint, m, bool(getattr(t, "trust_remote_code", False)))


def check_tokenizer(m: ModelArguments, tokenizer, resume_from: str | None, trust_remote_code: bool = False) -> None:
    """Raise ConfigError where the loaded tokenizer does not fit the model or the resumed checkpoint (no weights)."""
    from sft_recipe.artifacts.resume_match import tokenizer_size_problems

    problems = tokenizer_size_problems(resume_from, tokenizer)
    try:
        from sft_recipe.model.shape import read_config

        config = read_config(m.model_name_or_path, trust_remote_code)
        rows = getattr(config.get_text_config(), "vocab_size", None)
    except Exception as e:  # noqa: BLE001 -- said; validate reported an unreadable config
        check_not_run("the tokenizer-vs-embeddings size check", e)
        rows = None
    if rows and len(tokenizer) < SMALLER_VOCAB_RATIO * rows:
        problems.append(f"--model_name_or_path {m.model_name_or_path}: its tokenizer has {len(tokenizer)} tokens but "
                        f"the model's embeddings have {rows} rows (config.json vocab_size): far more than padding "
                        "explains, so the tokenizer belongs to another model and its ids would train the wrong rows. "
                        "Fix: put the model's own tokenizer files in the folder (e.g. `hf download <repo> --include "
                        f"'tokenizer*' --local-dir {m.model_name_or_path}`).")
    if rows and len(tokenizer) > rows:
        from sft_recipe.model.family_rules import token_table_problems

        problems += token_table_problems(m, len(tokenizer) - rows, trust_remote_code)
    if problems:
        raise ConfigError(problems)
