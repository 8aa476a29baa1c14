"""scripts/pick_python.py, the interpreter scripts/setup.sh builds .venv from: an optimized build first, never one
that cannot build the venv, and what it reads of a build matches what the loader says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from pick_python import Build, ask, choose, main  # noqa: E402

pytestmark = pytest.mark.unit

PYENV_DEFAULT = Build("/home/u/.pyenv/shims/python3", (3, 11), True, True, "'--prefix=/x' '--enable-shared'")
DISTRIBUTION = Build("/usr/bin/python3", (3, 11), True, False, "'--enable-shared' '--prefix=/usr'")
PGO_SHARED = Build("/opt/py/bin/python3", (3, 12), True, True, "'--enable-shared' '--enable-optimizations'")
NO_VENV = Build("/usr/bin/python3", (3, 11), False, False, "")  # Debian without python3.11-venv
TOO_OLD = Build("/usr/bin/python3", (3, 10), True, False, "")


def test_an_optimized_build_is_chosen_over_the_first_candidate():
    assert choose([PYENV_DEFAULT, DISTRIBUTION])[0] == DISTRIBUTION
    assert choose([PYENV_DEFAULT, PGO_SHARED])[0] == PGO_SHARED  # shared, but profile-optimized


def test_a_build_that_cannot_make_the_venv_is_never_chosen_however_fast():
    chosen, why = choose([PYENV_DEFAULT, NO_VENV])
    assert chosen == PYENV_DEFAULT and "set PYTHON" in why
    assert choose([PYENV_DEFAULT, TOO_OLD])[0] == PYENV_DEFAULT
    chosen, why = choose([NO_VENV, TOO_OLD])
    assert chosen is None and ">= 3.11" in why


def test_the_build_read_matches_what_the_loader_links():
    build = ask(sys.executable)
    assert build is not None and build.version == sys.version_info[:2]
    # ldd, independently of the candidate's own /proc/self/maps: does the executable need libpython?
    linked = subprocess.run(["ldd", os.path.realpath(sys.executable)], capture_output=True, text=True, check=True)
    assert build.shared_libpython == ("libpython" in linked.stdout)


def test_main_prints_one_of_the_candidates_and_skips_the_missing(capsys):
    assert main(["/nonexistent/python3", sys.executable]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == shutil.which(sys.executable) and "pick_python: .venv from" in err
    assert main(["/nonexistent/python3"]) == 1
    assert "set PYTHON" in capsys.readouterr().err
