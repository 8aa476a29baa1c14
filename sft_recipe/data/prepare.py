"""Datasets: find them (Hub, save_to_disk folders, local files), check their columns, shape rows for TRL.

Rows in `messages` form stay conversational: TRL applies the tokenizer's chat template (and can then mask prompts).
Rows with a text column are used as they are.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from sft_recipe.config.args import DataTrainingArguments
from sft_recipe.data.checks import scan_json_lines
from sft_recipe.errors import ConfigError

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
                 ".jsonl.gz": "json", ".json.gz": "json", ".csv.gz": "csv"}  # gzip: datasets decompresses
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


def eval_split_problems(data_args: DataTrainingArguments, splits: list[str]) -> list[str]:
    """--eval_split_size: a share in (0, 1) or a whole number of rows, and no test split read beside it."""
    size = getattr(data_args, "eval_split_size", None)
    if size is None:
        return []
    problems = []
    if not (0 < size < 1 or (size >= 1 and float(size).is_integer())):
        problems.append(f"--eval_split_size {size:g}: give a share of the training rows between 0 and 1 (e.g. 0.05) "
                        "or a whole number of rows (e.g. 500).")
    tests = [s for s in splits if split_role(s) == "test"]
    if tests:
        problems.append(f"--eval_split_size {size:g} carves the test split from the training rows, but --splits "
                        f"'{data_args.splits}' also reads {', '.join(repr(t) for t in tests)}: one or the other. "
                        "Fix: --splits train (keep --eval_split_size), or drop --eval_split_size.")
    return problems


def carve_eval_split(datasets: dict, size: float, seed: int) -> dict:
    """The test split taken from the training rows by datasets' own train_test_split (shuffled by `seed`: the same
    rows for the same seed, disjoint from what is trained). Returns what the data report says of it."""
    rows = len(datasets["train"])
    count = int(size) if size >= 1 else math.ceil(size * rows)
    if not 1 <= count < rows:
        raise ConfigError([f"--eval_split_size {size:g}: {count} of the {rows} training rows would be held out, "
                           "leaving " + ("nothing to train on" if count >= rows else "no test rows") + ". Fix: a "
                           "smaller share or count (or more rows)."])
    parts = datasets["train"].train_test_split(test_size=count, seed=seed, shuffle=True)
    datasets["train"], datasets["test"] = parts["train"], parts["test"]
    return {"from": "train", "eval_split_size": size, "seed": seed, "rows": count}


def locate_splits(data_args: DataTrainingArguments) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Map each requested split to where it will be read from, without reading it. Collects problems."""
    problems: list[str] = []
    sources: dict[str, tuple[str, str]] = {}
    splits = requested_splits(data_args)
    if not splits:
        return {}, [f"--splits '{data_args.splits}': name at least one split, e.g. --splits train,test."]
    for split in splits:
        if split_role(split) is None:
            problems.append(f"--splits: split '{split}' is neither a train split nor a test split. Fix: a split whose "
                            "name contains 'train', or 'test'/'valid'/'eval'.")
    problems += eval_split_problems(data_args, splits)
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
                        f"'{split}/' or a file {split}.jsonl/.json/.parquet/.csv, or one of those .gz; found: "
                        f"{present[:10]}). Fix: --splits with the splits that are there."
                    )
                else:
                    sources[split] = source
    elif root.is_file():
        suffix = "".join(root.suffixes[-2:]) if root.suffix == ".gz" else root.suffix
        builder = FILE_BUILDERS.get(suffix)
        if builder is None:
            problems.append(f"--dataset_name {root}: unsupported file type '{suffix}' (use jsonl/json/parquet/csv, "
                            "optionally .gz, or a folder).")
        else:
            for split in splits:
                sources[split] = (builder, str(root))
    elif os.path.sep in data_args.dataset_name.strip("/") and data_args.dataset_name.startswith((".", "/")):
        problems.append(f"--dataset_name {data_args.dataset_name}: no such file or folder. Fix: the path of a dataset "
                        "folder or file, or a Hub dataset name.")
    else:
        for split in splits:
            sources[split] = ("hub", data_args.dataset_name)
    return sources, problems


