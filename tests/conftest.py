"""Shared fixtures: the tiny model/data built once per session, and markers by folder (see tests/helpers.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `sft_recipe`, `tests.helpers`: from this checkout

from sft_recipe.startup import freeze_imports, pause_collector  # noqa: E402
from tests.helpers import REPO, remove_datasets_caches, tiny_conversation_as  # noqa: E402

# In-process tests run offline, as launched ones do (helpers.launch_env): a Hub id in a test ("org/base") is then
# refused at once instead of waiting on the network's timeouts, which cost ~10 s a lookup on a machine without it.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

pytest_plugins = ["tests.launch_budget"]  # counts and times every process a test starts; prints the table at the end


def pytest_collection_modifyitems(items):
    """Mark each test by where it lives (markers are declared in pyproject.toml): `-m unit` is the fast lane."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        item.add_marker({"unit": pytest.mark.unit, "e2e": pytest.mark.e2e}.get(parts[0], pytest.mark.cli))


def pytest_collection(session):
    """Collecting imports torch, transformers, the library and every test module, which live as long as the worker:
    imported without the cyclic collector and then frozen, no collection walks them again, as train.py does with its
    imports (sft_recipe/startup.py)."""
    pause_collector()


def pytest_collection_finish(session):
    freeze_imports()


def pytest_sessionfinish(session):
    remove_datasets_caches()  # each launch's datasets cache (tests/helpers.launch_env), in this process


@pytest.fixture()
def keep_signal_handlers():
    """train.run installs SIGTERM/SIGUSR1/SIGINT handlers for training; a run that ends early leaves them."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The embedded default (tiny Llama + tokenizer + chat data), built once per test session."""
    from sft_recipe.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def format_datasets(tiny, tmp_path_factory):
    """fmt -> folder with train.jsonl/test.jsonl of the tiny conversations in that format (built once)."""
    from transformers import AutoTokenizer

    from sft_recipe.tiny import load_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    root = tmp_path_factory.mktemp("formats")
    folders = {}
    for fmt in ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_completion_chat"):
        folders[fmt] = root / fmt
        folders[fmt].mkdir()
        for split in ("train", "test"):
            rows = [tiny_conversation_as(fmt, m, tokenizer) for m in load_conversations(tiny, split)]
            (folders[fmt] / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folders


@pytest.fixture(scope="session")
def family_model(tiny, tmp_path_factory):
    """family -> folder of a tiny random model of that family (sft_recipe.tiny.families), built on first use."""
    from sft_recipe.tiny.families import build_family_model

    root = tmp_path_factory.mktemp("families")
    return lambda family: build_family_model(root, tiny.root, family)


@pytest.fixture(scope="session")
def shared_run(tiny, tmp_path_factory):
    """name -> RunResult of one of tests/shared_runs.py's launches: each launched once per session, on first use, and
    read by every test that asks. Readers copy before they change anything; the session ends by checking they did."""
    from tests.shared_runs import SharedRuns

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one folder for every worker: each run launches once in all
        root = root.parent
    runs = SharedRuns(tiny, root / "shared-runs")
    yield runs
    changed = runs.changed()
    assert not changed, f"a test wrote into a shared run's folder (copy it first): {changed}"
