"""A recipe YAML's dataset mixture as the flags: lists for `dataset_name`/`dataset_proportions`, or TRL's own layout
(`datasets:` entries of `path` and `fraction`, TRL's DatasetMixtureConfig). The mixing itself is data/mixture.py."""

from __future__ import annotations


def mixture_as_flags(raw: dict, where: str, problems: list[str]) -> dict:
    """Several datasets in a recipe YAML: lists for `dataset_name`/`dataset_proportions`, or TRL's mixture layout
    (`datasets:` entries of `path` and `fraction`, read by TRL's own DatasetMixtureConfig), as the comma-separated
    flags."""
    raw = {key: ",".join(str(v) for v in value) if key in ("dataset_name", "dataset_proportions")
           and isinstance(value, list) else value for key, value in raw.items()}
    if "datasets" not in raw:
        return raw
    entries = raw.pop("datasets")
    from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig

    try:
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise TypeError("a list of mappings is expected, each with `path` (and `fraction`)")
        mixture = DatasetMixtureConfig(datasets=list(entries))
    except TypeError as e:
        problems.append(f"{where}: `datasets` is TRL's mixture list ({e}). Fix: `datasets: [{{path: a, fraction: "
                        "0.7}, {path: b, fraction: 0.3}]`.")
        return raw
    default = DatasetConfig(path="")
    for entry in mixture.datasets:
        others = [f for f in ("name", "data_dir", "data_files", "split", "columns")
                  if getattr(entry, f) != getattr(default, f)]
        if others:
            problems.append(f"{where}: `datasets` entry {entry.path}: {', '.join(others)} not supported here (the "
                            "recipe reads each source as --dataset_name does, its splits from --splits). Fix: keep "
                            "`path` and `fraction`; rename columns with dataset_column_map.")
    fractions = [entry.fraction for entry in mixture.datasets]
    if any(f is None for f in fractions) and any(f is not None for f in fractions):
        problems.append(f"{where}: `datasets`: `fraction` is given for some entries, not all (TRL's rule: all or "
                        "none).")
    if "dataset_name" in raw:
        problems.append(f"{where}: both `datasets` and `dataset_name` name the data. Fix: keep one.")
    raw["dataset_name"] = ",".join(entry.path for entry in mixture.datasets)
    if all(f is not None for f in fractions) and fractions:
        raw["dataset_proportions"] = ",".join(f"{f:g}" for f in fractions)
    return raw
