"""compat: one entry point, every workaround gated on versions and named with what shows it can go; the private
Trainer methods overridden are listed, and their signatures checked."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

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


def _base(folder: Path, config: dict) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_only_a_run_known_not_to_use_bitsandbytes_skips_it(tmp_path):
    from sft_recipe.config.command_line import bitsandbytes_needed

    plain = _base(tmp_path / "plain", {"model_type": "llama"})
    prequantized = _base(tmp_path / "prequantized", {"model_type": "llama",
                                                      "quantization_config": {"quant_method": "bitsandbytes"}})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_4bit_quantization: true\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("use_4bit_quantization: [\n")
    assert not bitsandbytes_needed(["--model_name_or_path", plain, "--use_peft_lora", "True"])
    assert not bitsandbytes_needed(["--model_name_or_path", plain, "--use_4bit_quantization", "False"])
    assert not bitsandbytes_needed(["--model_name_or_path", plain, "--optim", "adamw_torch"])
    # each way a run can ask for bitsandbytes keeps it
    assert bitsandbytes_needed(["--model_name_or_path", plain, "--use_4bit_quantization", "True"])
    assert bitsandbytes_needed(["--model_name_or_path", plain, "--use_8bit_quantization"])  # a bare flag is True
    assert bitsandbytes_needed(["--model_name_or_path", plain, "--optim=paged_adamw_8bit"])
    assert bitsandbytes_needed(["--model_name_or_path", plain, "--config", str(recipe)])
    assert not bitsandbytes_needed(["--model_name_or_path", plain, "--config", str(recipe),
                                    "--use_4bit_quantization", "False"])  # the command line wins over the YAML
    assert bitsandbytes_needed(["--model_name_or_path", prequantized])
    # what cannot be read before the libraries load keeps it
    assert bitsandbytes_needed(["--model_name_or_path", "meta-llama/Llama-2-70b-hf"])
    assert bitsandbytes_needed(["--model_name_or_path", plain, "--config", str(broken)])
    assert bitsandbytes_needed([])


@pytest.mark.parametrize("reporter, other", [("wandb", "tensorboard"), ("mlflow", "wandb")])
def test_only_a_run_that_reports_to_a_tracker_imports_it(tmp_path, reporter, other):
    from sft_recipe.config import command_line

    needed = getattr(command_line, f"{reporter}_needed")
    assert needed(["--report_to", reporter]) and needed([f"--report_to={other},{reporter}"])
    assert needed(["--report_to", "all"])  # transformers expands it to what is installed
    assert not needed([]) and not needed(["--report_to", "none"]) and not needed(["--report_to", other])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"report_to: [{other}, {reporter}]\n")
    assert needed(["--config", str(recipe)])
    assert not needed(["--config", str(recipe), "--report_to", "none"])  # the command line wins
    broken = tmp_path / "broken.yaml"
    broken.write_text("report_to: [\n")
    assert needed(["--config", str(broken)])  # unreadable: kept


def test_importing_trls_trainer_still_imports_wandb(monkeypatch):
    """Why skip_unused_wandb exists: TRL's trainer module imports wandb at module level whenever it is installed (read
    in its source, without the 5-second import); kept out, transformers and TRL find it unavailable."""
    import importlib.util

    import trl
    from transformers import is_wandb_available

    source = ast.parse((Path(trl.__file__).parent / "trainer" / "base_trainer.py").read_text())
    top_level_imports = {alias.name for node in source.body if isinstance(node, ast.If)
                         for inner in node.body if isinstance(inner, ast.Import) for alias in inner.names}
    assert "wandb" in top_level_imports
    from sft_recipe.compat.unused_imports import skip_unused_wandb, skipped_imports

    monkeypatch.setitem(sys.modules, "wandb", None)  # whatever was there comes back when the test ends
    del sys.modules["wandb"]
    assert skip_unused_wandb() and sys.modules["wandb"] is None and "wandb" in skipped_imports()
    assert importlib.util.find_spec("wandb") is None and not is_wandb_available()


def _top_level_imports(path: Path) -> set[str]:
    """The modules a source file imports at module level, a try block's included (`from ..x.y import z`: "x.y")."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        for inner in [node, *(node.body if isinstance(node, ast.Try) else [])]:
            if isinstance(inner, ast.Import):
                names.update(alias.name for alias in inner.names)
            elif isinstance(inner, ast.ImportFrom):
                names.add(inner.module or "")
    return names


