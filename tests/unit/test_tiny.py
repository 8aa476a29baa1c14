"""Tests for sft_recipe.tiny: the offline tiny model, tokenizer, datasets and the answer scorer."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sft_recipe import tiny

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
    (leftover / "READY").write_text(json.dumps(tiny._stamp(64, 2, 0)))
    assert not tiny.is_ready(root)

    tiny.build_tiny(root)
    assert tiny.is_ready(root)
    assert (root / "model" / "model.safetensors").is_file()
    assert not leftover.exists()  # cleaned up by the next build


def test_failed_build_leaves_nothing_that_looks_ready(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the datasets")

    monkeypatch.setattr(tiny, "_write_data", crash)
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
# score_answers
# ------------------------------------------------------------------------------------------------------------------


class _Oracle(torch.nn.Module):
    """A fake causal LM that always predicts the next token of whichever reference sequence it is reading."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, fallback_id: int) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives score_answers a device to read
        self.vocab_size = vocab_size
        self.fallback_id = fallback_id
        self.next_token: dict[tuple[int, ...], int] = {}
        for sequence in sequences:
            for end in range(1, len(sequence)):
                self.next_token[tuple(sequence[:end])] = sequence[end]

    def forward(self, input_ids: torch.Tensor, **kwargs) -> SimpleNamespace:
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        for row in range(batch):
            prefix = input_ids[row].tolist()
            for end in range(1, length + 1):
                logits[row, end - 1, self.next_token.get(tuple(prefix[:end]), self.fallback_id)] = 1.0
        return SimpleNamespace(logits=logits)


def test_score_answers_is_perfect_for_an_oracle(tokenizer):
    conversations = tiny.make_conversations("test")[:9]
    references = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"] for m in conversations]
    oracle = _Oracle(references, len(tokenizer), fallback_id=tokenizer.eos_token_id)
    result = tiny.score_answers(oracle, tokenizer, conversations, batch_size=4)
    assert result["exact_match"] == 1.0
    assert result["answer_token_accuracy"] == 1.0
    assert [sample[1] for sample in result["samples"]] == [m[-1]["content"] for m in conversations]
    assert [sample[2] for sample in result["samples"]] == [m[-1]["content"] for m in conversations]
    assert result["samples"][0][0] == tokenizer.apply_chat_template(
        conversations[0][:-1], add_generation_prompt=True, tokenize=False
    )

    # An oracle for the wrong answers scores zero exact matches and loses the answer tokens.
    wrong = [[*m[:-1], {"role": "assistant", "content": "The colour of snow is white."}] for m in conversations[1:]]
    wrong_ids = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"] for m in wrong]
    misled = _Oracle(wrong_ids, len(tokenizer), fallback_id=tokenizer.eos_token_id)
    result = tiny.score_answers(misled, tokenizer, conversations[1:])
    assert result["exact_match"] == 0.0
    assert result["answer_token_accuracy"] < 0.6


def test_score_answers_on_random_base_and_peft(model, tokenizer, bundle):
    from peft import LoraConfig, get_peft_model

    conversations = tiny.heldout_conversations(bundle)[:6]
    base = tiny.score_answers(model, tokenizer, conversations, max_new_tokens=8)
    assert 0.0 <= base["exact_match"] <= 1.0 and 0.0 <= base["answer_token_accuracy"] <= 1.0
    assert base["answer_token_accuracy"] < 0.2  # random weights know nothing
    assert len(base["samples"]) == len(conversations)

    # Equal-length batching must not change results.
    one_by_one = tiny.score_answers(model, tokenizer, conversations, max_new_tokens=8, batch_size=1)
    assert one_by_one == base

    # A fresh LoRA adapter is a no-op (B is zero), so a PeftModel scores exactly like its base.
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    try:
        peft_model.train()
        wrapped = tiny.score_answers(peft_model, tokenizer, conversations, max_new_tokens=8)
        assert peft_model.training  # mode restored
        assert wrapped == base
    finally:
        peft_model.unload()  # leave the shared model fixture as it was


def test_score_answers_uses_the_tokenizers_current_template(tokenizer):
    conversations = tiny.make_conversations("test")[:3]
    chatml = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    chatml.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    references = [chatml(chatml.apply_chat_template(m, tokenize=False))["input_ids"] for m in conversations]
    oracle = _Oracle(references, len(chatml), fallback_id=chatml.eos_token_id)
    result = tiny.score_answers(oracle, chatml, conversations)
    assert all(re.match(r"<\|im_start\|>", sample[0]) for sample in result["samples"])
    # The oracle continues past the answer with "<|im_end|>\n" then stops; special tokens are dropped.
    assert result["exact_match"] == 1.0 and result["answer_token_accuracy"] == 1.0


def test_score_answers_rejects_bad_input(model, tokenizer):
    with pytest.raises(ValueError):
        tiny.score_answers(model, tokenizer, [])
    with pytest.raises(ValueError):
        tiny.score_answers(model, tokenizer, [[{"role": "user", "content": "hi"}]])
