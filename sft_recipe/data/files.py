"""Local data files checked before they are read: empty, not UTF-8, not a whole Parquet file, compressed; and a file
`datasets` could not read named with the reason underneath its own wrapper error.

Files may be gzip-compressed (`train.jsonl.gz`, `train.csv.gz`, ...): `datasets` reads them. Gzip data under a plain
`.jsonl` name is read by the recipe's own line reader (`open_binary`), under another plain name refused.
"""

from __future__ import annotations

import codecs
import gzip
import os
import zlib
from pathlib import Path

GZIP_MAGIC = b"\x1f\x8b"
PARQUET_MAGIC = b"PAR1"
ENCODING_FIX = "Fix: save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`, from its real encoding)"


class DataFileError(ValueError):
    """A data file that cannot be read; the message names the file, what is wrong and the fix."""


def is_gzip(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_binary(path: str | os.PathLike):
    """The file's bytes, decompressed when it is gzip data (whatever its name)."""
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def split_suffix(path: str | os.PathLike) -> str:
    """'.jsonl' for train.jsonl and for train.jsonl.gz."""
    suffixes = Path(path).suffixes
    return "".join(suffixes[-2:-1]) if suffixes[-1:] == [".gz"] else "".join(suffixes[-1:])


def decode_line(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None), or (None, why) for a line that is not UTF-8."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"


def first_non_utf8(path: str | os.PathLike) -> tuple[int, str] | None:
    """(line, why) of the first line that is not UTF-8 text, or None: decoded in blocks (fast), located by lines."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open_binary(path) as f:
        try:
            for block in iter(lambda: f.read(1 << 22), b""):
                decoder.decode(block)
            decoder.decode(b"", final=True)
            return None
        except UnicodeDecodeError:
            pass
    with open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            if (why := decode_line(raw)[1]) is not None:
                return number, why
    return -1, "not UTF-8 text (it ends in the middle of a character)"


def check_file(path: str, builder: str, split: str) -> bool:
    """Raise DataFileError for a file that cannot be read as `builder`; True where a JSON-lines file is to be read
    line by line: it has lines that are not UTF-8 (reported as bad rows with their numbers), or it is gzip data under a
    plain .jsonl name (`datasets` would keep reading its first decompressed copy after the file changes)."""
    size = os.path.getsize(path)
    if size == 0:
        raise DataFileError(f"{path}: the file is empty (0 bytes), so split '{split}' has no rows. Fix: write the "
                            "split's rows into it (or copy it again), or leave the split out of --splits.")
    try:
        if builder == "parquet":
            with open(path, "rb") as f:
                head = f.read(4)
                f.seek(max(0, size - 4))
                tail = f.read(4)
            if head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
                what = ("gzip data, not Parquet" if head[:2] == GZIP_MAGIC else
                        "not Parquet (no 'PAR1' marker at its start)" if head != PARQUET_MAGIC else
                        "a Parquet file cut short (no 'PAR1' marker at its end: an interrupted write or copy)")
                raise DataFileError(f"{path}: {what}, {size:,} bytes. Fix: write or copy it again (e.g. "
                                    "`df.to_parquet(...)`), or give the rows as JSON lines.")
            return False
        hidden_gzip = is_gzip(path) and not str(path).endswith(".gz")
        if hidden_gzip and split_suffix(path) != ".jsonl":
            raise DataFileError(f"{path}: gzip data under a {split_suffix(path)} name (`datasets` reads it only under "
                                f"a .gz name). Fix: rename it to {Path(path).name}.gz, or decompress it (`gunzip -c`).")
        found = first_non_utf8(path)
    except (OSError, EOFError, zlib.error) as e:  # a damaged or truncated gzip file
        raise DataFileError(f"{path}: a damaged or truncated gzip file ({type(e).__name__}: {e}). Fix: compress or "
                            "copy it again, or give it uncompressed.") from None
    if builder == "json" and split_suffix(path) == ".jsonl" and (found or hidden_gzip):
        return True  # `datasets` keeps the first decompressed copy of a gzip file named .jsonl, even once it changed
    if found is None:
        return False
    line, why = found
    raise DataFileError(f"{path} line {line}: {why}. {ENCODING_FIX}.")


def read_error(path: str, builder: str, error: Exception) -> str:
    """Why `datasets` could not read a local file: the innermost error of its chain (DatasetGenerationError wraps
    the parser's), with the fix."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    reason = str(error).splitlines()[0] if str(error) else ""
    kind = {"json": "JSON", "csv": "CSV", "parquet": "Parquet"}.get(builder, builder)
    return (f"{path}: could not be read as {kind} ({type(error).__name__}: {reason}). Fix: check that it is a "
            f"whole {kind} file (copy or write it again), or give the rows as JSON lines.")
