"""The declared table of optional packages (sft_recipe/config/packages.py) held to the pinned libraries.

The table is written by hand from the libraries' code; these tests are what keeps it true: every value transformers,
accelerate and torch accept for a covered setting is classified (a value a newer library adds fails here by name),
each row's helper is the object the library function calls and agrees with what is installed here, the function's
own source (read as text) names it, the minimum versions are the libraries' constants, and the messages are the ones
the recipe printed before the table replaced reading the functions' bytecode.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from types import SimpleNamespace

import pytest
from packaging.version import Version

from sft_recipe.config import optional_deps as od
from sft_recipe.config import packages as pk

ROW_IDS = [f"{r.setting}={r.value}:{r.check}" for r in pk.TABLE]


def _values(setting: str) -> set[str]:
    return {row.value for row in pk.TABLE if row.setting == setting}


def _classified(setting: str, accepted: set[str], also: set[str] = frozenset()) -> None:
    """Each accepted value is a row, needs nothing, or is in `also`, exactly one of them; nothing declared is stale."""
    rows, nothing = _values(setting), pk.NEEDS_NOTHING[setting]
    assert not rows & nothing and not rows & also and not nothing & also, (setting, rows & nothing, rows & also)
    unclassified = sorted(accepted - rows - nothing - also)
    assert not unclassified, f"{setting}: the libraries accept these, sft_recipe/config/packages.py does not say " \
                             f"what they need (a row, or NEEDS_NOTHING): {unclassified}"
    stale = sorted((rows | nothing | also) - accepted)
    assert not stale, f"{setting}: declared in packages.py but no longer accepted by the libraries: {stale}"


def _absent(monkeypatch, setting: str, value: str) -> None:
    """Make every check of (setting, value) say no, where the library function looks it up."""
    for row in pk.rows(setting, value):
        if row.is_import:
            monkeypatch.setattr(pk, "module_available", lambda name: False)
            continue
        module, name = row.helper.rsplit(".", 1)
        current = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(importlib.import_module(module), name,
                            False if isinstance(current, bool) else (lambda *a, **k: False))


# --- every value the libraries accept is classified -------------------------------------------------------------

def test_every_optimizer_is_a_row_or_needs_nothing():
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
    from transformers.training_args import OptimizerNames

    _classified("--optim", {o.value for o in OptimizerNames})
    for value in pk.NEEDS_NOTHING["--optim"]:  # the handler asks no availability helper at all
        source = inspect.getsource(inspect.unwrap(_OPTIMIZER_HANDLERS[value]))
        assert not re.search(r"\bis_\w+_available\(", source), f"--optim {value}: its handler checks a package now"
    for row in (r for r in pk.TABLE if r.setting == "--optim"):  # the row names the handler transformers dispatches to
        assert inspect.unwrap(pk.resolve(row.needed_by)[1]) is inspect.unwrap(_OPTIMIZER_HANDLERS[row.value]), row


def test_every_report_to_integration_is_a_row():
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    _classified("--report_to", set(INTEGRATION_TO_CALLBACK) | {"all", "none"})
    for row in (r for r in pk.TABLE if r.setting == "--report_to"):
        assert pk.resolve(row.needed_by)[1] is INTEGRATION_TO_CALLBACK[row.value].__init__, row


def test_every_compile_backend_is_a_row_needs_nothing_or_is_not_in_torch():
    import torch._dynamo
    from accelerate.utils import DynamoBackend
    from torch._dynamo.backends.registry import lookup_backend

    accepted = {b.value.lower() for b in DynamoBackend}  # what --torch_compile_backend may say (accelerate's enum)
    _classified("--torch_compile_backend", accepted, set(pk.COMPILE_BACKENDS_TORCH_LACKS))
    listed = set(torch._dynamo.list_backends(exclude_tags=()))
    for name in _values("--torch_compile_backend") | (pk.NEEDS_NOTHING["--torch_compile_backend"] - {"no"}):
        assert name in listed, f"torch no longer registers '{name}'"
    for name in pk.COMPILE_BACKENDS_TORCH_LACKS:
        assert name not in listed and not od.compile_backend_registered(name), f"torch registers '{name}' now"
    for row in (r for r in pk.TABLE if r.setting == "--torch_compile_backend"):
        assert inspect.unwrap(pk.resolve(row.needed_by)[1]) is inspect.unwrap(lookup_backend(row.value)), row
    for name in sorted(listed - accepted):  # torch's others: refused by name, with no package question
        (problem,) = od.torch_compile_problems(SimpleNamespace(torch_compile=True, torch_compile_backend=name))
        assert "knows no such torch.compile backend" in problem, name


def test_the_other_settings_are_classified():
    from accelerate.utils import DistributedType

    for setting in ("--use_liger_kernel", "--use_4bit_quantization", "--use_8bit_quantization"):
        _classified(setting, {"True", "False"})
    declared = _values("distributed_type") | pk.NEEDS_NOTHING["distributed_type"]
    assert declared <= {d.value for d in DistributedType}, declared  # accelerate's own names
    assert {row.setting for row in pk.TABLE} == set(pk.NEEDS_NOTHING)


# --- each row, against the library's code and this machine ------------------------------------------------------

@pytest.mark.parametrize("row", pk.TABLE, ids=ROW_IDS)
def test_the_row_names_what_the_library_calls(row):
    """The function exists, its source (as text) names the helper and what to install, and the helper named is the
    object that function calls (its module's global: patched there, both see the patch)."""
    _, function = pk.resolve(row.needed_by)
    function = inspect.unwrap(function)
    source = inspect.getsource(function)
    assert row.check in source, f"{row.needed_by} no longer mentions {row.check}"
    if row.install:
        assert row.install.split(">=")[0] in source, f"{row.needed_by} no longer names {row.install}"
    if not row.is_import:
        module, helper = pk.resolve(row.helper)
        assert function.__globals__[row.check] is helper, row.helper
        assert module == function.__module__
    assert row.package and (row.install or row.note or row.is_import), row
    assert len({r.needed_by for r in pk.rows(row.setting, row.value)}) == 1  # one function per value: one owner


@pytest.mark.parametrize("row", [r for r in pk.TABLE if r.version], ids=lambda r: f"{r.setting}={r.value}:{r.check}")
def test_the_minimum_version_is_the_librarys(row):
    """The helper's min_version default, or a version in its own code, or the *MIN*VERSION constant the function's
    module quotes (comet's flags)."""
    helper = pk.resolve(row.helper)[1]
    if callable(helper) and "min_version" in inspect.signature(helper).parameters:
        assert row.version == inspect.signature(helper).parameters["min_version"].default
        return
    module = inspect.unwrap(pk.resolve(row.needed_by)[1]).__globals__
    quoted = [v for k, v in module.items() if "MIN" in k.upper() and "VERSION" in k.upper() and isinstance(v, str)]
    source = inspect.getsource(inspect.unwrap(helper)) if callable(helper) else ""
    assert row.version in quoted or f'"{row.version}"' in source, row


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a dotted name whose parent package is absent
        return False


@pytest.mark.parametrize("row", [r for r in pk.TABLE if r.imports or r.is_import], ids=lambda r: f"{r.value}:{r.check}")
def test_the_helper_agrees_with_what_is_installed(row, monkeypatch):
    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)
    expected = all(_importable(name) for name in (row.imports or (row.helper,)))
    if expected and row.version:
        expected = Version(importlib.metadata.version(row.package)) >= Version(row.version)
    assert pk.available(row) is expected, f"{row.helper} says {not expected}, the packages here say {expected}"