@dataclass
class Origin:
    """Where a run of rows of a role's dataset came from, so that a bad row is named by its file and line."""

    label: str  # a file path, or "<dataset> split 'train'"
    start: int  # index of its first row in the role's dataset
    rows: int
    path: str | None = None  # a JSON-lines file: rows are named by line number
    lines: list[int] | None = None  # the line of each row; read from `path` when first needed

    def name(self, k: int) -> str:
        if self.path is None:
            return f"{self.label} row {k + 1}"
        if self.lines is None:
            self.lines = scan_json_lines(self.path)[0]
        return f"{self.label} line {self.lines[k]}"


@dataclass
class LoadedSplits:
    datasets: object  # DatasetDict keyed 'train' / 'test'
    origins: dict[str, list[Origin]] = field(default_factory=dict)
    bad_lines: dict[str, list[str]] = field(default_factory=dict)  # malformed JSON lines, per role

    def where(self, role: str):
        def name(i: int) -> str:
            for origin in self.origins.get(role, []):
                if origin.start <= i < origin.start + origin.rows:
                    return origin.name(i - origin.start)
            return f"split '{role}' row {i + 1}"
        return name


def _read(source: tuple[str, str], split: str, origin: Origin) -> tuple[object, list[str]]:
    """(dataset, malformed-line problems). A JSON-lines file that `datasets` cannot read (malformed lines, values
    of changing types) is read line by line instead, so that every row can still be checked and all problems
    reported at once."""
    from datasets import load_dataset, load_from_disk

    from sft_recipe.data.files import check_file, split_suffix

    kind, where = source
    if kind == "disk":
        return load_from_disk(where), []
    if kind == "disk_dict":
        return load_from_disk(where)[split], []
    if kind == "hub":
        return load_dataset(where, split=split), []
    if check_file(where, kind, split):  # lines that are not UTF-8: read line by line, reported as bad rows
        return _read_json_lines(where, origin)
    try:
        return load_dataset(kind, data_files={split: where}, split=split), []
    except Exception:
        if split_suffix(where) != ".jsonl":
            raise
    return _read_json_lines(where, origin)


def _read_json_lines(path: str, origin: Origin) -> tuple[object, list[str]]:
    """The rows of the lines that parse, every column typed `Json` (any value, as written), and the others' problems."""
    from datasets import Dataset, Features
    from datasets.features import Json

    from sft_recipe.data.files import open_binary

    lines, bad = scan_json_lines(path)
    keep = set(lines)
    with open_binary(path) as f:
        rows = [json.loads(line) for number, line in enumerate(f, start=1) if number in keep]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    origin.lines = lines
    dataset = Dataset.from_list(rows, features=Features({c: Json() for c in columns}))
    return dataset, [f"{path} line {n}: {why}" for n, why in bad]


def load_splits(data_args: DataTrainingArguments):
    """Read every requested split into a DatasetDict keyed 'train' / 'test' (upstream's keys)."""
    return read_splits(data_args).datasets


def read_splits(data_args: DataTrainingArguments) -> LoadedSplits:
    """load_splits, keeping where each row came from (file and line) for the row checks."""
    from datasets import DatasetDict, concatenate_datasets

    from sft_recipe.data.files import DataFileError, read_error, split_suffix

    sources, problems = locate_splits(data_args)
    if problems:
        raise ConfigError(problems)
    loaded = LoadedSplits(DatasetDict())
    by_role: dict[str, list] = {}
    for split, source in sources.items():
        role = split_role(split)
        start = sum(len(d) for d in by_role.get(role, []))
        is_file = source[0] not in ("disk", "disk_dict", "hub")
        origin = Origin(source[1] if is_file else f"{data_args.dataset_name} split '{split}'", start, 0,
                        path=source[1] if is_file and split_suffix(source[1]) == ".jsonl" else None)
        try:
            dataset, bad = _read(source, split, origin)
        except DataFileError as e:  # empty, not UTF-8, not a whole Parquet file, a damaged gzip
            raise ConfigError([str(e)]) from None
        except Exception as e:  # offline Hub, missing split in a Hub dataset, unreadable file
            if is_file:
                raise ConfigError([read_error(source[1], source[0], e)]) from None
            raise ConfigError([f"--dataset_name {data_args.dataset_name} split '{split}': could not be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."]) from None
        origin.rows = len(dataset)
        by_role.setdefault(role, []).append(dataset)
        loaded.origins.setdefault(role, []).append(origin)
        loaded.bad_lines.setdefault(role, []).extend(bad)
    loaded.datasets = DatasetDict({role: parts[0] if len(parts) == 1 else concatenate_datasets(parts)
                                   for role, parts in by_role.items()})
    return loaded


