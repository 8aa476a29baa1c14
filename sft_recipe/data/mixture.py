"""Several datasets in one run: `--dataset_name a,b --dataset_proportions 0.7,0.3` (or TRL's `datasets:` list in a
recipe YAML, config/args.py).

Each source is read, recognised and checked exactly as a single dataset is (`prepare.prepare`: its format, its bad
rows named by file and line), then the converted sources are mixed. TRL's own mixture code (`trl.get_dataset`) reads
each source with `load_dataset` and keeps the first rows of each, so it fits neither the recipe's local folders and
per-row checks nor a seeded choice; its rule for the shares is kept: proportions are normalised, and the mixture is
the largest one that repeats no row (`rows_taken`). Which rows of a source are taken, and the order of the mixed
training rows (packing fills each packed row with neighbours: unshuffled, a packed row would hold one source), come
from --seed. Test splits are mixed whole. --eval_split_size carves the test split from the mixed training rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sft_recipe.config.args import DataTrainingArguments
from sft_recipe.data.formats import is_conversational
from sft_recipe.data.prepare import LoadedSplits, PreparedData, hold_out_eval_slice, locate_splits, prepare
from sft_recipe.errors import ConfigError


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
    """What TRL is given for a converted split: sources mix only when this is the same."""
    if fmt == "text":
        return "text rows"
    if fmt in ("messages", "sharegpt"):
        return "`messages` rows"
    conversational = is_conversational(fmt, dataset[0]) if len(dataset) else fmt == "alpaca"
    return f"{'conversational ' if conversational else ''}`prompt`/`completion` rows"


def prepare_sources(loaded: list[LoadedSplits], data_args: DataTrainingArguments, text_field: str, tokenizer,
                    assistant_only_loss: bool = False, seed: int = 42) -> PreparedData:
    """`prepare` for one source; for several, each source prepared on its own (every problem of every source listed
    together), then mixed."""
    if not is_mixture(data_args):
        return prepare(loaded[0], data_args, text_field, tokenizer, assistant_only_loss, seed)
    parts, problems = [], []
    for one, source in zip(source_args(data_args), loaded, strict=True):
        try:
            parts.append(prepare(source, one, text_field, tokenizer, assistant_only_loss, seed))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    mixed = mix(parts, source_names(data_args), proportions_of(data_args)[0], seed)
    return hold_out_eval_slice(mixed, data_args.eval_split_size, seed)


def mix(parts: list[PreparedData], names: list[str], shares: list[float] | None, seed: int) -> PreparedData:
    """The prepared sources as one: their training rows taken by `rows_taken` (chosen and ordered by `seed`), their
    test rows whole. Refused when the sources give TRL different shapes."""
    roles = list(parts[0].datasets)
    shapes = {name: _shape(part.formats["train"], part.datasets["train"]) for name, part in zip(names, parts)}
    if len(set(shapes.values())) > 1:
        raise ConfigError([f"--dataset_name {','.join(names)}: the sources give TRL different rows ("
                           + "; ".join(f"{n}: {shape} ({p.formats['train']})" for (n, shape), p in
                                       zip(shapes.items(), parts)) + "), and TRL trains one shape per run. Fix: mix "
                           "sources of one shape (messages and sharegpt give `messages`; alpaca and conversational "
                           "prompt/completion give conversational `prompt`/`completion`), or train them in turn "
                           "(--adapter_name_or_path continues from the first run's adapter)."])
    taken = rows_taken([len(part.datasets["train"]) for part in parts], shares)
    trains = [part.datasets["train"] if count == len(part.datasets["train"])
              else part.datasets["train"].shuffle(seed=seed).select(range(count))
              for part, count in zip(parts, taken, strict=True)]
    datasets = {"train": _concatenate(trains, names).shuffle(seed=seed)}
    for role in roles:
        if role != "train":
            datasets[role] = _concatenate([part.datasets[role] for part in parts], names)
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