def test_a_helper_that_reads_the_environment(monkeypatch):
    (row,) = pk.rows("--report_to", "kubeflow")
    assert not row.imports and "KUBEFLOW_TRAINER_SERVER_URL" in row.note
    monkeypatch.delenv("DISABLE_KUBEFLOW_INTEGRATION", raising=False)
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    assert not pk.available(row)
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "http://trainer")
    assert pk.available(row)


def test_spot_facts():
    """A few rows against the libraries' own names, as the earlier bytecode reading derived them."""
    import transformers.utils as utils
    from transformers.utils.import_utils import BITSANDBYTES_MIN_VERSION, TORCHAO_MIN_VERSION

    (torchao,) = pk.rows("--optim", "adamw_torch_4bit")
    assert pk.resolve(torchao.helper)[1] is utils.is_torchao_available
    assert (torchao.package, torchao.version, torchao.install) == ("torchao", TORCHAO_MIN_VERSION,
                                                                   f"torchao>={TORCHAO_MIN_VERSION}")
    (bnb,) = pk.rows("--optim", "paged_adamw_8bit")
    assert bnb.install == f"bitsandbytes>={BITSANDBYTES_MIN_VERSION}"
    assert [r.package for r in pk.rows("--use_4bit_quantization", "True")] == ["accelerate", "bitsandbytes"]
    assert [r.check for r in pk.rows("distributed_type", "DEEPSPEED")] == ["is_deepspeed_available"]  # not rich's
    assert [r.check for r in pk.rows("--report_to", "flyte")] == ["is_flytekit_available"]  # pandas: a warning
    assert od.bitsandbytes_optimizers() == {r.value for r in pk.TABLE if r.package == "bitsandbytes"
                                            and r.setting == "--optim"}