def dataset_flag_notes(data_args: DataTrainingArguments, is_conversational: bool) -> list[str]:
    """What upstream's data flags do in this stack, said once so nobody relies on a no-op."""
    notes = []
    # Conversational rows end as the chat template says: the EOS question does not arise, so nothing to say there
    # (the demo would otherwise warn about a default it never chose).
    if not data_args.append_concat_token and not is_conversational:
        notes.append("--append_concat_token False has no effect: TRL 1.16 ends every text example with EOS "
                     "(the separator packing relies on).")
    if data_args.add_special_tokens and is_conversational:
        notes.append("--add_special_tokens True has no effect on `messages` data: the chat template decides the "
                     "special tokens.")
    return notes


@dataclass
class PreparedData:
    """The splits in TRL's shape, and what was done to get there (for the log and the data report)."""

    datasets: dict  # role -> Dataset
    formats: dict[str, str]  # role -> format name (data_formats.FORMATS)
    notes: list[str]  # the format found and how it was converted: one line for the splits that share it
    rows_read: dict[str, int]
    rows_dropped: dict[str, int]  # bad rows (and malformed lines) dropped by --drop_bad_rows
    chat_template: str | None = None  # what TRL renders chat rows with instead of the tokenizer's (None: its own)
    tokenized: dict = field(default_factory=dict)  # role -> the rows as TRL tokenizes them, uncut (prepared_copy)
    preparation: dict = field(default_factory=dict)  # which ranks prepared the data, which read it (prepared_copy)
    reports: dict = field(default_factory=dict)  # data reports measured on this copy, by what decides them
    copy_dir: str | None = None  # the folder the tokenized splits were read from (prepared_copy)
    carved: dict | None = None  # the test split held out of train by --eval_split_size (carve_eval_split)
    mixture: list[dict] | None = None  # several --dataset_name sources: each one's rows and share (data/mixture.py)


def _assistant_only_loss_problems(formats: dict[str, str], conversational: dict[str, bool],
                                  tokenizer) -> tuple[str | None, list[str]]:
    """TRL masks prompts from the loss using {% generation %} markers in the chat template of conversational rows.
    Returns (the template TRL will use in place of the tokenizer's, or None; problems)."""
    if not all(conversational.values()):
        plain = sorted({formats[role] for role, conv in conversational.items() if not conv})
        return None, [f"--assistant_only_loss True needs `messages` rows or another conversational format (it masks "
                      f"everything but the assistant turns); this data is {', '.join(plain)} (not conversational). "
                      "Fix: use chat data, or drop the flag (prompt/completion rows are trained on the completion "
                      "only anyway)."]
    from sft_recipe.data.chat_templates import assistant_only_loss_template

    return assistant_only_loss_template(tokenizer)  # as SFTTrainer.__init__ will choose it, or why it cannot


