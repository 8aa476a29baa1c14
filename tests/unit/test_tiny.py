"""Tests for sft_recipe.tiny: the offline tiny model, tokenizer and datasets, and that the library never imports it."""

from __future__ import annotations

import ast
import csv
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sft_recipe import tiny
from sft_recipe.tiny import store

torch.set_num_threads(1)


def _file_digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _file_states(root: Path) -> dict[str, tuple[int, int]]:
    # (inode, mtime_ns) changes whenever a file is rewritten or replaced.
    return {
        str(path.relative_to(root)): (path.stat().st_ino, path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tiny.TinyPaths:
    return tiny.build_tiny(tmp_path_factory.mktemp("bundle") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundle.model_dir)


@pytest.fixture(scope="module")
def model(bundle):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundle.model_dir)


# ------------------------------------------------------------------------------------------------------------------
# Build: determinism, idempotence, atomicity
# ------------------------------------------------------------------------------------------------------------------


def test_layout(bundle):
    assert json.loads((bundle.root / "READY").read_text()) == {
        "format_version": tiny.BUILD_FORMAT_VERSION,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "seed": 0,
    }
    assert (bundle.model_dir / "model.safetensors").is_file()
    assert (bundle.model_dir / "tokenizer.json").is_file()
    for split in tiny.SPLITS:
        assert (bundle.jsonl_dir / f"{split}.jsonl").is_file()
        assert (bundle.disk_dir / split / "dataset_info.json").is_file()
        assert (bundle.parquet_dir / f"{split}.parquet").is_file()
        assert (bundle.text_dir / f"{split}.csv").is_file()
    # No temp folders or lock files left next to the bundle.
    assert sorted(p.name for p in bundle.root.parent.iterdir()) == ["tiny"]


def test_build_is_deterministic_and_seed_matters(bundle, tmp_path):
    again = tiny.build_tiny(tmp_path / "again")
    assert _file_digests(again.root) == _file_digests(bundle.root)

    other = tiny.build_tiny(tmp_path / "other", seed=1)
    ours, theirs = _file_digests(bundle.root), _file_digests(other.root)
    assert theirs["model/model.safetensors"] != ours["model/model.safetensors"]
    assert theirs["data/jsonl/train.jsonl"] != ours["data/jsonl/train.jsonl"]  # shuffle order depends on the seed


def test_second_build_does_not_rewrite_but_force_does(tmp_path, capsys):
    root = tmp_path / "tiny"
    assert tiny.main(["--output_dir", str(root)]) == 0
    assert "built" in capsys.readouterr().out
    before = _file_states(root)

    assert tiny.main(["--output_dir", str(root)]) == 0
    assert "up to date" in capsys.readouterr().out
    tiny.build_tiny(root)
    assert _file_states(root) == before
    assert tiny.is_ready(root)
    assert not tiny.is_ready(root, seed=1)

    tiny.build_tiny(root, force=True)
    after = _file_states(root)
    assert after.keys() == before.keys()
    assert all(after[name] != before[name] for name in before)


def test_other_parameters_trigger_a_rebuild(tmp_path):
    root = tmp_path / "tiny"
    tiny.build_tiny(root)
    tiny.build_tiny(root, hidden_size=32)
    config = json.loads((root / "model" / "config.json").read_text())
    assert config["hidden_size"] == 32
    assert tiny.is_ready(root, hidden_size=32) and not tiny.is_ready(root)


def test_leftover_temp_folder_is_not_taken_as_ready(tmp_path):
    root = tmp_path / "tiny"
    # A build killed just before its final rename: complete, stamped, but still under its temp name.
    leftover = tmp_path / ".tiny.tmp-killed"
    (leftover / "model").mkdir(parents=True)
    (leftover / "READY").write_text(json.dumps(store._stamp(64, 2, 0)))
    assert not tiny.is_ready(root)

    tiny.build_tiny(root)
    assert tiny.is_ready(root)
    assert (root / "model" / "model.safetensors").is_file()
    assert not leftover.exists()  # cleaned up by the next build


def test_failed_build_leaves_nothing_that_looks_ready(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the datasets")

    monkeypatch.setattr(store, "_write_data", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny.build_tiny(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []
    assert not tiny.is_ready(tmp_path / "tiny")


def test_refuses_to_replace_a_folder_it_did_not_build(tmp_path):
    root = tmp_path / "precious"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        tiny.build_tiny(root)
    with pytest.raises(FileExistsError):
        tiny.build_tiny(root, force=True)
    assert (root / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ------------------------------------------------------------------------------------------------------------------


def test_tokenizer_specials_and_round_trip(tokenizer, bundle):
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    vocab = tokenizer.get_vocab()
    assert not any("<|" in token for token in vocab)  # no ChatML or Zephyr markers
    assert len(tokenizer.tokenize("<|im_start|>")) > 1
    assert 400 <= len(tokenizer) <= 640

    texts = [line["content"] for line in _read_csv(bundle.text_dir / "train.csv")]
    texts += ["héllo wörld 😀 tabs\tand\nnewlines", "  leading and trailing spaces  "]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id  # Llama-2 style: <s> prepended ...
        assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.bos_token + text
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer("cold")["input_ids"][-1] != tokenizer.eos_token_id  # ... and </s> not appended


def test_every_dataset_word_is_one_token(tokenizer):
    words = {word for _, subject, answer in tiny.FACTS for word in (*subject.split(), answer)}
    split_words = sorted(word for word in words if len(tokenizer.tokenize(" " + word)) != 1)
    assert split_words == []


def test_chat_template_renders_prompt_and_answer(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the opposite of hot?"},
        {"role": "assistant", "content": "The opposite of hot is cold."},
    ]
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "### System:\nYou are a helpful assistant.\n### User:\nWhat is the opposite of hot?\n### Assistant:\n"
    )
    assert prompt == (
        f"{tiny.SYSTEM_HEADER}You are a helpful assistant.\n"
        f"{tiny.USER_HEADER}What is the opposite of hot?\n{tiny.ASSISTANT_HEADER}"
    )
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full == prompt + "The opposite of hot is cold.</s>"
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False) == "### User:\nWhat is the opposite of hot?"
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_assistant_mask_marks_exactly_the_answers(tokenizer):
    messages = [
        {"role": "user", "content": "What is the plural of mouse?"},
        {"role": "assistant", "content": "The plural of mouse is mice."},
        {"role": "user", "content": "Tell me the colour of snow."},
        {"role": "assistant", "content": "The colour of snow is white."},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    # Contiguous runs of masked tokens, each decoding to one answer plus its </s>.
    runs, current = [], []
    for token_id, flag in zip(ids, mask):
        if flag:
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert [tokenizer.decode(run) for run in runs] == [
        "The plural of mouse is mice.</s>",
        "The colour of snow is white.</s>",
    ]
    assert mask[-1] == 1 and ids[-1] == tokenizer.eos_token_id


# ------------------------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------------------------


def test_model_config(bundle, model, tokenizer):
    config = json.loads((bundle.model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert config["pad_token_id"] is None
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 1024
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    # The head is rescaled so initial logits have a realistic spread (see build_model).
    head_std = float(model.lm_head.weight.detach().std())
    assert head_std == pytest.approx(tiny.LM_HEAD_INIT_LOGIT_STD / 64**0.5, rel=0.05)


class _FakeVocab:
    """Just enough of a tokenizer for build_model."""

    bos_token_id = 1
    eos_token_id = 2

    def __len__(self) -> int:
        return 16


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = tiny.build_model(_FakeVocab(), seed=5)
    assert torch.equal(torch.rand(3), expected)
    second = tiny.build_model(_FakeVocab(), seed=5)
    third = tiny.build_model(_FakeVocab(), seed=6)
    assert torch.equal(first.lm_head.weight, second.lm_head.weight)
    assert not torch.equal(first.lm_head.weight, third.lm_head.weight)


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("split", tiny.SPLITS)
def test_all_formats_hold_the_same_conversations(bundle, tokenizer, split):
    import datasets
    import pyarrow.parquet as pq

    from_jsonl = tiny.load_conversations(bundle, split)
    assert from_jsonl == tiny.make_conversations(split, seed=0)

    from_disk = datasets.load_from_disk(os.path.join(bundle.disk_dir, split))
    assert from_disk.column_names == ["messages"]
    assert [row["messages"] for row in from_disk] == from_jsonl

    from_parquet = pq.read_table(bundle.parquet_dir / f"{split}.parquet").to_pylist()
    assert [row["messages"] for row in from_parquet] == from_jsonl

    rows = _read_csv(bundle.text_dir / f"{split}.csv")
    assert list(rows[0].keys()) == ["content"]
    assert [row["content"] for row in rows] == [
        tokenizer.apply_chat_template(messages, tokenize=False) for messages in from_jsonl
    ]
    # TRL appends EOS to a text field only when missing; the rendered text must already end with it.
    assert all(row["content"].endswith(tokenizer.eos_token) for row in rows)


def test_splits_share_facts_but_not_phrasings(bundle, tokenizer):
    train = tiny.load_conversations(bundle, "train")
    test = tiny.heldout_conversations(str(bundle.root))
    assert len(train) == len(tiny.FACTS) * len(tiny.TRAIN_QUESTION_TEMPLATES)
    assert 40 <= len(test) <= 60
    assert test == tiny.heldout_conversations(bundle)

    def template_and_answer(messages):
        question, answer = messages[-2]["content"], messages[-1]["content"]
        for relation, subject, _ in tiny.FACTS:
            phrase = tiny.RELATION_PHRASES[relation].format(subject=subject)
            if phrase in question and answer.lower().startswith(phrase + " is "):
                return question.replace(phrase, "{phrase}"), answer
        raise AssertionError(f"no fact matches {messages}")

    train_templates = {template_and_answer(m)[0] for m in train}
    test_templates = {template_and_answer(m)[0] for m in test}
    assert train_templates == set(tiny.TRAIN_QUESTION_TEMPLATES)
    assert test_templates == set(tiny.HELDOUT_QUESTION_TEMPLATES)
    assert not train_templates & test_templates
    # Same facts on both sides: the test measures new wording, not new knowledge.
    assert {template_and_answer(m)[1] for m in test} == {template_and_answer(m)[1] for m in train}

    roles = {tuple(message["role"] for message in messages) for messages in train + test}
    assert roles == {("user", "assistant"), ("system", "user", "assistant")}
    longest = max(len(tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"]) for m in train + test)
    assert longest < 64
    assert train != sorted(train, key=json.dumps)  # shuffled, not in table order


# ------------------------------------------------------------------------------------------------------------------
# The library never imports the demo
# ------------------------------------------------------------------------------------------------------------------

LIBRARY = Path(tiny.__file__).resolve().parents[1]  # sft_recipe/
DEMO = "sft_recipe.tiny"


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, relative ones resolved as if it were `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(part for part in (base, node.module or "") if part)
            yield node.lineno, target
            # `from sft_recipe import tiny` / `from . import tiny` import the submodule by its attribute name.
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            yield node.lineno, node.args[0].value


def _demo_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    return [f"line {line}: {name}" for line, name in _imported_names(source, module, is_package)
            if name == DEMO or name.startswith(DEMO + ".")]


@pytest.mark.parametrize("source, module, is_package", [
    ("from .tiny import score_answers", "sft_recipe.evaluate", False),
    ("from . import tiny", "sft_recipe.evaluate", False),
    ("from ..tiny.store import build_tiny", "sft_recipe.plan.memory", False),
    ("from .. import tiny", "sft_recipe.plan", True),
    ("import sft_recipe.tiny.facts", "sft_recipe.data.prepare", False),
    ("from sft_recipe import tiny", "sft_recipe.data.prepare", False),
    ("def f():\n    from sft_recipe.tiny import build_tiny", "sft_recipe.data.prepare", False),
    ("importlib.import_module('sft_recipe.tiny')", "sft_recipe.data.prepare", False),
])
def test_the_demo_import_check_catches_every_spelling(source, module, is_package):
    assert _demo_imports(source, module, is_package)


@pytest.mark.parametrize("source, module", [
    ("from .scoring import score_answers", "sft_recipe.evaluate"),
    ("from sft_recipe import tinyish", "sft_recipe.data.prepare"),
    ("from .tinyness import x", "sft_recipe.data.prepare"),
])
def test_the_demo_import_check_passes_other_imports(source, module):
    assert _demo_imports(source, module) == []


def test_no_library_module_imports_the_demo():
    demo_dir = LIBRARY / "tiny"
    offenders = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        if demo_dir in path.parents:
            continue
        found = _demo_imports(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")
        if found:
            offenders[str(path.relative_to(LIBRARY.parent))] = found
    assert offenders == {}, f"the library imports the demo (move the code into the library instead): {offenders}"
