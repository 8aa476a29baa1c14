"""transformers reads every model file to import itself, and again to import any one model.

Behaviour (transformers 5.24): `import transformers` builds its lazy module from
`define_import_structure(<package>/models, prefix="models")`, and `transformers/models/__init__.py` builds its own
from `define_import_structure(__file__)`: each opens and reads every `.py` file of the ~400 model folders (1,700
files) for its `__all__` and backends. That is ~0.24 CPU-s a scan, twice in every process that loads a model,
config or tokenizer class: every rank of every launch, every merge, every memory plan. (transformers PR #44253 made
the directory walk faster; the reads remain.)

What this does: before transformers is imported, a one-shot import hook wraps `define_import_structure` the moment
`transformers.utils.import_utils` has run (transformers' own `__init__` imports it before its scan), so both calls
answer from a JSON copy of the structure the scan returned, kept in the user's cache folder
(`$XDG_CACHE_HOME/sft_recipe/`, else `~/.cache/sft_recipe/`) under a key made of transformers' version, the call's
prefix and every model file's path, size and modification time (a 15 ms walk, once a process): an edited, added or
removed file is another key, so a stale structure is never read. The first process to miss scans as before and
writes the copy (atomically; two ranks racing write the same bytes). Where the folder cannot be read or written, the
scan runs as before. Every other call is transformers' own. Where transformers was imported already, only the
models package's scan is left to save.

When it can go: tests/unit/test_compat.py::test_transformers_still_scans_every_model_file_to_import_its_models fails
(transformers no longer builds its structures by reading the model files at import).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
from pathlib import Path


def cache_models_import_structure(cache_dir: Path) -> bool:
    """Process-wide, before transformers is imported, with the copies kept in `cache_dir`
    (config.launch_env.recipe_cache_dir); True once installed (False where transformers.models was imported already:
    nothing left to save)."""
    if "transformers.models" in sys.modules:
        return False
    name = "transformers.utils.import_utils"
    if name in sys.modules:  # transformers itself scanned already: the models' scan is left
        _wrap(sys.modules[name], cache_dir)
    else:  # transformers' __init__ imports import_utils, then scans: wrapped in between
        _around_module_run(name, lambda run, module: (run(module), _wrap(module, cache_dir)))
    return True


def _wrap(import_utils, cache_dir: Path) -> None:
    original = import_utils.define_import_structure
    if getattr(original, "_sft_recipe_cached", False):
        return
    models_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(import_utils.__file__))), "models")
    models_init = os.path.join(models_dir, "__init__.py")
    fingerprint = []  # the walk, once a process

    def define_import_structure(module_path, prefix=None):
        called = os.path.abspath(str(module_path))
        if (called, prefix) not in ((models_dir, "models"), (models_init, None)):
            return original(module_path, prefix)
        version = getattr(sys.modules.get("transformers"), "__version__", "unknown")
        if not fingerprint:
            fingerprint.append(_fingerprint(Path(models_dir)))
        return cached_structure(Path(models_dir), version, lambda: original(module_path, prefix), cache_dir,
                                fingerprint[0], name="prefixed-models" if prefix else "models")

    define_import_structure._sft_recipe_cached = True
    import_utils.define_import_structure = define_import_structure


def _around_module_run(name: str, around) -> bool:
    """The next import of module `name` runs as `around(run, module)` (`run(module)` executes its code, from the spec
    Python's own path finder gives); False where `name` was imported already or a hook waits for it."""
    if name in sys.modules or any(isinstance(f, _AroundModuleRun) and f.name == name for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _AroundModuleRun(name, around))
    return True


class _AroundModuleRun:
    """A meta path finder that answers for one module, once: Python's own spec, its loader's run wrapped."""

    def __init__(self, name: str, around):
        self.name, self.around = name, around

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not a plain module on the path: imported as without the hook
        run, around = spec.loader.exec_module, self.around
        spec.loader.exec_module = lambda module: around(run, module)
        return spec


def cached_structure(models_dir: Path, version: str, scan, cache_dir: Path, fingerprint: str | None = None,
                     name: str = "models") -> dict:
    """The import structure `name` of `models_dir`: read from the cache where its key matches, else `scan()`,
    written. `fingerprint`: models_dir's, where the caller walked it already."""
    path = cache_dir / f"transformers-{version}-{name}-{fingerprint or _fingerprint(models_dir)}.json"
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
