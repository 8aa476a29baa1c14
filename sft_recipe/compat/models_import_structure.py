"""transformers reads every model file to import any one model.

Behaviour (transformers 5.24): `transformers/models/__init__.py` builds its lazy module from
`define_import_structure(__file__)`, which opens and reads every `.py` file of the ~400 model folders (2,600 files)
for its `__all__` and backends. That is 0.24 s of CPU in every process that loads a model, config or tokenizer class:
every rank of every launch, every merge, every memory plan. (transformers PR #44253 made the directory walk faster;
the reads remain.)

What this does: before transformers.models is imported, `define_import_structure` answers for that one file from a
JSON copy of the structure the scan returned, kept in the user's cache folder (`$XDG_CACHE_HOME/sft_recipe/`, else
`~/.cache/sft_recipe/`) under a key made of transformers' version and every model file's path, size and modification
time (a 15 ms walk): an edited, added or removed file is another key, so a stale structure is never read. The first
process to miss scans as before and writes the copy (atomically; two ranks racing write the same bytes). Where the
folder cannot be read or written, the scan runs as before. Every other call is transformers' own.

When it can go: tests/unit/test_compat.py::test_transformers_still_scans_every_model_file_to_import_its_models fails
(transformers.models no longer builds its structure by reading the files at import).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_models_import_structure(cache_dir: Path) -> bool:
    """Process-wide, before transformers.models is imported, with the copies kept in `cache_dir`
    (config.launch_env.recipe_cache_dir); True once installed (False where it was imported already: nothing left to
    save)."""
    import sys

    if "transformers.models" in sys.modules:
        return False
    import transformers
    from transformers.utils import import_utils

    original = import_utils.define_import_structure
    if getattr(original, "_sft_recipe_cached", False):
        return True
    models_init = os.path.join(os.path.dirname(transformers.__file__), "models", "__init__.py")

    def define_import_structure(module_path, prefix=None):
        if prefix is not None or os.path.abspath(module_path) != models_init:
            return original(module_path, prefix)
        return cached_structure(Path(models_init).parent, transformers.__version__, lambda: original(module_path),
                                cache_dir)

    define_import_structure._sft_recipe_cached = True
    import_utils.define_import_structure = define_import_structure
    return True


def cached_structure(models_dir: Path, version: str, scan, cache_dir: Path) -> dict:
    """The import structure of `models_dir`: read from the cache where its key matches, else `scan()`, written."""
    path = cache_dir / f"transformers-{version}-models-{_fingerprint(models_dir)}.json"
    try:
        return _decode(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent (the first process), unreadable or not ours: scan
    structure = scan()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(_encode(structure)))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only or full home: every process scans, as without this
    return structure


def _fingerprint(models_dir: Path) -> str:
    """Every .py file under models_dir (the files the scan reads): relative path, size, modification time."""
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(models_dir):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            stat = os.stat(os.path.join(folder, name))
            digest.update(f"{os.path.relpath(os.path.join(folder, name), models_dir)}:{stat.st_size}:"
                          f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _encode(structure: dict) -> list:
    """{frozenset(backends): {module: {names}}} as JSON: sorted lists."""
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]


def _decode(encoded: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in encoded}