def prepare(loaded: LoadedSplits, data_args: DataTrainingArguments, text_field: str, tokenizer,
            assistant_only_loss: bool = False, seed: int = 42) -> PreparedData:
    """Detect each split's format, check every row (listing all problems, or dropping bad rows when asked), then
    convert to TRL's shape. Needs the tokenizer (for its chat template), never the model."""
    from sft_recipe.data.checks import by_position, check_split, raise_problems
    from sft_recipe.data.formats import (
        convert,
        detect_format,
        is_conversational,
        parse_mapping,
        rename_columns,
        role_map,
    )

    # The flags' own syntax first: a malformed map is one problem, not one per split.
    problems = role_map(data_args, "messages")[1] + parse_mapping("dataset_column_map", data_args.dataset_column_map)[1]
    if data_args.preview_examples < 0:
        problems.append(f"--preview_examples {data_args.preview_examples}: give a number of examples to show (e.g. 3), "
                        "or 0 to train.")
    if problems:
        raise ConfigError(problems)
    datasets, formats, notes, roles, conversational = {}, {}, {}, {}, {}
    for role, ds in loaded.datasets.items():
        if len(ds) == 0:  # before its columns are read: an empty file has none
            where = ", ".join(o.label for o in loaded.origins.get(role, [])) or f"split '{role}'"
            problems.append(f"{where}: split '{role}' has no rows. Fix: put the split's rows there, or leave it out "
                            "of --splits" + (" (and --eval_strategy no)." if role == "test" else "."))
            continue
        try:
            ds = rename_columns(ds, role, data_args)
            formats[role], note = detect_format(ds.column_names, role, text_field, data_args.dataset_format)
        except ConfigError as e:
            problems += e.problems
            continue
        notes.setdefault(note, []).append(role)
        datasets[role] = ds
        conversational[role] = is_conversational(formats[role], ds[0])
        if conversational[role] and not tokenizer.chat_template:
            problems.append(f"split '{role}' has {formats[role]} rows (`messages` rows for the chat template) but the "
                            "tokenizer has no chat template. Fix: --chat_template_format chatml (or zephyr).")
        roles[role] = role_map(data_args, formats[role])[0]
    chat_template = None
    if assistant_only_loss and not problems:
        chat_template, template_problems = _assistant_only_loss_problems(formats, conversational, tokenizer)
        problems += template_problems
    if problems:
        raise ConfigError(problems)

    rows_read = {role: len(ds) + len(loaded.bad_lines.get(role, [])) for role, ds in datasets.items()}
    checks = {role: check_split(ds, formats[role], loaded.where(role), roles[role], text_field, tokenizer,
                                assistant_only_loss, conversational[role], chat_template)
              for role, ds in datasets.items()}
    row_problems = {role: by_position(loaded.bad_lines.get(role, []) + check.problems)
                    for role, check in checks.items()}
    if any(row_problems.values()) and not data_args.drop_bad_rows:
        raise_problems([p for ps in row_problems.values() for p in ps],
                       sum(len(ps) for ps in row_problems.values()), sum(rows_read.values()),
                       set().union(*(check.unknown_roles for check in checks.values())))
    dropped = {}
    for role, ds in datasets.items():
        bad = set(checks[role].bad_rows)
        dropped[role] = len(row_problems[role])
        if bad:
            ds = ds.select([i for i in range(len(ds)) if i not in bad])
        if dropped[role]:
            if len(ds) == 0:
                raise ConfigError([f"split '{role}': every row is bad (first: {row_problems[role][0]}); nothing "
                                   "is left to train on after --drop_bad_rows."])
            logger.warning(f"--drop_bad_rows: dropped {dropped[role]} of {rows_read[role]} rows of split '{role}' "
                           f"(first: {row_problems[role][0]}).")
        bos = tokenizer.bos_token if formats[role] == "text" and data_args.add_special_tokens else None
        datasets[role] = convert(ds, formats[role], roles[role], text_field, bos)
    lines = [f"data: {'split' if len(r) == 1 else 'splits'} {', '.join(r)}: {note}" for note, r in notes.items()]
    return hold_out_eval_slice(PreparedData(datasets, formats, lines, rows_read, dropped, chat_template),
                               getattr(data_args, "eval_split_size", None), seed)


def hold_out_eval_slice(data: PreparedData, eval_split_size: float | None, seed: int) -> PreparedData:
    """--eval_split_size: the test split carved from the prepared training rows (of one source, or of a mixture),
    with the counts and the log line that say so."""
    if eval_split_size is None:
        return data
    data.carved = carve = carve_eval_split(data.datasets, eval_split_size, seed)
    data.formats["test"], data.rows_dropped["test"] = data.formats["train"], 0
    data.rows_read["test"] = carve["rows"]
    data.rows_read["train"] -= carve["rows"]
    data.notes.append(f"data: split test: {carve['rows']} rows held out of train by --eval_split_size "
                      f"{eval_split_size:g} (seed {seed}): evaluated on, never trained on")
    return data


def prepare_for_trl(datasets, data_args: DataTrainingArguments, text_field: str, tokenizer,
                    assistant_only_loss: bool = False):
    """prepare() for splits read without their origins (rows are then named by split and row number)."""
    return prepare(LoadedSplits(datasets), data_args, text_field, tokenizer, assistant_only_loss).datasets
