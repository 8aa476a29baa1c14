"""Which interpreter scripts/setup.sh builds .venv from, when PYTHON does not say:

    python3 scripts/pick_python.py python3 /usr/bin/python3      # prints the chosen executable, why on stderr

Every launched rank spends most of its start-up executing Python (imports: docs/testing.md), so the interpreter's
build shows in every launch. A CPython whose executable links libpython as a shared library and was configured
without --enable-optimizations (pyenv's default build) ran train.py's tiny one-process run at 1.08x the CPU-seconds
of the distribution's statically linked, profile-optimized build of the same minor version (Debian 12's 3.11.2 vs
pyenv's 3.11.7, same wheels; bench/interpreter_startup.py prints the ratio). So: the first candidate that can build
the venv and is an optimized build; else the first that can build it at all. Runs under any Python 3; the candidates
are asked about themselves in a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass

MINIMUM_VERSION = (3, 11)  # pyproject.toml's requires-python

# Run by each candidate: its version, whether it can create a venv with pip, and how it was built.
_ASK = r"""
import json, sys, sysconfig
try:
    import ensurepip, venv
    can_venv = True
except ImportError:
    can_venv = False
try:
    with open("/proc/self/maps") as maps:
        shared = any("/libpython" in line for line in maps)
except OSError:
    shared = None
print(json.dumps({"version": list(sys.version_info[:2]), "can_venv": can_venv, "shared_libpython": shared,
                  "config_args": sysconfig.get_config_var("CONFIG_ARGS") or ""}))
"""


@dataclass(frozen=True)
class Build:
    executable: str
    version: tuple[int, int]
    can_venv: bool
    shared_libpython: bool | None  # None: not known (no /proc)
    config_args: str

    @property
    def usable(self) -> bool:
        return self.can_venv and self.version >= MINIMUM_VERSION

    @property
    def optimized(self) -> bool:
        """Profile-optimized (--enable-optimizations), or an executable with the interpreter linked in statically
        (distribution builds: Debian, Ubuntu, Fedora, conda), whose calls skip the shared library's indirection."""
        return "--enable-optimizations" in self.config_args or self.shared_libpython is False


def ask(executable: str) -> Build | None:
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        answer = subprocess.run([path, "-c", _ASK], capture_output=True, text=True, timeout=60, check=True)
        facts = json.loads(answer.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        print(f"pick_python: WARNING: could not ask {path} about its build ({e}); not a candidate", file=sys.stderr)
        return None
    return Build(path, tuple(facts["version"]), facts["can_venv"], facts["shared_libpython"], facts["config_args"])


def choose(builds: list[Build]) -> tuple[Build | None, str]:
    usable = [b for b in builds if b.usable]
    if not usable:
        return None, f"no candidate is Python >= {'.'.join(map(str, MINIMUM_VERSION))} with venv and ensurepip"
    optimized = [b for b in usable if b.optimized]
    if optimized:
        return optimized[0], "an optimized build (static or --enable-optimizations)"
    return usable[0], "no optimized build among the candidates; set PYTHON to choose one"


def main(candidates: list[str]) -> int:
    builds = [b for b in map(ask, candidates) if b is not None]
    chosen, why = choose(builds)
    if chosen is None:
        print(f"pick_python: {why} (asked: {', '.join(candidates)}); set PYTHON", file=sys.stderr)
        return 1
    print(f"pick_python: .venv from {chosen.executable} (Python {'.'.join(map(str, chosen.version))}): {why}",
          file=sys.stderr)
    print(chosen.executable)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
