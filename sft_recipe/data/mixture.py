"""Several datasets in one run: `--dataset_name a,b --dataset_proportions 0.7,0.3` (or TRL's `datasets:` list in a
recipe YAML, config/args.py).

Each source is read, recognised and checked exactly as a single dataset is (`prepare.prepare`: its format, its bad
rows named by file and line), then the converted sources are mixed. TRL's own mixture code (`trl.get_dataset`) reads
each source with `load_dataset` and keeps the first rows of each, so it fits neither the recipe's local folders and
per-row checks nor a seeded choice; its rule for the shares is kept: proportions are normalised, and the mixture is
the largest one that repeats no row (`rows_taken`). Which rows of a source are taken, and the order of the mixed
training rows (packing fills each packed row with neighbours: unshuffled, a packed row would hold one source), come
from --seed. Test splits are mixed whole. --eval_split_size carves the test split from the mixed training rows.

Sources of different shapes (a chat, prompt/completion rows, plain text) mix as the one shape every format reaches:
TRL's own tokens. Each source's taken rows go through TRL's preparation as that source alone would (`tokenize`: the
chat template for a chat, loss on the completion for prompt/completion rows, every token of a text row), and the
mixture is of `input_ids`/`labels` rows, which TRL then only cuts or packs: what carries loss in each source is what
it trains alone, by construction. Sources of one shape mix as rows, which TRL tokenizes as one dataset. Every mixed
row keeps the index of its source (SOURCE_COLUMN), so that the data report counts each source's loss tokens; TRL
drops that column before the model (it is no model input).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from sft_recipe.config.args import DataTrainingArguments
from sft_recipe.data.formats import detect_format, is_conversational, rename_columns
from sft_recipe.data.prepare import LoadedSplits, PreparedData, hold_out_eval_slice, locate_splits, prepare
from sft_recipe.errors import ConfigError

SOURCE_COLUMN = "sft_recipe_source"  # the --dataset_name index of a mixed row's source (data/report.py counts by it)
TOKENS = ["input_ids", "labels"]  # what TRL's preparation gives every format: the shape sources of any format mix as


def source_names(data_args: DataTrainingArguments) -> list[str]:
    """The sources of --dataset_name: one, or a comma-separated list (a path that exists is one source, commas and
    all)."""
    name = data_args.dataset_name
    if "," not in name or Path(name).exists():
        return [name]
    return [part.strip() for part in name.split(",") if part.strip()]


def is_mixture(data_args: DataTrainingArguments) -> bool:
    return len(source_names(data_args)) > 1


def proportions_of(data_args: DataTrainingArguments) -> tuple[list[float] | None, list[str]]:
    """(--dataset_proportions as numbers, or None when not given; problems)."""
    text = getattr(data_args, "dataset_proportions", "") or ""
    if not text.strip():
        return None, []
    names = source_names(data_args)
    flag = f"--dataset_proportions {text}"
    try:
        shares = [float(part) for part in text.split(",")]
    except ValueError:
        return None, [f"{flag}: give one number per --dataset_name source, comma-separated (e.g. 0.7,0.3)."]
    if len(names) == 1:
        return None, [f"{flag}: --dataset_name names one source ({names[0]}); proportions mix several. Fix: "
                      "--dataset_name a,b with one share each, or drop --dataset_proportions."]
    problems = []
    if len(shares) != len(names):
        problems.append(f"{flag}: {len(shares)} share(s) for {len(names)} sources ({', '.join(names)}). Fix: one "
                        "share per source, in the same order.")
    if any(not share > 0 or share == float("inf") for share in shares):
        problems.append(f"{flag}: every share must be a positive number (a source with no share: leave it out of "
                        "--dataset_name).")
    return (None if problems else shares), problems


def mixture_problems(data_args: DataTrainingArguments) -> list[str]:
    """Everything about the sources that can be said without reading a row: each one located as a single dataset
    would be, the proportions, no source twice."""
    names = source_names(data_args)
    problems = proportions_of(data_args)[1]
    if len(names) != len(set(names)):
        twice = sorted({n for n in names if names.count(n) > 1})
        problems.append(f"--dataset_name {data_args.dataset_name}: {', '.join(twice)} named twice. Fix: name each "
                        "source once and give it a larger share with --dataset_proportions.")
    for one in source_args(data_args):
        problems += locate_splits(one)[1]
    return problems


def source_args(data_args: DataTrainingArguments) -> list[DataTrainingArguments]:
    """One set of data flags per source (the flags themselves for a single dataset). The eval slice is carved from
    the mixture, not from each source."""
    if not is_mixture(data_args):
        return [data_args]
    return [dataclasses.replace(data_args, dataset_name=name, dataset_proportions="", eval_split_size=None)
            for name in source_names(data_args)]


def rows_taken(rows: list[int], shares: list[float] | None) -> list[int]:
    """Training rows taken from each source: all of them without shares; with shares, TRL's rule (trl.get_dataset):
    normalised, and the total as large as it can be without any source giving more rows than it has."""
    if shares is None:
        return list(rows)
    weights = [share / sum(shares) for share in shares]
    total = min(count / weight for count, weight in zip(rows, weights, strict=True))
    return [min(count, round(weight * total)) for count, weight in zip(rows, weights, strict=True)]


def _shape(fmt: str, dataset) -> str:
    """What TRL is given for a converted split: sources of the same shape mix as rows, others as TRL's tokens."""
    if fmt == "text":
        return "text rows"
    if fmt in ("messages", "sharegpt"):
        return "`messages` rows"
    conversational = is_conversational(fmt, dataset[0]) if len(dataset) else fmt == "alpaca"
    return f"{'conversational ' if conversational else ''}`prompt`/`completion` rows"


