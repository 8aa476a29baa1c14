"""sft_recipe/startup.py: a launched process imports the libraries without the cyclic collector, then freezes what
they made (tests/e2e/test_train.py reads that a real run froze them in its run record)."""

from __future__ import annotations

import gc

from sft_recipe import startup
from sft_recipe.startup import freeze_imports, imports_frozen, pause_collector


def test_the_collector_pauses_for_the_imports_and_resumes_without_what_they_made():
    was_enabled, before = gc.isenabled(), gc.get_freeze_count()
    try:
        pause_collector()
        assert not gc.isenabled()
        made = [{"layer": [i]} for i in range(10_000)]  # what imports leave: long-lived, tracked objects
        freeze_imports()
        assert gc.isenabled() and imports_frozen() and gc.get_freeze_count() >= before + len(made)
        assert not any(x is made for x in gc.get_objects(generation=2))  # in no generation a collection walks
        later = [{"step": i} for i in range(10)]
        assert any(x is later for x in gc.get_objects())  # what comes after is collected as before
    finally:
        startup._frozen = False
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()
