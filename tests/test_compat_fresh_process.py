"""compat, in fresh processes: what each import-time workaround saves, and the library behaviour that makes it
needed, checked where the libraries have not been imported yet (a new Python for each check, as train.py starts).
A subprocess each, so these live in the cli lane, not in tests/unit (the fast lane is in-process only); the
in-process half of compat's tests is tests/unit/test_compat.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_accelerates_unwrapping_still_imports_deepspeed(monkeypatch):
    """Why skip_unused_deepspeed exists: accelerate's extract_model_from_parallel, which every run's set-up calls,
    imports DeepSpeed whenever it is installed (1.2 CPU-s); kept out, accelerate finds it unavailable."""
    pytest.importorskip("deepspeed")  # requirements-dev.txt installs it
    code = ("import sys, torch; from accelerate.utils import extract_model_from_parallel; "
            "assert 'deepspeed' not in sys.modules; m = torch.nn.Linear(2, 2); "
            "assert extract_model_from_parallel(m) is m; print('deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
    import importlib.util

    from accelerate.utils import is_deepspeed_available

    from sft_recipe.compat.unused_imports import skip_unused_deepspeed, skipped_imports

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # whatever was there comes back when the test ends
    del sys.modules["deepspeed"]
    assert skip_unused_deepspeed() and sys.modules["deepspeed"] is None and "deepspeed" in skipped_imports()
    assert importlib.util.find_spec("deepspeed") is None and not is_deepspeed_available()


# A fresh process, as train.py starts: installed before transformers is imported, then every model file opened
# for reading counted through `import transformers` and a model class; the last line prints the count and a digest of
# what the lazy modules answer (transformers' names and where each class lives, transformers.models' names).
_COUNT_MODEL_FILES_READ = (
    "import builtins, hashlib, sys; real = builtins.open; opened = []; "
    "builtins.open = lambda f, *a, **k: (opened.append(str(f)), real(f, *a, **k))[1]\n"
    "if sys.argv[1] == 'cached':\n"
    "    from sft_recipe.compat.models_import_structure import cache_models_import_structure as c\n"
    "    from sft_recipe.config.launch_env import recipe_cache_dir; assert c(recipe_cache_dir())\n"
    "import transformers, transformers.models; from transformers import LlamaConfig, Qwen2ForCausalLM\n"
    "builtins.open = real\n"
    "answers = repr((sorted(dir(transformers)), sorted(transformers._class_to_module.items()), "
    "sorted(dir(transformers.models)), Qwen2ForCausalLM.__module__))\n"
    "print(sum('/models/' in f and f.endswith('.py') for f in opened), hashlib.sha256(answers.encode()).hexdigest())")


def test_a_launched_process_imports_the_models_without_scanning_them(tmp_path):
    """In a fresh process, as train.py installs it: the first import scans twice (transformers', then
    transformers.models') and writes both copies; the next reads them and never opens a model file's source for its
    __all__; the lazy modules answer exactly as transformers' own scans made them."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    answers = {}
    for run in ("cached", "cached", "plain"):
        out = subprocess.run([sys.executable, "-c", _COUNT_MODEL_FILES_READ, run], capture_output=True, text=True,
                             timeout=120, env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        count, digest = out.stdout.strip().splitlines()[-1].split()
        answers.setdefault(run, []).append((int(count), digest))
    (first, first_answers), (second, second_answers) = answers["cached"]
    (plain, plain_answers), = answers["plain"]
    assert plain > 2 * 1500, plain  # without the cache: every model file read by each of the two scans
    assert first > 2 * 1500 and second < 50, (first, second)  # the family's own few files are still read (its __init__)
    assert first_answers == second_answers == plain_answers
    copies = sorted(p.name.split("-models-")[0] for p in (tmp_path / "sft_recipe").glob("transformers-*.json"))
    assert copies == [f"transformers-{transformers_version()}", f"transformers-{transformers_version()}-prefixed"]


def transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def test_where_transformers_is_imported_already_only_the_models_scan_is_left_to_save(tmp_path):
    """Installed after `import transformers` (its own scan done): transformers.models' scan is still answered from
    the copy; after transformers.models nothing is left, and it says so."""
    code = ("import transformers; from sft_recipe.compat.models_import_structure import cache_models_import_structure "
            "as c; from pathlib import Path; import sys; first = c(Path(sys.argv[1])); import transformers.models; "
            "print(first, c(Path(sys.argv[1])))")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-2:] == ["True", "False"]
    assert [p.name.split("-models-")[0] for p in tmp_path.glob("*.json")] == [f"transformers-{transformers_version()}"]


def test_bitsandbytes_imported_compiling_on_first_use_leaves_inductor_out():
    """What the deferral saves (0.85 CPU-s a QLoRA rank): bitsandbytes imported through it, torch's inductor is not
    imported, and torch.compile is torch's own again."""
    code = ("import sys, torch; real = torch.compile; "
            "from sft_recipe.compat.deferred_compile import import_bitsandbytes_compiling_on_first_use as imp; "
            "assert imp() and not imp(); assert torch.compile is real; "
            "print('torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_importing_bitsandbytes_still_imports_inductor():
    """Why skip_unused_bitsandbytes exists: importing bitsandbytes pulls in torch's inductor (0.7-0.8 CPU-s)."""
    code = ("import sys, torch, torch._dynamo; assert 'torch._inductor.compile_fx' not in sys.modules; "
            "import bitsandbytes; print('torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"



def test_deepspeeds_zero_optimizer_check_still_imports_inductor():
    """Why import_muon_compiling_on_first_use exists: ZeRO's optimizer check, which every DeepSpeed run's
    deepspeed.initialize calls, imports the Muon optimizer module (read in its source), and that module's import
    compiles a kernel, which imports torch's inductor (~0.9 CPU-s a rank)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("DeepSpeed is not installed (requirements-dev.txt installs it)")
    check = (Path(spec.origin).parent / "runtime" / "zero" / "utils.py").read_text()
    body = check[check.index("def is_zero_supported_optimizer"):].split("\ndef ")[0]
    assert "deepspeed.runtime.zero.muon" in body
    code = ("import sys, deepspeed; assert 'torch._inductor.compile_fx' not in sys.modules; "
            "import deepspeed.runtime.zero.muon.muon_optimizer; print('torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_a_deepspeed_run_imports_muon_compiling_on_first_use_and_leaves_inductor_out():
    """What the deferral saves: train.py's start in a rank `accelerate launch` started on DeepSpeed (the variable it
    exports) leaves the Muon module imported, torch's inductor not imported, torch.compile torch's own,
    and the Muon optimizer ZeRO's check looks for still the class it was (the check finds it as before)."""
    pytest.importorskip("deepspeed")
    code = ("import sys, torch; real = torch.compile; from sft_recipe.startup import prepare_imports; "
            "prepare_imports(['--report_to', 'none']); "
            "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
            "import deepspeed.runtime.zero.muon.original_muon as m; "
            "assert torch.compile is real and issubclass(MuonWithAuxAdam, torch.optim.Optimizer); "
            "print('torch._inductor.compile_fx' in sys.modules, callable(m.zeropower_via_newtonschulz5))")
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False True"


def test_the_relaxation_lets_the_cpu_build_the_sync_init_and_pass_cpu_tensors():
    code = """
import torch, os
os.environ["FSDP_VERSION"] = "1"
from sft_recipe import compat
compat.allow_fsdp1_module_sync_on_cpu()
from accelerate.utils import FullyShardedDataParallelPlugin
plugin = FullyShardedDataParallelPlugin(sync_module_states=True)
module = torch.nn.Linear(2, 2, device="meta")
plugin.param_init_fn(module)
assert module.weight.device.type == "cpu", module.weight.device
import torch.distributed.fsdp._init_utils as fsdp_init
fsdp_init._check_module_states_for_sync_module_states([torch.zeros(2)])
print("relaxed", compat.fsdp1_module_sync_allowed_on_cpu())
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "relaxed True" in proc.stdout