def test_deepspeeds_config_still_imports_mlflow_through_its_autotuner(monkeypatch):
    """Why skip_unused_mlflow exists: DeepSpeed's config module imports its autotuning package, whose autotuner
    imports mlflow at module level whenever it is installed (read in their source, without DeepSpeed's import); kept
    out, the autotuner and transformers find it unavailable."""
    import importlib.metadata
    import importlib.util

    from transformers.integrations import is_mlflow_available

    deepspeed_dir = Path(importlib.metadata.distribution("deepspeed").locate_file("deepspeed"))  # found unimported
    assert "autotuning.config" in _top_level_imports(deepspeed_dir / "runtime" / "config.py")
    assert "autotuner" in _top_level_imports(deepspeed_dir / "autotuning" / "__init__.py")
    assert "mlflow" in _top_level_imports(deepspeed_dir / "autotuning" / "autotuner.py")
    from sft_recipe.compat.unused_imports import skip_unused_mlflow, skipped_imports

    monkeypatch.setitem(sys.modules, "mlflow", None)  # whatever was there comes back when the test ends
    del sys.modules["mlflow"]
    assert skip_unused_mlflow() and sys.modules["mlflow"] is None and "mlflow" in skipped_imports()
    assert importlib.util.find_spec("mlflow") is None and not is_mlflow_available()


