"""Datasets: find them (Hub, save_to_disk folders, local files), check their columns, shape rows for TRL.

Rows in `messages` form stay conversational: TRL applies the tokenizer's chat template (and can then mask prompts).
Rows with a text column are used as they are.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .args import ConfigError, DataTrainingArguments

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MESSAGES = "messages"


def split_role(split: str) -> str | None:
    """Upstream's rule: a split named like 'train' trains, one named like 'test' evaluates."""
    if "train" in split:
        return "train"
    if "test" in split or "valid" in split or "eval" in split:
        return "test"
    return None


def requested_splits(data_args: DataTrainingArguments) -> list[str]:
    return [s.strip() for s in data_args.splits.split(",") if s.strip()]


def _local_split_source(root: Path, split: str) -> tuple[str, str] | None:
    """('disk', path) or (builder, file) for a split inside a local dataset folder, else None."""
    if (root / split).is_dir():
        return "disk", str(root / split)
    for suffix, builder in FILE_BUILDERS.items():
        if (root / f"{split}{suffix}").is_file():
            return builder, str(root / f"{split}{suffix}")
    return None


def locate_splits(data_args: DataTrainingArguments) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Map each requested split to where it will be read from, without reading it. Collects problems."""
    problems: list[str] = []
    sources: dict[str, tuple[str, str]] = {}
    splits = requested_splits(data_args)
    if not splits:
        return {}, [f"--splits '{data_args.splits}': name at least one split, e.g. --splits train,test."]
    for split in splits:
        if split_role(split) is None:
            problems.append(f"--splits: split '{split}' is neither a train split nor a test split (its name must "
                            "contain 'train', or 'test'/'valid'/'eval').")
    root = Path(data_args.dataset_name)
    if root.is_dir():
        if (root / "dataset_dict.json").is_file():
            for split in splits:
                sources[split] = ("disk_dict", str(root))
        else:
            for split in splits:
                source = _local_split_source(root, split)
                if source is None:
                    present = sorted(p.name for p in root.iterdir())
                    problems.append(
                        f"--dataset_name {root}: no split '{split}' there (looked for a save_to_disk folder "
                        f"'{split}/' or a file {split}.jsonl/.json/.parquet/.csv; found: {present[:10]})."
                    )
                else:
                    sources[split] = source
    elif root.is_file():
        builder = FILE_BUILDERS.get(root.suffix)
        if builder is None:
            problems.append(f"--dataset_name {root}: unsupported file type '{root.suffix}' (use jsonl/json/parquet/csv "
                            "or a folder).")
        else:
            for split in splits:
                sources[split] = (builder, str(root))
    elif os.path.sep in data_args.dataset_name.strip("/") and data_args.dataset_name.startswith((".", "/")):
        problems.append(f"--dataset_name {data_args.dataset_name}: no such file or folder.")
    else:
        for split in splits:
            sources[split] = ("hub", data_args.dataset_name)
    return sources, problems


def _read(source: tuple[str, str], split: str):
    from datasets import load_dataset, load_from_disk

    kind, where = source
    if kind == "disk":
        return load_from_disk(where)
    if kind == "disk_dict":
        return load_from_disk(where)[split]
    if kind == "hub":
        return load_dataset(where, split=split)
    return load_dataset(kind, data_files={split: where}, split=split)


def load_splits(data_args: DataTrainingArguments):
    """Read every requested split into a DatasetDict keyed 'train' / 'test' (upstream's keys)."""
    from datasets import DatasetDict, concatenate_datasets

    sources, problems = locate_splits(data_args)
    if problems:
        raise ConfigError(problems)
    by_role: dict[str, list] = {}
    for split, source in sources.items():
        try:
            dataset = _read(source, split)
        except Exception as e:  # offline Hub, missing split in a Hub dataset, unreadable file
            raise ConfigError([f"--dataset_name {data_args.dataset_name} split '{split}': could not be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."]) from None
        by_role.setdefault(split_role(split), []).append(dataset)
    return DatasetDict({role: parts[0] if len(parts) == 1 else concatenate_datasets(parts)
                        for role, parts in by_role.items()})


def column_problems(dataset, split: str, text_field: str, chat_template: str | None) -> list[str]:
    columns = dataset.column_names
    if MESSAGES in columns:
        if not chat_template:
            return [f"split '{split}' has `messages` rows but the tokenizer has no chat template. Fix: "
                    "--chat_template_format chatml (or zephyr)."]
        return []
    if text_field not in columns:
        return [f"split '{split}': neither a `messages` column nor the text column `{text_field}` "
                f"(--dataset_text_field). Columns: {columns}."]
    if len(dataset) == 0:
        return [f"split '{split}' is empty."]
    return []


def assistant_only_loss_problems(datasets, chat_template: str | None) -> list[str]:
    """TRL masks prompts from the loss using {% generation %} markers in the chat template of `messages` data."""
    problems = []
    if any(MESSAGES not in ds.column_names for ds in datasets.values()):
        problems.append("--assistant_only_loss True needs `messages` rows (it masks everything but the assistant "
                        "turns); this data is plain text. Fix: use chat data, or drop the flag.")
    elif "generation" not in (chat_template or ""):
        problems.append("--assistant_only_loss True: the tokenizer's chat template has no {% generation %} markers, "
                        "so TRL cannot tell assistant tokens apart. Fix: --chat_template_format chatml (or zephyr), "
                        "whose templates have them.")
    return problems


def prepare_for_trl(datasets, data_args: DataTrainingArguments, text_field: str, tokenizer,
                    assistant_only_loss: bool = False):
    """Keep only what TRL needs: the `messages` column, or the text column (BOS prepended if asked)."""
    problems = [p for role, ds in datasets.items()
                for p in column_problems(ds, role, text_field, tokenizer.chat_template)]
    if assistant_only_loss and not problems:
        problems += assistant_only_loss_problems(datasets, tokenizer.chat_template)
    if problems:
        raise ConfigError(problems)
    out = {}
    for role, ds in datasets.items():
        keep = MESSAGES if MESSAGES in ds.column_names else text_field
        ds = ds.remove_columns([c for c in ds.column_names if c != keep])
        if keep != MESSAGES and data_args.add_special_tokens and tokenizer.bos_token:
            bos = tokenizer.bos_token
            ds = ds.map(lambda row: {keep: row[keep] if row[keep].startswith(bos) else bos + row[keep]})
        out[role] = ds
    return out


def dataset_flag_notes(data_args: DataTrainingArguments, is_conversational: bool) -> list[str]:
    """What upstream's data flags do in this stack, said once so nobody relies on a no-op."""
    notes = []
    if not data_args.append_concat_token:
        notes.append("--append_concat_token False has no effect: TRL 1.16 ends every text example with EOS "
                     "(the separator packing relies on).")
    if data_args.add_special_tokens and is_conversational:
        notes.append("--add_special_tokens True has no effect on `messages` data: the chat template decides the "
                     "special tokens.")
    return notes