def test_a_helper_missing_from_a_newer_library_does_not_stop_a_run():
    row = pk.Package("--optim", "x", "x", "", "x", "transformers.trainer_optimizer.is_gone_available",
                     "transformers.trainer_optimizer._get_adamw_torch")
    assert pk.available(row)


# --- the messages, as they were before the table ----------------------------------------------------------------

def _owner(library: str) -> str:
    return f"{library} {importlib.import_module(library).__version__}'s"


def test_messages_of_a_helper_a_version_and_a_url(monkeypatch):
    tf = _owner("transformers")
    _absent(monkeypatch, "--report_to", "wandb")
    assert od.report_to_problems(["wandb"]) == [
        f"--report_to wandb: needs wandb, which is not available here ({tf} WandbCallback.__init__ checks "
        "is_wandb_available()). Fix: pip install 'wandb', or --report_to none (losses go to the log and "
        "run_record.json only)."]
    _absent(monkeypatch, "--optim", "adamw_torch_4bit")
    assert od.optimizer_problems("adamw_torch_4bit") == [
        f"--optim adamw_torch_4bit: needs torchao>=0.15.0, which is not installed here ({tf} _get_torchao_optimizer "
        "checks is_torchao_available()). Fix: pip install 'torchao>=0.15.0', or --optim adamw_torch (needs nothing)."]
    _absent(monkeypatch, "--optim", "adamw_anyprecision")
    assert od.optimizer_problems("adamw_anyprecision") == [
        f"--optim adamw_anyprecision: needs torchdistx, which is not installed here ({tf} _get_adamw_anyprecision "
        "checks import torchdistx). Fix: install torchdistx (https://github.com/pytorch/torchdistx), or --optim "
        "adamw_torch (needs nothing)."]
    _absent(monkeypatch, "--optim", "galore_adamw")
    (problem,) = od.optimizer_problems("galore_adamw")
    assert "Fix: pip install 'git+https://github.com/jiaweizzhao/GaLore', or --optim adamw_torch" in problem


def test_messages_of_two_checks_and_of_a_note(monkeypatch):
    tf = _owner("transformers")
    _absent(monkeypatch, "--report_to", "comet_ml")
    assert od.report_to_problems(["comet_ml"]) == [
        f"--report_to comet_ml: needs comet-ml>=3.43.2, which is not available here ({tf} CometCallback.__init__ "
        "checks _is_comet_installed, _is_comet_recent_enough). Fix: pip install 'comet-ml>=3.43.2', or --report_to "
        "none (losses go to the log and run_record.json only)."]
    _absent(monkeypatch, "--use_4bit_quantization", "True")
    assert od.quantization_problems(SimpleNamespace(use_4bit_quantization=True, use_8bit_quantization=False)) == [
        f"--use_4bit_quantization True: needs accelerate>=1.1.0 and bitsandbytes>=0.46.1, which are not installed "
        f"here ({tf} Bnb4BitHfQuantizer.validate_environment checks is_accelerate_available(), "
        "is_bitsandbytes_available()). Fix: pip install 'accelerate>=1.1.0'; pip install 'bitsandbytes>=0.46.1' "
        "(requirements.txt pins the tested versions), or --use_4bit_quantization False (LoRA on the unquantized "
        "model)."]
    _absent(monkeypatch, "--report_to", "kubeflow")
    (problem,) = od.report_to_problems(["kubeflow"])
    assert problem.startswith(f"--report_to kubeflow: needs kubeflow, which is not available here ({tf} "
                              "KubeflowCallback.__init__ checks is_kubeflow_available()). Fix: \"KubeflowCallback "
                              "requires KUBEFLOW_TRAINER_SERVER_URL environment variable to be set.")


def test_message_of_a_compile_backend_import(monkeypatch):
    import torch

    _absent(monkeypatch, "--torch_compile_backend", "tvm")
    (problem,) = od.torch_compile_problems(SimpleNamespace(torch_compile=True, torch_compile_backend="tvm"))
    assert problem == (
        f"--torch_compile_backend tvm: torch's 'tvm' backend needs tvm, which is not installed here (torch "
        f"{torch.__version__}'s tvm checks import tvm). Fix: install the package that provides `import tvm`, or "
        "--torch_compile_backend one of ['aot_eager', 'cudagraphs', 'eager', 'inductor'] (inductor, the default, "
        "needs nothing), or --torch_compile False.")
