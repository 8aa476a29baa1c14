"""The demo bundle on disk: its layout, the dataset writers, and an atomic, locked, stamped build.

``build_tiny`` writes the model, tokenizer and the same conversations as JSONL, ``save_to_disk`` folders, Parquet and
rendered CSV text; ``is_ready`` reads the stamp; ``load_conversations`` reads a split back.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_recipe.scoring import Conversation
from sft_recipe.tiny.build import build_model, build_tokenizer
from sft_recipe.tiny.facts import SPLITS, make_conversations

# Bump when anything that changes the built bytes changes (facts.py; the template, tokenizer or model recipe in
# build.py; the writers here), so that an existing build is no longer considered up to date.
BUILD_FORMAT_VERSION = 1

READY_FILE = "READY"


@dataclass(frozen=True)
class TinyPaths:
    """Where a built tiny bundle lives; every field is an absolute path."""

    root: Path
    model_dir: Path  # model weights, config and tokenizer (load both with `from_pretrained(model_dir)`)
    jsonl_dir: Path  # {train,test}.jsonl, one {"messages": [...]} per line
    disk_dir: Path  # {train,test}/ from `Dataset.save_to_disk`; pass as the recipe's --dataset_name
    parquet_dir: Path  # {train,test}.parquet with a `messages` column
    text_dir: Path  # {train,test}.csv with a `content` column of chat-template-rendered text

    @classmethod
    def under(cls, root: str | os.PathLike[str]) -> TinyPaths:
        """Paths of a bundle rooted at ``root`` (whether or not it has been built)."""
        root_path = Path(root).resolve()
        data = root_path / "data"
        return cls(
            root=root_path,
            model_dir=root_path / "model",
            jsonl_dir=data / "jsonl",
            disk_dir=data / "disk",
            parquet_dir=data / "parquet",
            text_dir=data / "text",
        )



def _write_data(paths: TinyPaths, tokenizer, seed: int) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    for directory in (paths.jsonl_dir, paths.disk_dir, paths.parquet_dir, paths.text_dir):
        directory.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        conversations = make_conversations(split, seed)
        rows = [{"messages": messages} for messages in conversations]

        with open(paths.jsonl_dir / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

        table = pa.Table.from_pylist(rows)
        pq.write_table(table, paths.parquet_dir / f"{split}.parquet")

        # datasets 5 fingerprints an in-memory table by content, so state.json is reproducible as it is.
        datasets.Dataset(table).save_to_disk(str(paths.disk_dir / split))

        with open(paths.text_dir / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["content"])
            for messages in conversations:
                writer.writerow([tokenizer.apply_chat_template(messages, tokenize=False)])


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # A few-second build needs no progress bars; restore the caller's settings afterwards.
    import datasets
    from transformers.utils import logging as hf_logging

    datasets_bars = datasets.is_progress_bar_enabled()
    transformers_bars = hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if datasets_bars:
            datasets.enable_progress_bars()
        if transformers_bars:
            hf_logging.enable_progress_bar()


def _build_into(paths: TinyPaths, *, hidden_size: int, num_hidden_layers: int, seed: int) -> None:
    tokenizer = build_tokenizer(seed)
    model = build_model(tokenizer, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, seed=seed)
    with _quiet_progress_bars():
        model.save_pretrained(str(paths.model_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(paths.model_dir))
        _write_data(paths, tokenizer, seed)


def _stamp(hidden_size: int, num_hidden_layers: int, seed: int) -> dict[str, Any]:
    return {
        "format_version": BUILD_FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "seed": seed,
    }


def _read_stamp(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / READY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _exclusive_lock(directory: Path) -> Iterator[None]:
    # Several ranks of a torchrun job may call build_tiny at once; the lock makes one build and the rest wait
    # and then find it ready.  Locking the parent directory itself (Linux flock accepts a directory descriptor)
    # leaves no lock file behind in the user's tree.
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _apply_umask_modes(tree: Path) -> None:
    # mkdtemp makes the folder private (0700) and some writers create 0600 files; give the bundle the modes a
    # plain mkdir/open would have, so that it can be shared like any other build output.
    umask = os.umask(0)
    os.umask(umask)
    tree.chmod(0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def build_tiny(
    output_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    seed: int = 0,
    force: bool = False,
) -> TinyPaths:
    """Build the tiny model, tokenizer and datasets under ``output_dir`` unless an identical build is there.

    The bundle is built in a temporary sibling folder and moved into place with ``os.replace`` only once complete
    (the ``READY`` stamp is its last file), so an interrupted build never leaves a folder that looks ready.
    An existing ``output_dir`` is replaced only if it is empty or is itself a bundle (has ``READY``); any other
    folder is left alone and an error is raised, so a mistyped path cannot wipe unrelated files.
    """
    paths = TinyPaths.under(output_dir)
    root = paths.root
    wanted = _stamp(hidden_size, num_hidden_layers, seed)
    root.parent.mkdir(parents=True, exist_ok=True)

    with _exclusive_lock(root.parent):
        if not force and _read_stamp(root) == wanted:
            return paths
        if root.exists() and any(root.iterdir()) and not (root / READY_FILE).exists():
            raise FileExistsError(f"{root} exists, is not empty and was not built by sft_recipe.tiny; not replacing it")

        # Under the lock no other build is running, so any temp folder left here is from a killed build.
        for stale in glob.glob(str(root.parent / f".{root.name}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)

        tmp_root = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            _build_into(
                TinyPaths.under(tmp_root), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, seed=seed
            )
            _apply_umask_modes(tmp_root)
            (tmp_root / READY_FILE).write_text(json.dumps(wanted, sort_keys=True) + "\n", encoding="utf-8")
            if root.exists():
                # os.replace cannot overwrite a non-empty directory: move the old bundle aside first.
                old_root = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-old-", dir=root.parent))
                os.replace(root, old_root / root.name)
                os.replace(tmp_root, root)
                shutil.rmtree(old_root, ignore_errors=True)
            else:
                os.replace(tmp_root, root)
        finally:
            if tmp_root.exists():
                shutil.rmtree(tmp_root, ignore_errors=True)
    return paths


def is_ready(
    output_dir: str | os.PathLike[str], *, hidden_size: int = 64, num_hidden_layers: int = 2, seed: int = 0
) -> bool:
    """Whether ``output_dir`` holds a complete bundle built with these parameters."""
    return _read_stamp(TinyPaths.under(output_dir).root) == _stamp(hidden_size, num_hidden_layers, seed)


def _as_paths(paths_or_dir: TinyPaths | str | os.PathLike[str]) -> TinyPaths:
    return paths_or_dir if isinstance(paths_or_dir, TinyPaths) else TinyPaths.under(paths_or_dir)


def load_conversations(paths_or_dir: TinyPaths | str | os.PathLike[str], split: str) -> list[Conversation]:
    """The conversations of ``split`` as stored in the bundle's JSONL file."""
    path = _as_paths(paths_or_dir).jsonl_dir / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def heldout_conversations(paths_or_dir: TinyPaths | str | os.PathLike[str]) -> list[Conversation]:
    """The test-split conversations: known facts asked with the held-out phrasing."""
    return load_conversations(paths_or_dir, "test")
