"""One reader each: a model's config is read by sft_recipe.model.shape alone (once per run and path, each caller
its own copy), and the dtype a config declares has one interpretation that loading, the plan and merge share."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from sft_recipe.model import shape as model_shape
from tests.helpers import REPO


def _calls_of(attribute: str) -> list[str]:
    """module:line of every `<something>.<attribute>(...)` call in the library."""
    found = []
    for path in (REPO / "sft_recipe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "AutoConfig":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_only_the_ground_floor_reads_a_model_config():
    readers = _calls_of("from_pretrained")
    assert readers and all(r.startswith("sft_recipe/model/shape.py:") for r in readers), readers


def test_a_config_is_read_once_per_path_and_each_caller_gets_its_own_copy(tiny, monkeypatch):
    from transformers import AutoConfig

    reads = []
    original = AutoConfig.from_pretrained.__func__
    monkeypatch.setattr(AutoConfig, "from_pretrained",
                        classmethod(lambda cls, *a, **k: reads.append(a[0]) or original(cls, *a, **k)))
    model_shape._read_config.cache_clear()
    first = model_shape.read_config(str(tiny.model_dir))
    first.hidden_size = -1  # a caller's write (from_config sets the attention implementation) ...
    second = model_shape.read_config(str(tiny.model_dir))
    assert second.hidden_size > 0  # ... is not seen by the next caller
    assert reads == [str(tiny.model_dir)]


def test_a_rewritten_config_is_read_again(tiny, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny.model_dir, folder)
    before = model_shape.read_config(str(folder)).num_hidden_layers
    data = json.loads((folder / "config.json").read_text())
    data["num_hidden_layers"] = before + 1
    (folder / "config.json").write_text(json.dumps(data))
    import os

    stat = os.stat(folder / "config.json")
    os.utime(folder / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later write, whatever
    assert model_shape.read_config(str(folder)).num_hidden_layers == before + 1        # the clock's resolution


@pytest.mark.parametrize("declared, read", [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                                            (torch.bfloat16, torch.bfloat16), (None, torch.float32),
                                            ("float8_unknown", torch.float32)])
def test_the_declared_dtype_has_one_reading(declared, read):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    config.dtype = declared
    assert model_shape.config_dtype(config) == read


def test_a_nested_text_config_declares_the_dtype_of_a_multimodal_checkpoint():
    from transformers import Gemma3Config

    config = Gemma3Config(text_config={"hidden_size": 64, "num_hidden_layers": 1, "dtype": "bfloat16"},
                          vision_config={"hidden_size": 32, "num_hidden_layers": 1})
    config.dtype = None
    assert model_shape.config_dtype(config) == torch.bfloat16


def test_loading_the_plan_and_merge_read_the_dtype_the_same_way(tiny, tmp_path):
    """`--torch_dtype auto` loads in the checkpoint's dtype, the plan counts checkpoint bytes in it, merge merges in
    it: a bf16-declared config is bf16 for all three."""
    import shutil

    from sft_recipe.config.args import parse_args
    from sft_recipe.config.dtypes import model_dtype
    from sft_recipe.merge import _merge_dtype
    from sft_recipe.plan.shape import model_shape as plan_shape

    folder = tmp_path / "bf16-base"
    shutil.copytree(tiny.model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((folder / "config.json").read_text())
    data["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(data))
    m, _, _, _ = parse_args(["--model_name_or_path", str(folder), "--dataset_name", "x", "--torch_dtype", "auto"])
    assert model_dtype(m) == torch.bfloat16
    assert _merge_dtype(model_shape.read_config(str(folder))) == torch.bfloat16
    shape = plan_shape(str(folder))
    assert shape.checkpoint_bytes == shape.total_params * 2  # no weight files: counted at the declared 2 bytes