def test_only_a_deepspeed_run_imports_deepspeed(tmp_path):
    from sft_recipe.config.command_line import deepspeed_needed
    from sft_recipe.config.launch_env import may_use_deepspeed

    assert may_use_deepspeed({"ACCELERATE_USE_DEEPSPEED": "true"})
    assert may_use_deepspeed({"ACCELERATE_USE_DEEPSPEED": "1"})
    assert not may_use_deepspeed({}) and not may_use_deepspeed({"ACCELERATE_USE_FSDP": "true"})
    # sequence parallelism on DeepSpeed's Ulysses
    assert may_use_deepspeed({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"})
    assert may_use_deepspeed({"ACCELERATE_USE_DEEPSPEED": "maybe"})  # unreadable: kept (train.py then names it)
    assert deepspeed_needed([], launched_on_deepspeed=True)
    assert not deepspeed_needed(["--report_to", "none"], launched_on_deepspeed=False)
    assert deepspeed_needed(["--deepspeed", "ds_config.json"], launched_on_deepspeed=False)  # the Trainer's own way
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("deepspeed: ds_config.json\n")
    assert deepspeed_needed(["--config", str(recipe)], launched_on_deepspeed=False)
    broken = tmp_path / "broken.yaml"
    broken.write_text("deepspeed: [\n")
    assert deepspeed_needed(["--config", str(broken)], launched_on_deepspeed=False)  # unreadable: kept


def test_deepspeed_still_builds_its_cpu_inference_op_at_init(monkeypatch):
    """Why skip_cpu_inference_op_build exists: DeepSpeed's TorchBackend builds its shared-memory inference op while it
    starts (read in its source, without the import), and the CPU accelerator has a builder for it (a C++ build on a
    fresh machine: 21 s). Skipped, build_shm_op answers None, as it does on CUDA."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("DeepSpeed is not installed (requirements-dev.txt installs it)")
    root = Path(spec.origin).parent
    backend = next(node for node in ast.parse((root / "comm" / "torch.py").read_text()).body
                   if isinstance(node, ast.ClassDef) and node.name == "TorchBackend")
    init = next(node for node in backend.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    called = {node.func.id for node in ast.walk(init) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "build_shm_op" in called
    assert "class ShareMemCommBuilder" in (root / "ops" / "op_builder" / "cpu" / "comm.py").read_text()

    from sft_recipe.compat.deepspeed_cpu import skip_cpu_inference_op_build

    deepspeed_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute of that name is torch itself

    monkeypatch.setattr(deepspeed_torch, "build_shm_op", deepspeed_torch.build_shm_op)  # restored when the test ends
    assert skip_cpu_inference_op_build() and deepspeed_torch.build_shm_op() is None


def test_transformers_still_scans_every_model_file_to_import_its_models():
    """Why cache_models_import_structure exists: transformers itself and transformers.models each build their lazy
    module from a scan of every model file at import (read in their source), ~0.24 CPU-s a scan."""
    import transformers

    models_init = Path(transformers.__file__).parent / "models" / "__init__.py"
    assert "define_import_structure(_file)" in models_init.read_text()
    assert 'define_import_structure(Path(__file__).parent / "models", prefix="models")' in Path(
        transformers.__file__).read_text()
    assert len(list(models_init.parent.glob("*/modeling_*.py"))) > 300  # what that scan reads


def test_the_models_structure_is_read_back_as_scanned_and_never_stale(tmp_path):
    """The cached structure is the scan's, read back by the next process; a model file edited, added or removed is
    another key (scanned again); an unwritable cache leaves the scan as it was."""
    from sft_recipe.compat.models_import_structure import cached_structure

    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel']\n")
    structure = {frozenset({"torch"}): {"llama.modeling_llama": {"LlamaModel"}}, frozenset(): {"llama.x": set()}}
    scans = []

    def scan():
        scans.append(1)
        return structure

    cache = tmp_path / "cache"
    assert cached_structure(models, "5.24.0", scan, cache) == structure and len(scans) == 1
    assert cached_structure(models, "5.24.0", scan, cache) == structure and len(scans) == 1  # read, not scanned
    assert cached_structure(models, "5.25.0", scan, cache) == structure and len(scans) == 2  # another version
    (models / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel', 'LlamaForCausalLM']\n")
    assert cached_structure(models, "5.24.0", scan, cache) == structure and len(scans) == 3  # edited: scanned
    (models / "llama" / "configuration_llama.py").write_text("__all__ = []\n")
    assert cached_structure(models, "5.24.0", scan, cache) == structure and len(scans) == 4  # added: scanned
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    assert cached_structure(models, "5.24.0", scan, blocked) == structure and len(scans) == 5  # cannot write: scans
    assert not list(cache.glob("*.partial"))


def test_transformers_own_structure_survives_the_cache(tmp_path):
    import transformers
    from transformers.utils import import_utils

    from sft_recipe.compat.models_import_structure import cached_structure

    models_init = Path(transformers.__file__).parent / "models" / "__init__.py"
    scanned = import_utils.define_import_structure(str(models_init))
    assert cached_structure(models_init.parent, transformers.__version__, lambda: scanned, tmp_path) == scanned
    read = cached_structure(models_init.parent, transformers.__version__, lambda: {}, tmp_path)  # no scan: the copy
    assert read == scanned and frozenset() in read and any("llama.modeling_llama" in m for m in read.values())


def test_a_compile_deferred_to_the_first_call_compiles_once_with_the_same_arguments():
    from sft_recipe.compat.deferred_compile import compile_on_first_call

    compiled = []

    def real_compile(fn, **kwargs):
        compiled.append((fn.__name__, kwargs))
        return lambda *args, **kw: ("compiled", fn(*args, **kw))

    stand_in = compile_on_first_call(real_compile)

    def double(x):
        return 2 * x

    deferred = stand_in(double, dynamic=False)
    assert compiled == [] and deferred.__name__ == "double"  # nothing compiled at definition
    assert deferred(3) == ("compiled", 6) and deferred(x=4) == ("compiled", 8)
    assert compiled == [("double", {"dynamic": False})]  # once, with what bitsandbytes asked

    @stand_in(dynamic=True)  # the decorator form
    def triple(x):
        return 3 * x

    assert triple(2) == ("compiled", 6) and compiled[-1] == ("triple", {"dynamic": True})


