"""The data, prepared once per machine and kept: read, every row checked, converted, tokenized by TRL's own
preparation -- by one process, which saves the result in datasets' cache (`HF_DATASETS_CACHE`, by default
~/.cache/huggingface/datasets) under sft_recipe_prepared/<key>/; every other rank reads that.

Who prepares: the global main process first; then each machine's local main reads the copy (a cache on a shared
filesystem) or, where the cache is its own disk, prepares it too; then everyone else reads it. The preparing
process tells the others how it went by message (a collective, not a barrier), so a bad row found there stops every
rank with exit 2, and a rank never waits for a process that has already failed.

Any later launch on the same data -- a resume, a second run into another output_dir, a sweep, another rank count --
reads the copy when nothing that decides it changed (the key: the data files' paths, sizes and modification times,
the tokenizer's files, the format flags, and the versions of the libraries that tokenize), and prepares it again
when something did. `--max_seq_len`, packing and the batch are not in the key: the copy is uncut and unpacked, TRL
cuts or packs it when the trainer starts (its own cache files go beside the copy), and the data report, measured
from it, is kept beside it per cut and packing. Copies are not removed: delete the folder to reclaim the space.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from sft_recipe.compat import installed_version
from sft_recipe.config.args import DataTrainingArguments
from sft_recipe.data.mixture import is_mixture, prepare_sources, source_args
from sft_recipe.data.prepare import PreparedData, locate_splits, read_splits
from sft_recipe.errors import ConfigError, error_chain, is_disk_full

logger = logging.getLogger(__name__)

PREPARED_DIR = "sft_recipe_prepared"  # under datasets' cache folder
META_FILE = "prepared.json"
FORMAT_VERSION = 3  # bump when what is saved, or how the rows are prepared, changes
MIN_ROWS_PER_PROCESS = 1000  # below this a worker's start-up costs more than its share of the tokenizing saves
VERSIONED = ("trl", "datasets", "transformers", "tokenizers", "jinja2")


def tokenizing_processes(rows: int, dataset_num_proc: int | None, sharing: int = 1) -> int:
    """Processes that tokenize: --dataset_num_proc, else this machine's CPUs shared among the `sharing` ranks that
    prepare at the same time on it, never fewer than MIN_ROWS_PER_PROCESS rows each."""
    wanted = dataset_num_proc or len(os.sched_getaffinity(0)) // max(1, sharing)
    return max(1, min(wanted, rows // MIN_ROWS_PER_PROCESS))


def _file_identity(path: Path) -> list:
    """(relative name, size, mtime in ns) of a file, or of every file under a folder but the map caches `datasets`
    writes beside a saved dataset (cache-*.arrow: written by the preparation itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                 and not p.name.startswith("cache-"))
    return [(str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in files]


def _tokenizer_identity(tokenizer) -> str:
    """A hash of the files the tokenizer saves (vocabulary, merges, special tokens, chat template)."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="tokenizer-key-") as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def preparation_key(data_args: DataTrainingArguments, training_args, tokenizer, hub_fingerprints=None) -> str:
    """What decides the prepared rows, hashed. Hub datasets are named by `datasets`' own fingerprints of what it
    read (`hub_fingerprints`), since a name does not pin a revision."""
    sources = [{split: [kind, where] + ([] if kind == "hub" else _file_identity(Path(where)))
                for split, (kind, where) in sorted(locate_splits(one)[0].items())} for one in source_args(data_args)]
    identity = {
        "format_version": FORMAT_VERSION,
        "sources": sources[0] if len(sources) == 1 else sources,
        "hub": hub_fingerprints or {},
        "data_flags": {k: v for k, v in vars(data_args).items() if k != "preview_examples"},
        "trl_flags": {k: getattr(training_args, k, None) for k in
                      ("dataset_text_field", "assistant_only_loss", "completion_only_loss")},
        # the seed picks the rows --eval_split_size holds out and a mixture's rows (and only then decides the copy)
        "carve_seed": training_args.seed if getattr(data_args, "eval_split_size", None) is not None
        or is_mixture(data_args) else None,
        "tokenizer": _tokenizer_identity(tokenizer),
        "versions": {name: str(installed_version(name)) for name in VERSIONED},
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def copy_root() -> Path:
    """Where copies live: datasets' own cache folder (HF_DATASETS_CACHE), where its map caches go too."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / PREPARED_DIR


def load_copy(key: str, folder: Path | None = None) -> PreparedData | None:
    """The copy prepared under `key` (in `folder`, else in copy_root()), else None (none yet, or unreadable: then it
    is prepared again)."""
    folder = copy_root() / key if folder is None else folder
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if meta.get("key") != key:
            return None
        parts = meta.get("parts", {})
        tokenized = {role: _read_split(folder / role, parts.get(role)) for role in meta["roles"]}
    except Exception:  # noqa: BLE001 -- missing, half-copied by hand, another datasets version: prepare again
        return None
    return PreparedData(datasets={}, formats=meta["formats"], notes=meta["notes"], rows_read=meta["rows_read"],
                        rows_dropped=meta["rows_dropped"], chat_template=meta["chat_template"], tokenized=tokenized,
                        reports=meta.get("reports", {}), copy_dir=str(folder), carved=meta.get("carved"),
                        mixture=meta.get("mixture"))


def _write_split(dataset, folder: Path) -> list[str] | None:
    """The split's Arrow files as TRL's last map wrote them, hard-linked into `folder` (no byte copied, no byte read:
    a copy would read and write the whole split again), or copied where the cache is another filesystem. A split
    that is not wholly those files (rows in memory, a row selection on top) is saved with `save_to_disk` instead
    (returns None)."""
    from sft_recipe.data.report import arrow_files

    files = arrow_files(dataset)
    if files is None or sum(_rows_in(f) for f in files) != len(dataset):
        dataset.save_to_disk(str(folder))
        return None
    folder.mkdir(parents=True)
    names = []
    for n, source in enumerate(files):
        names.append(f"part-{n:05d}.arrow")
        try:
            os.link(source, folder / names[-1])
        except OSError:  # another filesystem, or links not allowed: a copy
            shutil.copyfile(source, folder / names[-1])
    return names


def _rows_in(path: str) -> int:
    from datasets import Dataset

    return len(Dataset.from_file(path))


def _read_split(folder: Path, parts: list[str] | None):
    """A split written by `_write_split`: its linked Arrow files, memory-mapped. Every column TRL's map kept: the
    trainer checks the rows' own (a conversation, under --assistant_only_loss) before it sees the tokens."""
    from datasets import Dataset, concatenate_datasets, load_from_disk

    if parts is None:
        return load_from_disk(str(folder))
    splits = [Dataset.from_file(str(folder / name)) for name in parts]
    dataset = splits[0] if len(splits) == 1 else concatenate_datasets(splits)
    return dataset


def save_copy(data: PreparedData, key: str) -> bool:
    """Write the tokenized splits and what the log and report need under copy_root()/<key>, in one step (a sibling
    folder renamed into place): a reader sees the whole copy or none. An unreadable copy of the same key is moved
    out of the way first; one another process wrote meanwhile is kept. False when it could not be written (a full
    disk, a read-only cache): the run goes on, and the other ranks prepare their own."""
    root = copy_root()
    folder, tmp, old = root / key, root / f".{key}.writing-{os.getpid()}", root / f".{key}.old-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        parts = {role: _write_split(dataset, tmp / role) for role, dataset in data.tokenized.items()}
        meta = {"key": key, "roles": list(data.tokenized), "parts": parts, "formats": data.formats,
                "notes": data.notes, "rows_read": data.rows_read, "rows_dropped": data.rows_dropped,
                "chat_template": data.chat_template, "carved": data.carved, "mixture": data.mixture}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        if folder.exists() and load_copy(key) is None:
            folder.rename(old)  # damaged: replaced
        try:
            tmp.rename(folder)
        except OSError:  # a second launch on the same data got there first (a sweep): its copy is the same
            if load_copy(key) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as e:  # a full disk, or Ctrl-C while writing: no half-written folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        logger.warning(f"data: could not keep the prepared data in {folder} ({e.strerror or e}); this launch goes "
                       "on with it in the datasets cache, and a later one prepares it again.")
        return False
    shutil.rmtree(old, ignore_errors=True)
    return True


