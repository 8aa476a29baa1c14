"""How a library function decides that an optional package is missing, read from the function itself.

A function of transformers/accelerate/torch that needs an optional package asks the library's own availability helpers
(`is_torchao_available()`, `is_wandb_available()`, comet's `_is_comet_installed`) or imports the package, and raises
when one says no. `library_gate(func)` reads that from the function's bytecode: the helpers whose answer decides an
explicit `raise` (not one that only picks a warning), the packages it imports before its last `raise`, the minimum
version each helper checks (its `min_version` default, a version in its own code, or the `*MIN*VERSION` constant the
message quotes) and the install command the library's own error message gives. `Gate.missing()` then calls the same
helpers, looked up in the function's module namespace (so a helper patched there is the one asked), before anything
loads. sft_recipe/config/optional_deps.py applies it to every setting that needs a package.
"""

from __future__ import annotations

import dis
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

_PIP = re.compile(r"pip3? install (?:-\S+ )*['\"]?([^\s`'\"]+)")
_URL_INSTALL = re.compile(r"install (https?://\S+)")
_VERSION = r"([0-9]+(?:\.[0-9]+)+)"


@dataclass(frozen=True)
class Need:
    """One thing a library function needs: an availability helper (or flag) of its module, or an import."""
    check: str      # the helper's (or flag's) name in the function's module, or a top-level module name
    kind: str       # "helper" (call it), "flag" (a module-level bool) or "module" (importable?)
    package: str    # the package, as the user knows it: "torchao", "liger-kernel", "galore_torch"
    version: str    # the minimum version the library checks, "" when none
    install: str    # what to install: a pip requirement, a git+/https URL, or "" when the library names none
    note: str = ""  # the library's own words when it names nothing to install (Kubeflow: an environment variable)

    @property
    def requirement(self) -> str:
        return f"{self.package}>={self.version}" if self.version else self.package

    def fix(self) -> str:
        if self.install.startswith("http"):
            return f"install {self.package} ({self.install})"
        if self.install:
            return f"pip install '{self.install}'"
        return f'"{self.note}"' if self.note else f"install the package that provides `import {self.check}`"


@dataclass(frozen=True)
class Gate:
    """What one library function checks before it works; `missing()` evaluates it now, in the function's module."""
    owner: str                # "transformers 5.24.0's _get_torchao_optimizer", for the messages
    needs: tuple[Need, ...]
    namespace: dict           # the function's module globals: a helper patched there is the one called

    def missing(self) -> list[Need]:
        return [need for need in self.needs if not self._available(need)]

    def _available(self, need: Need) -> bool:
        if need.kind == "module":
            return module_available(need.check)
        value = self.namespace.get(need.check)
        if need.kind == "flag":
            return value is not False
        try:
            return bool(value())
        except Exception:  # a helper that cannot even answer: its package is broken
            return False