def loss_rule_problems(loaded: list[LoadedSplits], data_args: DataTrainingArguments, text_field: str,
                       assistant_only_loss: bool) -> list[str]:
    """The one combination whose loss rule a mixture cannot keep: --assistant_only_loss (loss on the assistant turns
    of chat rows) beside a source with no turns (text, plain prompt/completion), which that flag refuses alone. Read
    from the sources' columns and first rows, before any is checked or converted; a source whose format cannot be
    told is left to its own checks."""
    if not assistant_only_loss:
        return []
    chat, plain = [], []
    for name, one, source in zip(source_names(data_args), source_args(data_args), loaded, strict=True):
        train = source.datasets.get("train")
        if train is None or len(train) == 0:
            continue
        try:
            train = rename_columns(train, "train", one)
            fmt = detect_format(train.column_names, "train", text_field, one.dataset_format)[0]
        except ConfigError:
            continue
        (chat if is_conversational(fmt, train[0]) else plain).append(f"{name} ({fmt})")
    if not chat or not plain:
        return []  # all chat: the flag applies to each; none: each source's own check refuses the flag
    return [f"--assistant_only_loss True with --dataset_name {data_args.dataset_name}: it trains the assistant turns "
            f"of the chat sources ({', '.join(chat)}), but {', '.join(plain)} has no turns, and mixed in, every "
            "token of its rows would carry loss (the flag refuses such a source alone). Fix: drop "
            "--assistant_only_loss (chat sources then train every token, prompt/completion sources their "
            "completions), give those sources as `messages` or conversational prompt/completion rows, or leave "
            "them out of --dataset_name."]


def prepare_sources(loaded: list[LoadedSplits], data_args: DataTrainingArguments, text_field: str, tokenizer,
                    assistant_only_loss: bool = False, seed: int = 42,
                    tokenize: Callable | None = None) -> PreparedData:
    """`prepare` for one source; for several, each source prepared on its own (every problem of every source listed
    together), then mixed. `tokenize(dataset, role, chat_template)`: TRL's preparation of one source's rows, for
    sources of different shapes (data/prepared_copy.py gives it)."""
    if not is_mixture(data_args):
        return prepare(loaded[0], data_args, text_field, tokenizer, assistant_only_loss, seed)
    problems = loss_rule_problems(loaded, data_args, text_field, assistant_only_loss)
    if problems:
        raise ConfigError(problems)
    parts = []
    for one, source in zip(source_args(data_args), loaded, strict=True):
        try:
            parts.append(prepare(source, one, text_field, tokenizer, assistant_only_loss, seed))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    mixed = mix(parts, source_names(data_args), proportions_of(data_args)[0], seed, tokenize)
    return hold_out_eval_slice(mixed, data_args.eval_split_size, seed)


def _rows_of(part: PreparedData, role: str, index: int, count: int, seed: int, tokenize: Callable | None):
    """`count` rows of a source's split (chosen by `seed` when fewer than it has), as TRL's tokens when `tokenize`
    is given, marked with the source's index. The mark is written by a map, so that the rows and it stay in one
    table (the prepared copy links a split's Arrow files)."""
    rows = part.datasets[role]
    if count != len(rows):
        rows = rows.shuffle(seed=seed).select(range(count))
    if tokenize is not None:
        rows = tokenize(rows, role, part.chat_template).select_columns(TOKENS)
    return rows.map(_mark_source, fn_kwargs={"index": index}, batched=True, desc="Marking each row's source")


