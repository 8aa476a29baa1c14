"""Cheap integrity checks of saved files, none of which reads a weight.

- A safetensors file starts with the length of its JSON header, and the header gives every tensor's byte range, so
  the file's exact size is known from its first bytes: a truncated (or appended-to) file is found without loading it.
- What a checkpoint's completeness marker records to check it later: the size of every file, and the SHA-256 of the
  small ones (JSON state, RNG, scheduler, adapter config, tokenizer files; everything up to SMALL_FILE_BYTES).
- A fingerprint of a base model's weights (tensor names, shapes and a few KiB of sampled tensors), the same however the
  weights are sharded, to tell whether a checkpoint was trained on this base.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SMALL_FILE_BYTES = 4 * 2 ** 20  # files up to this size get a checksum in the marker; larger ones their size
SAMPLED_TENSORS = 32  # tensors whose first bytes enter a base model's fingerprint
SAMPLE_BYTES = 4096
INDEX_FILE = "model.safetensors.index.json"


class HeaderError(ValueError):
    """A safetensors file whose header cannot be read; the message says what is wrong, without the path."""


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(offset of the data region, header) of a safetensors file, after checking the file is exactly as long as the
    header says. Raises HeaderError naming what is wrong."""
    try:
        size = os.path.getsize(path)
    except OSError as e:  # absent, or a link to a file that is gone (a Hub cache blob)
        raise HeaderError(f"cannot be read ({e.strerror or e})") from None
    if size == 0:
        raise HeaderError("is empty (0 bytes)")
    if size < 8:
        raise HeaderError(f"is {size} bytes, too short to hold a safetensors header")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            raise HeaderError(f"is truncated or not a safetensors file: {size:,} bytes, but its first bytes announce a "
                              f"{length:,}-byte header")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise HeaderError("has an unreadable header: damaged, or not a safetensors file") from None
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        raise HeaderError(f"is truncated: {size:,} bytes where its header describes {expected:,}")
    if size > expected:
        raise HeaderError(f"is {size:,} bytes where its header describes {expected:,} (extra bytes: damaged)")
    return 8 + length, header


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with a safetensors file (a phrase following its path), or None."""
    try:
        safetensors_header(path)
    except HeaderError as e:
        return str(e)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def json_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with a JSON file (a phrase following its path), or None."""
    try:
        json.loads(Path(path).read_bytes())
    except UnicodeDecodeError:
        return "is not UTF-8 text: damaged"
    except ValueError as e:
        if os.path.getsize(path) == 0:
            return "is empty (0 bytes)"
        return f"is not valid JSON ({getattr(e, 'msg', e)}; line {getattr(e, 'lineno', '?')}): damaged or cut short"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2 ** 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_records(folder: str | os.PathLike, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative path: {"size": bytes[, "sha256": hex]}} of every file under `folder` but `skip` and temporary files."""
    root = Path(folder)
    records = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name in skip or ".writing-" in path.name:
            continue
        size = path.stat().st_size
        records[path.relative_to(root).as_posix()] = (
            {"size": size, "sha256": sha256(path)} if size <= SMALL_FILE_BYTES else {"size": size})
    return records


def recorded_file_problems(folder: str | os.PathLike, records: dict[str, dict]) -> list[str]:
    """How the files under `folder` differ from what was recorded when it was written (one phrase per file)."""
    problems = []
    for name, record in records.items():
        path = Path(folder) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != record.get("size", size):
            problems.append(f"{name} is {size:,} bytes, {record['size']:,} when it was saved")
        elif "sha256" in record and sha256(path) != record["sha256"]:
            problems.append(f"{name} changed since it was saved (its SHA-256 differs)")
    return problems


def content_problems(folder: str | os.PathLike) -> list[str]:
    """Every safetensors file's size against its header, every JSON file readable (phrases naming the file)."""
    problems = []
    root = Path(folder)
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        name = path.relative_to(root).as_posix()
        why = safetensors_problem(path) if path.suffix == ".safetensors" else \
            json_problem(path) if path.suffix == ".json" else None
        if why:
            problems.append(f"{name} {why}")
    return problems


# --- which base model a checkpoint was trained on --------------------------------------------------------------------

def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors weight files of a model folder (model.safetensors, or the index's shards); [] if none."""
    root = Path(folder)
    if (root / "model.safetensors").is_file():  # transformers' order: the single file first
        return [root / "model.safetensors"]
    if (root / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [root / name for name in sorted(set(weight_map.values()))]
    return []


def weights_fingerprint(folder: str | os.PathLike) -> str | None:
    """SHA-256 of every tensor's name, dtype and shape plus the first SAMPLE_BYTES of SAMPLED_TENSORS of them (evenly
    spread in name order): the same for the same weights however they are sharded, different for another model or
    a fine-tune of it. None where the folder has no readable safetensors weights."""
    tensors = {}
    try:
        for path in weight_files(folder):
            start, header = safetensors_header(path)
            tensors.update({name: (path, start, info) for name, info in header.items() if name != "__metadata__"})
    except (OSError, HeaderError):
        return None
    if not tensors:
        return None
    names = sorted(tensors)
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}|{tensors[name][2]['dtype']}|{tensors[name][2]['shape']}\n".encode())
    step = max(1, len(names) // SAMPLED_TENSORS)
    for name in names[::step][:SAMPLED_TENSORS]:
        path, start, info = tensors[name]
        begin, end = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + begin)
            digest.update(f.read(min(SAMPLE_BYTES, end - begin)))
    return digest.hexdigest()
