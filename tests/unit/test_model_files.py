"""Damaged base model folders are refused before any weight loads, each with the file, what is wrong and the fix;
the same run on the intact folder gets as far as loading weights (the negative control).

The runs go through train.py's own entry point in this process, with `from_pretrained` replaced by a tripwire: a
refused run returns 2 without reaching it, the intact one trips it.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.preflight.validate import validate
from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


def flags(model, tmp_path, data) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
            *GUIDE_LORA]


def _problems(model, tmp_path, data) -> str:
    with pytest.raises(ConfigError) as e:
        validate(*parse_args(flags(model, tmp_path, data)))
    return "\n".join(e.value.problems)


@pytest.fixture()
def model(tiny, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny.model_dir, folder)
    return folder


@pytest.fixture()
def sharded(tiny, tmp_path):
    """The tiny model saved in three shards with an index (as large models are)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    shutil.copytree(tiny.model_dir, folder)
    (folder / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)).save_pretrained(str(folder), max_shard_size="250KB")
    assert len(list(folder.glob("model-*.safetensors"))) >= 2
    return folder


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _shards(folder):
    return sorted(folder.glob("model-*.safetensors"))


def _move_a_tensor_in_the_index(folder):
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first, second = _shards(folder)[:2]
    name = next(k for k, v in data["weight_map"].items() if v == first.name)
    data["weight_map"][name] = second.name
    index.write_text(json.dumps(data))


def _garble_header(path):
    raw = bytearray(path.read_bytes())
    raw[10:20] = b"\xff" * 10
    path.write_bytes(bytes(raw))


# (fixture, damage, what the message says). Every message also names the file and a fix.
DAMAGE = {
    "truncated model.safetensors": ("model", lambda d: _truncate(d / "model.safetensors", 300_000),
                                    "model.safetensors is truncated: 300,000 bytes where its header describes"),
    "zero-byte model.safetensors": ("model", lambda d: _truncate(d / "model.safetensors", 0),
                                    "model.safetensors is empty (0 bytes)"),
    "cut inside the header": ("model", lambda d: _truncate(d / "model.safetensors", 100),
                              "model.safetensors is truncated or not a safetensors file: 100 bytes, but its first "
                              "bytes announce a"),
    "garbled header": ("model", lambda d: _garble_header(d / "model.safetensors"), "has an unreadable header"),
    "bytes appended": ("model", lambda d: open(d / "model.safetensors", "ab").write(b"junk"),
                       "(extra bytes: damaged)"),
    "no weights": ("model", lambda d: (d / "model.safetensors").unlink(), "no weights there"),
    "no config.json": ("model", lambda d: (d / "config.json").unlink(), "no config.json"),
    "config.json cut short": ("model", lambda d: _truncate(d / "config.json", 40), "config.json is not valid JSON"),
    "no tokenizer files": ("model", lambda d: [p.unlink() for p in d.glob("tokenizer*")], "no tokenizer files there"),
    "tokenizer.json cut short": ("model", lambda d: _truncate(d / "tokenizer.json", 1000),
                                 "tokenizer.json is not valid JSON"),
    "missing shard": ("sharded", lambda d: _shards(d)[1].unlink(), "which is absent (an interrupted download"),
    "truncated shard": ("sharded", lambda d: _truncate(_shards(d)[0], 1000),
                        "model-00001-of-00003.safetensors is truncated: 1,000 bytes where its header describes"),
    "index names a file that is absent": ("sharded", lambda d: _shards(d)[-1].rename(d / "renamed.safetensors"),
                                          "which is absent"),
    "index and shards disagree": ("sharded", _move_a_tensor_in_the_index, "the index and the shards do not belong"),
    "index cut short": ("sharded", lambda d: _truncate(d / "model.safetensors.index.json", 30),
                        "model.safetensors.index.json is not valid JSON"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_base_folder_is_refused_with_the_file_and_the_fix(case, request, tiny, tmp_path):
    fixture, damage, expected = DAMAGE[case]
    folder = request.getfixturevalue(fixture)
    validate(*parse_args(flags(folder, tmp_path, tiny.jsonl_dir)))  # the negative control: intact, it passes
    damage(folder)
    message = _problems(folder, tmp_path, tiny.jsonl_dir)
    assert expected in message and f"--model_name_or_path {folder}" in message and "Fix:" in message, message


def test_a_truncated_pickle_checkpoint_is_refused(model, tiny, tmp_path):
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    validate(*parse_args(flags(model, tmp_path, tiny.jsonl_dir)))
    _truncate(model / "pytorch_model.bin", 5000)
    assert "pytorch_model.bin is truncated or damaged" in _problems(model, tmp_path, tiny.jsonl_dir)


def test_the_header_check_knows_the_exact_size(tiny):
    from sft_recipe.artifacts.integrity import safetensors_header

    path = tiny.model_dir / "model.safetensors"
    start, header = safetensors_header(path)
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert start == 8 + length and path.stat().st_size == start + max(
        v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize("case", ["truncated model.safetensors", "no tokenizer files", "missing shard"])
def test_no_weight_loads_and_no_traceback(case, request, tiny, tmp_path, monkeypatch, capsys):
    fixture, damage, expected = DAMAGE[case]
    folder = request.getfixturevalue(fixture)
    argv = flags(folder, tmp_path, tiny.jsonl_dir)
    assert run_train(argv, monkeypatch, capsys)[0] == "weights"  # intact: every check passes, weights would load
    damage(folder)
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and expected in err and "Traceback" not in err, err


def _small_tokenizer(folder):
    """Another model's tokenizer (268 tokens) in the tiny model's folder (552 embedding rows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    for path in folder.glob("tokenizer*"):
        path.unlink()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world"] * 10, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))


def test_a_tokenizer_far_smaller_than_the_embeddings_is_refused(model, tiny, tmp_path, monkeypatch, capsys):
    argv = flags(model, tmp_path, tiny.jsonl_dir)
    assert run_train(argv, monkeypatch, capsys)[0] == "weights"
    _small_tokenizer(model)
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and "its tokenizer has 268 tokens but the model's embeddings have 552 rows" in err, err
    assert "Fix: put the model's own tokenizer files in the folder" in err


def test_what_a_run_never_loads_is_not_asked_for(model, tiny, tmp_path):
    """--plan_memory_gib plans from config.json alone (the shipped Llama-2-70B folder has nothing else);
    --preview_examples needs the tokenizer, not the weights."""
    tokenizer_files = {p.name: p.read_bytes() for p in model.glob("tokenizer*")}
    for path in model.iterdir():
        if path.name != "config.json":
            path.unlink()
    argv = flags(model, tmp_path, tiny.jsonl_dir)
    validate(*parse_args([*argv, "--plan_memory_gib", "80"]))
    message = _problems(model, tmp_path, tiny.jsonl_dir)
    assert "no weights there" in message and "no tokenizer files there" in message
    for name, data in tokenizer_files.items():
        (model / name).write_bytes(data)
    validate(*parse_args([*argv, "--preview_examples", "2"]))


def test_damaged_weights_do_not_hide_the_other_problems(model, tiny, tmp_path):
    _truncate(model / "model.safetensors", 1000)
    with pytest.raises(ConfigError) as e:
        validate(*parse_args([*flags(model, tmp_path, tiny.jsonl_dir), "--lora_target_modules", "q_proj,c_attn"]))
    assert any("model.safetensors is truncated" in p for p in e.value.problems)
    assert any("['c_attn'] match no linear layer" in p for p in e.value.problems)