def _mark_source(batch: dict, index: int) -> dict:
    return {SOURCE_COLUMN: [index] * len(next(iter(batch.values())))}


def mix(parts: list[PreparedData], names: list[str], shares: list[float] | None, seed: int,
        tokenize: Callable | None = None) -> PreparedData:
    """The prepared sources as one: their training rows taken by `rows_taken` (chosen and ordered by `seed`), their
    test rows whole; as rows when the sources give TRL one shape, as TRL's tokens (`tokenize`) when not."""
    roles = list(parts[0].datasets)
    shapes = {name: _shape(part.formats["train"], part.datasets["train"]) for name, part in zip(names, parts)}
    as_tokens = len(set(shapes.values())) > 1
    if as_tokens and tokenize is None:
        raise TypeError("sources of different shapes mix as TRL's tokens: mix() needs `tokenize`")
    taken = rows_taken([len(part.datasets["train"]) for part in parts], shares)
    step = tokenize if as_tokens else None
    trains = [_rows_of(part, "train", n, count, seed, step) for n, (part, count) in enumerate(zip(parts, taken))]
    datasets = {"train": _concatenate(trains, names).shuffle(seed=seed)}
    for role in roles:
        if role != "train":
            datasets[role] = _concatenate([_rows_of(part, role, n, len(part.datasets[role]), seed, step)
                                           for n, part in enumerate(parts)], names)
    kinds = list(dict.fromkeys(part.formats["train"] for part in parts))
    described = f"--dataset_proportions {','.join(f'{s:g}' for s in shares)}" if shares else "every row of each"
    sources = [{"name": name, "format": part.formats["train"], "rows_read": part.rows_read["train"],
                "rows_dropped": part.rows_dropped["train"], "train_rows": count,
                "train_share": round(count / sum(taken), 4),
                "test_rows": len(part.datasets["test"]) if "test" in part.datasets else None}
               for name, part, count in zip(names, parts, taken, strict=True)]
    notes = [f"data: {name}: {note.removeprefix('data: ')}" for name, part in zip(names, parts) for note in part.notes]
    notes.append(f"data: mixed {len(parts)} sources ({described}, seed {seed}): "
                 + ", ".join(f"{s['name']} {s['train_rows']} of {s['rows_read'] - s['rows_dropped']} train rows"
                             for s in sources))
    if as_tokens:
        notes.append("data: the sources give TRL different rows (" + "; ".join(f"{n}: {shape}" for n, shape in
                     shapes.items()) + "): each source's rows were tokenized by TRL as that source alone would be "
                     "(its own loss rule), and the mixture is of those tokens")
    return PreparedData(datasets=datasets, formats={role: "+".join(kinds) for role in datasets}, notes=notes,
                        rows_read={role: sum(p.rows_read[role] for p in parts) for role in datasets},
                        rows_dropped={role: sum(p.rows_dropped[role] for p in parts) for role in datasets},
                        chat_template=parts[0].chat_template, mixture=sources)


def _concatenate(splits: list, names: list[str]):
    """One split of the sources' rows. Messages whose keys differ between sources (a `name` in one) get every
    source's keys, absent ones null: what `datasets` does with such rows in one file."""
    from datasets import Features, concatenate_datasets

    try:
        return concatenate_datasets(splits)
    except ValueError:
        pass
    try:
        union = Features(_union_of([split.features for split in splits]))
    except ValueError as e:
        raise ConfigError([f"--dataset_name {','.join(names)}: the sources' columns cannot be put in one table ({e}"
                           f"; columns: " + "; ".join(f"{n}: {dict(s.features)}" for n, s in zip(names, splits))
                           + "). Fix: give the sources the same fields (--dataset_column_map), or train them in "
                           "turn."]) from None
    return concatenate_datasets([split if split.features == union else
                                 split.map(lambda row: row, features=union, desc="Aligning the sources' fields")
                                 for split in splits])


def _union_of(features: list):
    """The features every one of `features` fits in: structs get every key, lists the union of their items."""
    from datasets import LargeList, List

    first, *rest = features
    if all(isinstance(f, dict) for f in features):
        keys = dict.fromkeys(key for f in features for key in f)
        return {key: _union_of([f[key] for f in features if key in f]) for key in keys}
    for kind in (List, LargeList):
        if all(isinstance(f, kind) for f in features):
            return kind(_union_of([f.feature for f in features]))
    if all(f == first for f in rest):
        return first
    raise ValueError(f"{first} and {next(f for f in rest if f != first)} differ")
