"""compat: one entry point, every workaround gated on versions and named with what shows it can go; the private
Trainer methods overridden are listed, and their signatures checked."""

from __future__ import annotations

import ast
from pathlib import Path

from sft_recipe import compat
from sft_recipe.compat import HELPERS, TRAINER_OVERRIDES, WORKAROUNDS, Workaround

REPO = Path(__file__).resolve().parents[2]


def test_every_workaround_function_is_registered_and_each_registered_one_exists():
    public = {name for path in (REPO / "sft_recipe" / "compat").glob("*.py") if not path.name.startswith("__")
              for name in (n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef))
              if not name.startswith("_")}
    # Every workaround defined in compat is registered; a registered one may live in the room whose rule it serves
    # (model/kernels.py: which mixers lack their kernels decides a packing refusal) and is reached through compat.
    registered = {w.name for w in WORKAROUNDS}
    assert public - set(HELPERS) <= registered
    assert registered - public == {"packing_kernel_gaps"}
    for w in WORKAROUNDS:
        assert callable(getattr(compat, w.name)) and w.can_go_when


def test_a_workaround_applies_only_to_the_versions_it_names():
    assert Workaround("x", "torch", ">=2.0", "2.13.0", "test").applies()
    assert not Workaround("x", "torch", "<1.0", "0.9", "test").applies()
    assert not Workaround("x", "no-such-distribution", ">=1.0", "1.0", "test").applies()


def test_the_named_tests_exist():
    for w in WORKAROUNDS:
        for reference in (part for part in w.can_go_when.split() if part.startswith("tests/")):
            path, _, test = reference.strip("(),").partition("::")
            assert (REPO / path).exists(), reference
            if test:
                assert f"def {test}(" in (REPO / path).read_text(), reference


def test_every_private_trainer_method_overridden_is_listed():
    from transformers import Trainer

    from sft_recipe.train.trainer import RecipeSFTTrainer

    overridden = {name for name in vars(RecipeSFTTrainer) if name.startswith("_") and not name.startswith("__")
                  and hasattr(Trainer, name)}
    assert overridden == {o.method for o in TRAINER_OVERRIDES}
    assert compat.trainer_override_drift() == []  # the installed transformers is the one they were written for


def test_a_changed_signature_is_reported(monkeypatch):
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "_save_rng_state", lambda self, output_dir, extra: None)
    assert compat.trainer_override_drift() == [
        "_save_rng_state('self', 'output_dir', 'extra'): written for ('self', 'output_dir')"]