def module_available(name: str) -> bool:
    """Whether `import name` would find the package (as the libraries' own try/except-import does)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def library_gate(func: Any) -> Gate:
    """The availability checks `func` (a function; a class: its __init__; a callable object: its __call__) makes
    before it works."""
    if inspect.isclass(func):
        func = func.__init__
    elif not inspect.isfunction(inspect.unwrap(func)) and not inspect.ismethod(func):
        func = type(func).__call__
    try:
        return _gate(inspect.unwrap(func))
    except Exception:  # bytecode of another Python (the GPU image runs 3.12) read otherwise: never stop a run here
        # Without the up-front check the library still raises its own error when the package is missing; the
        # suite's tests (tests/unit/test_optional_deps.py) fail where this reading breaks on the tested Python.
        return Gate(owner=getattr(func, "__qualname__", repr(func)), needs=(), namespace={})


@cache
def _gate(func: Any) -> Gate:
    namespace = func.__globals__
    library = func.__module__.split(".")[0]
    instructions = list(dis.get_instructions(func))
    raises = [i for i, ins in enumerate(instructions) if ins.opname == "RAISE_VARARGS"]
    end = raises[-1] if raises else len(instructions)
    modules = []
    for i, ins in enumerate(instructions[:end]):
        if ins.opname == "IMPORT_NAME" and i >= 2 and instructions[i - 2].argval == 0:  # absolute imports only
            top = ins.argval.split(".")[0]
            if top not in (library, "torch") and top not in sys.stdlib_module_names:
                modules.append(top)
    texts = _strings(func)
    needs = [_need(name, "helper" if callable(namespace[name]) else "flag", namespace, func, texts)
             for name in dict.fromkeys(_deciding_helpers(instructions, namespace))]
    covered = {_norm(n.package) for n in needs} | {_norm(_package_name(n.check)) for n in needs}
    needs += [_need(module, "module", namespace, func, texts) for module in dict.fromkeys(modules)
              if not any(_norm(module) in c or c in _norm(module) for c in covered)]
    return Gate(owner=f"{library} {version_of(library)}'s {func.__qualname__}", needs=tuple(needs),
                namespace=namespace)


def _deciding_helpers(instructions, namespace) -> list[str]:
    """The availability helpers whose answer decides an explicit `raise SomeError(...)`: each one followed, before
    any other raise or check, by such a raise, or by another deciding helper (`if not a() or not b(): raise`).
    A helper that only picks a warning (Flyte's pandas) or a pretty traceback (accelerate's rich) does not count."""
    events = [("raise", ins.arg) if ins.opname == "RAISE_VARARGS" else ("helper", ins.argval)
              for ins in instructions if ins.opname == "RAISE_VARARGS" or
              (ins.opname == "LOAD_GLOBAL" and _is_availability_check(ins.argval, namespace))]
    deciding, next_decides = [], False
    for kind, value in reversed(events):
        if kind == "raise":
            next_decides = value == 1  # raise X(...), not a bare re-raise
        elif next_decides:
            deciding.append(value)
    return deciding[::-1]


def _is_availability_check(name: str, namespace: dict) -> bool:
    value = namespace.get(name)
    if name.startswith("is_") and name.endswith("_available") and callable(value):
        return True
    return name.startswith("_is_") and isinstance(value, bool)  # comet's _is_comet_installed / _recent_enough


def _strings(func) -> str:
    """Every string constant of func (its error messages), nested code included."""
    out, stack = [], [func.__code__]
    while stack:
        code = stack.pop()
        for const in code.co_consts:
            if isinstance(const, str):
                out.append(const)
            elif inspect.iscode(const):
                stack.append(const)
    return "\n".join(out)


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def _package_name(check: str) -> str:
    """is_galore_torch_available -> galore_torch; _is_comet_installed -> comet."""
    name = re.sub(r"^_?is_", "", check)
    return re.sub(r"_(available|installed|recent_enough)$", "", name)


def _need(check: str, kind: str, namespace: dict, func, texts: str) -> Need:
    package = check if kind == "module" else _package_name(check)
    hints = [h.rstrip(".").rstrip(">=<") for h in _PIP.findall(texts) + _URL_INSTALL.findall(texts)]
    install = next((h for h in hints if package.split("_")[0] in _norm(h) or _norm(h).split("_")[0] in package), "")
    if not install and kind != "module" and re.search(rf"(requires|install) `?{re.escape(package)}\b", texts, re.I):
        install = package  # "TensorBoardCallback requires tensorboard to be installed"
    plain = bool(re.fullmatch(r"[A-Za-z0-9_.\-]+", install))
    package = install if plain else package  # what pip calls it: liger-kernel, torch-optimi, lomo-optim
    versions = []
    if kind == "helper":
        default = inspect.signature(namespace[check]).parameters.get("min_version")
        if default is not None and isinstance(default.default, str):
            versions.append(default.default)
        versions += re.findall(_VERSION, _strings(inspect.unwrap(namespace[check])))  # liger's "0.3.0"
    key = re.sub(r"[^a-z0-9]", "", _norm(package).split("_")[0])
    for name in func.__code__.co_names:  # an f-string's constant: _MIN_COMET_VERSION, BITSANDBYTES_MIN_VERSION
        if "MIN" in name and "VERSION" in name and key in name.lower() and isinstance(namespace.get(name), str):
            versions.append(namespace[name])
    version = max(versions, key=_parse_version, default="")
    note = "" if install or kind == "module" else \
        next((t for t in texts.split("\n") if "requires" in t or "install" in t), "")
    return Need(check=check, kind=kind, package=package, version=version,
                install=f"{install}>={version}" if plain and version else install, note=note)


def _parse_version(text: str):
    from packaging.version import Version

    return Version(text)


def version_of(library: str) -> str:
    return getattr(sys.modules.get(library), "__version__", "")


def needs_text(missing: list[Need], state: str = "installed") -> str:
    """"torchao>=0.15.0, which is not installed here" (each requirement once)."""
    requirements = list(dict.fromkeys(n.requirement for n in missing))
    return f"{' and '.join(requirements)}, which {'is' if len(requirements) == 1 else 'are'} not {state} here"


def fix_text(missing: list[Need]) -> str:
    return "; ".join(dict.fromkeys(n.fix() for n in missing))


def checks_text(gate: Gate, missing: list[Need]) -> str:
    checks = [f"{n.check}()" if n.kind == "helper" else (n.check if n.kind == "flag" else f"import {n.check}")
              for n in missing]
    return f"{gate.owner} checks {', '.join(checks)}"