def _report_key(training_args) -> str:
    """What decides a copy's report: the cut and the packing (the trainer's counts too: order does not change them)."""
    return json.dumps([training_args.max_length, bool(training_args.packing), training_args.packing_strategy,
                       training_args.truncation_mode, FORMAT_VERSION])


def _keep_report(data: PreparedData, training_args, report) -> None:
    from sft_recipe.atomic import write_atomically

    if data.copy_dir is None:
        return
    meta_path = Path(data.copy_dir) / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
        meta.setdefault("reports", {})[_report_key(training_args)] = json.loads(report.to_json())
        write_atomically(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    except (OSError, ValueError):  # a read-only or full cache: measured again next time
        pass


def measure_report(data: PreparedData, tokenizer, training_args):
    """The data report for this launch's cut and packing: the one measured on this copy before with the same
    settings (a resume reads no token), else measured now and kept beside the copy for the next launch."""
    from sft_recipe.data.report import DataReport, measure

    if (kept := data.reports.get(_report_key(training_args))) is not None:
        return DataReport.from_dict(kept)
    report = measure(data, tokenizer, training_args)
    _keep_report(data, training_args, report)
    return report


def confirm_report(report, data: PreparedData, train_dataset, training_args, is_main_process: bool) -> None:
    """The trainer's own token counts beside the prediction (data/report.py `confirm`): read from the trainer's rows
    once per copy and cut, then kept with the report (a resume reads no token)."""
    from sft_recipe.data.report import confirm

    if not is_main_process:
        return
    if report.trainer_check is not None and report.trainer_check["matches_prediction"]:
        return  # measured by an earlier launch on the same rows, and data_report.json already holds it
    confirm(report, train_dataset, training_args.output_dir, is_main_process)
    _keep_report(data, training_args, report)


def tokenize(data: PreparedData, tokenizer, training_args, sharing: int = 1) -> PreparedData:
    """Every split through TRL's preparation (data/report.py `tokenize_like_trl`), on this machine's cores."""
    from sft_recipe.data.report import tokenize_like_trl

    for role, dataset in data.datasets.items():
        processes = tokenizing_processes(len(dataset), training_args.dataset_num_proc, sharing)
        logger.info(f"data: tokenizing split '{role}' ({len(dataset)} rows) with {processes} process(es) "
                    f"(--dataset_num_proc {training_args.dataset_num_proc or 'unset: this machine has'} "
                    f"{len(os.sched_getaffinity(0))} CPUs, at least {MIN_ROWS_PER_PROCESS} rows each)")
        data.tokenized[role] = tokenize_like_trl(dataset, tokenizer, training_args, data.chat_template,
                                                 processes if processes > 1 else None, name=role)
    return data


def _cache_unwritable(error: BaseException) -> bool:
    """The datasets cache cannot take what datasets writes there: full (ENOSPC, a quota), read-only, not ours."""
    return is_disk_full(error) or any(isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
                                      for e in error_chain(error))


def prepare_here(data_args: DataTrainingArguments, training_args, tokenizer, sharing: int = 1,
                 peer_copy: str | None = None) -> tuple[PreparedData, bool]:
    """(the data, whether it was read from a copy): the copy under its key, or read, checked, converted,
    tokenized and saved. Where datasets cannot write its cache (a full disk, a home quota, a read-only folder),
    the data is prepared again in a temporary cache for this launch alone, with one warning naming the folder;
    nothing is kept for the next launch then. `peer_copy`: the folder where this machine's first rank kept the copy
    (its temporary cache, when datasets' cannot be written), read when this rank finds none of its own."""
    import datasets

    try:
        return _prepare_here(data_args, training_args, tokenizer, sharing, peer_copy)
    except Exception as e:  # noqa: BLE001 -- only an unwritable cache is handled; anything else is raised as it was
        if not _cache_unwritable(e):
            raise
        cache = Path(datasets.config.HF_DATASETS_CACHE)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
    temporary = Path(tempfile.mkdtemp(prefix="sft-recipe-datasets-"))
    logger.warning(f"data: datasets could not write its cache in {cache} ({first}); this launch prepares the data "
                   f"in {temporary} (removed at exit) and keeps no copy for the next one. Fix: free space there, or "
                   "point HF_DATASETS_CACHE at a folder with room.")
    datasets.config.HF_DATASETS_CACHE = temporary  # what load_dataset, the maps and copy_root() use from here on
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    try:
        return _prepare_here(data_args, training_args, tokenizer, sharing)
    except Exception as e:  # noqa: BLE001 -- the temporary folder's disk is full too: name it, not the project's
        if not is_disk_full(e):
            raise
        raise OSError(errno.ENOSPC, f"No space left on device for datasets' cache in {cache} nor in {temporary}",
                      str(temporary / PREPARED_DIR)) from e


def _prepare_here(data_args: DataTrainingArguments, training_args, tokenizer, sharing: int = 1,
                  peer_copy: str | None = None) -> tuple[PreparedData, bool]:
    loaded = None
    hub = None
    sources = source_args(data_args)  # one per --dataset_name source
    if any(kind == "hub" for one in sources for kind, _ in locate_splits(one)[0].values()):
        loaded = [read_splits(one) for one in sources]  # a Hub name pins no revision: key by what datasets read
        hub = {(role if len(loaded) == 1 else f"{n}:{role}"): ds._fingerprint
               for n, one in enumerate(loaded) for role, ds in one.datasets.items()}
    key = preparation_key(data_args, training_args, tokenizer, hub)
    if (copy := load_copy(key)) is not None:
        return copy, True
    if peer_copy and Path(peer_copy).name == key and (copy := load_copy(key, Path(peer_copy))) is not None:
        return copy, True
    def tokenize_source(dataset, role: str, chat_template: str | None):
        """One source of a mixture through TRL's preparation, as that source alone is (tokenize, below)."""
        from sft_recipe.data.report import tokenize_like_trl

        processes = tokenizing_processes(len(dataset), training_args.dataset_num_proc, sharing)
        return tokenize_like_trl(dataset, tokenizer, training_args, chat_template,
                                 processes if processes > 1 else None, name=role)

    data = prepare_sources(loaded or [read_splits(one) for one in sources], data_args,
                           training_args.dataset_text_field, tokenizer,
                           assistant_only_loss=training_args.assistant_only_loss, seed=training_args.seed,
                           tokenize=tokenize_source)
    tokenize(data, tokenizer, training_args, sharing)
    if save_copy(data, key) and (saved := load_copy(key)):
        data = saved  # read back: the trainer's cuts and packing are then cached beside the copy, for every rank
    return data, False


def prepare_data(data_args: DataTrainingArguments, training_args, tokenizer, launch) -> PreparedData:
    """The data for this launch, prepared by one process per machine (see the module's docstring). Its
    `preparation` says which ranks prepared it and which read a copy, for the log and the run record."""
    def work(told: list):
        start = time.perf_counter()
        # The other ranks of a machine read the copy its first rank kept, in datasets' cache or, where that could
        # not be written, in its temporary one (told: each rank's copy folder); only where it could keep none do
        # they prepare, at the same time, each with its share of the machine's CPUs.
        local_main = told[launch.rank - launch.local_rank] if launch.local_rank else None
        sharing = max(1, (launch.local_world_size or 1) - 1) if launch.local_rank != 0 else 1
        data, reused = prepare_here(data_args, training_args, tokenizer, sharing, peer_copy=local_main)
        return data, ("read" if reused else "prepared", round(time.perf_counter() - start, 2))

    data, mine = in_rank_order(work, launch, tell=lambda result: result[0].copy_dir)
    everyone = _gather(mine)
    data.preparation = {
        "prepared_on_ranks": [rank for rank, (action, _) in enumerate(everyone) if action == "prepared"],
        "read_copy_on_ranks": [rank for rank, (action, _) in enumerate(everyone) if action == "read"],
        "seconds_per_rank": [seconds for _, seconds in everyone],
    }
    if launch.is_main_process:
        logger.info(describe(data.preparation, data.copy_dir or "nowhere: it could not be kept"))
    return data


def describe(preparation: dict, where) -> str:
    prepared, read = preparation["prepared_on_ranks"], preparation["read_copy_on_ranks"]
    seconds = preparation["seconds_per_rank"]
    if not prepared:
        return f"data: read the copy a previous launch prepared ({where}: same data files, tokenizer and flags)"
    said = (f"data: prepared by rank {', '.join(map(str, prepared))} in {max(seconds[r] for r in prepared):.1f} s, "
            f"kept in {where}")
    if read:
        said += f"; rank {', '.join(map(str, read))} read it"
    return said


def in_rank_order(work, launch, tell=lambda result: None):
    """`work(told)` on the global main process, then on each machine's local main, then on the others; `told` holds,
    by rank, what `tell(result)` gave on the ranks whose turn came before (None elsewhere). A ConfigError (or any
    failure) where it runs first is raised on every rank, so all stop together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return work([None])
    turns = (launch.rank == 0, launch.local_rank == 0 and launch.rank != 0, launch.local_rank != 0)
    result, told = None, [None] * dist.get_world_size()
    for mine in turns:
        outcome = None
        if mine:
            try:
                result = work(told)
                outcome = ("told", tell(result))
            except ConfigError as e:
                outcome = ("config", e.problems)
            except Exception as e:  # noqa: BLE001 -- told to the others, then raised here
                outcome = ("failed", f"{type(e).__name__}: {e}")
                _gather(outcome)
                raise
        outcomes = _gather(outcome)
        failure = next((o for o in outcomes if o is not None and o[0] != "told"), None)
        if failure is not None:
            kind, what = failure
            if kind == "config":
                raise ConfigError(what)
            raise ConfigError([f"the data could not be prepared on another rank ({what}); its log says more."])
        told = [o[1] if o is not None else before for o, before in zip(outcomes, told)]
    return result


def _gather(value) -> list:
    """`value` of every rank, by rank (this one's alone without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
