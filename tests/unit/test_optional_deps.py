"""Every setting that needs an optional package is refused before any weight loads, naming flag, package and fix.

The packages each setting needs are a declared table (sft_recipe/config/packages.py, held to the libraries by
tests/unit/test_package_table.py); these tests pin that the check calls the library's own helpers and that each flag
of issue 20 prints its message -- with the package's absence simulated by patching the library's helper, so the tests
mean the same on a machine where the package is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from sft_recipe.config import optional_deps as od
from sft_recipe.config import packages
from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.preflight.validate import validate
from tests.helpers import REPO


@pytest.fixture()
def good(tiny, tmp_path, monkeypatch):
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.delenv(key, raising=False)
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out"), "--use_peft_lora", "True"]


def _set(monkeypatch, setting: str, value: str, available: bool) -> None:
    """Make every check (setting, value) needs answer `available`, where the library looks it up (the module of the
    function that asks)."""
    for row in packages.rows(setting, value):
        if row.is_import:
            continue
        module, name = row.helper.rsplit(".", 1)
        module = importlib.import_module(module)
        monkeypatch.setattr(module, name, available if isinstance(getattr(module, name), bool)
                            else lambda *args, **kwargs: available)
    monkeypatch.setattr(packages, "module_available", lambda name: available)


def _problems(argv) -> list[str]:
    with pytest.raises(ConfigError) as e:
        validate(*parse_args(argv))
    return e.value.problems


# --- the values the libraries accept (the table itself: tests/unit/test_package_table.py) -----------------------

def test_the_docs_say_where_every_value_works():
    """docs/integrations.md has a row for every --optim and --report_to value the pinned transformers accepts."""
    import re

    prose = re.sub(r"```.*?```", "", (REPO / "docs" / "integrations.md").read_text(), flags=re.S)
    spans = re.findall(r"`([^`]+)`", prose)
    named = {word for span in spans for word in span.split()}
    missing = sorted(set(od.optimizer_names() + od.report_to_names()) - named)
    assert not missing, f"docs/integrations.md does not say where these work: {missing}"


def test_the_real_helpers_decide(monkeypatch):
    """Unpatched, the check says what the library says: a package here is accepted, one absent is refused."""
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("trackio", "trackio")):
        assert bool(od.report_to_problems([name])) == (importlib.util.find_spec(module) is None), name
    assert bool(od.optimizer_problems("galore_adamw")) == (importlib.util.find_spec("galore_torch") is None)
    assert od.optimizer_problems("adamw_torch") == [] and od.optimizer_problems("paged_adamw_8bit") == []


def test_the_fsdp_refusal_covers_every_bitsandbytes_optimizer():
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, _get_bitsandbytes_optimizer

    derived = od.bitsandbytes_optimizers()
    assert derived == {name for name, handler in _OPTIMIZER_HANDLERS.items() if handler is _get_bitsandbytes_optimizer}
    before = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "paged_lion_8bit",
              "paged_lion_32bit", "rmsprop_bnb_8bit", "ademamix_8bit", "paged_ademamix_8bit", "paged_ademamix_32bit"}
    assert before <= derived  # the hand list it replaces (rmsprop_8bit there was no transformers value)


# --- each value the check derives: refused when missing, accepted when present --------------------------------------

@pytest.mark.parametrize("name", [n for n in od.optimizer_names() if n not in packages.NEEDS_NOTHING["--optim"]])
def test_each_optimizer_needing_a_package(name, monkeypatch):
    _set(monkeypatch, "--optim", name, available=False)
    (problem,) = od.optimizer_problems(name)
    assert problem.startswith(f"--optim {name}: needs ") and "Fix: " in problem
    assert problem.endswith("or --optim adamw_torch (needs nothing).")
    for row in packages.rows("--optim", name):
        assert row.requirement in problem and row.fix() in problem
    _set(monkeypatch, "--optim", name, available=True)
    assert od.optimizer_problems(name) == []


@pytest.mark.parametrize("name", od.report_to_names())
def test_each_report_to_integration(name, monkeypatch):
    _set(monkeypatch, "--report_to", name, available=False)
    (problem,) = od.report_to_problems([name])
    assert problem.startswith(f"--report_to {name}: needs ") and "Fix: " in problem
    assert problem.endswith("or --report_to none (losses go to the log and run_record.json only).")
    assert all(row.fix() in problem for row in packages.rows("--report_to", name))
    _set(monkeypatch, "--report_to", name, available=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # mlflow, dagshub: a server, not contacted
    assert od.report_to_problems([name]) == []


def _fake_mlflow(monkeypatch, opens: bool):
    """An `mlflow` module whose client fails as MLflow 3.18 (mlflow-skinny) did on a local file store."""
    import types

    def client():
        if not opens:
            raise RuntimeError("The filesystem tracking backend (e.g., './mlruns') is in maintenance mode and will "
                               "not receive further updates.\nPlease migrate to a database backend")

    module = types.SimpleNamespace(MlflowClient=client, get_tracking_uri=lambda: "file:///runs/mlruns")
    monkeypatch.setitem(sys.modules, "mlflow", module)
    _set(monkeypatch, "--report_to", "mlflow", available=True)


def test_an_mlflow_store_that_cannot_be_opened_is_refused_before_the_load(monkeypatch):
    """MLflow opens its store only when the callback starts the run, after the model loaded; the check opens it
    first, the way the callback does."""
    _fake_mlflow(monkeypatch, opens=False)
    (problem,) = od.report_to_problems(["mlflow"])
    assert problem.startswith("--report_to mlflow: MLflow cannot open its tracking store file:///runs/mlruns (The "
                              "filesystem tracking backend (e.g., './mlruns') is in maintenance mode")
    assert "Fix: MLFLOW_TRACKING_URI=http://<your tracking server>" in problem and "\n" not in problem
    (problem,) = od.report_to_problems(["tensorboard", "mlflow"])
    assert problem.endswith("or leave mlflow out of report_to, or --report_to none.")
    _fake_mlflow(monkeypatch, opens=True)
    assert od.report_to_problems(["mlflow"]) == []


def test_the_installed_mlflow_on_a_local_store_is_refused_unless_opted_in(monkeypatch, tmp_path):
    """The real MLflow (mlflow-skinny, requirements-dev.txt) on a local file store: refused with MLflow's own reason
    and the opt-in among the fixes; with MLFLOW_ALLOW_FILE_STORE=true, the store opens and nothing is said."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (problem,) = od.report_to_problems(["mlflow"])
    assert f"MLflow cannot open its tracking store file://{tmp_path / 'mlruns'} (" in problem
    assert "maintenance mode" in problem and "Fix: " in problem
    assert "MLFLOW_ALLOW_FILE_STORE=true with MLFLOW_TRACKING_URI=file:///<folder>/mlruns" in problem
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert od.report_to_problems(["mlflow"]) == []


def test_an_mlflow_that_is_found_but_does_not_import_is_said_not_refused(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # found by the availability helper, not importable
    _set(monkeypatch, "--report_to", "mlflow", available=True)
    with caplog.at_level("WARNING"):
        assert od.report_to_problems(["mlflow"]) == []
    assert "the MLflow tracking-store check could not run" in caplog.text


def test_report_to_lists_all_and_none(monkeypatch):
    import transformers.integrations.integration_utils as integrations

    monkeypatch.setattr(integrations, "is_wandb_available", lambda: False)
    monkeypatch.setattr(integrations, "is_tensorboard_available", lambda: True)
    (problem,) = od.report_to_problems(["tensorboard", "wandb"])  # each value of a list
    assert problem.startswith("--report_to wandb: needs wandb") and "leave wandb out of report_to, or" in problem
    assert od.report_to_problems("none") == [] and od.report_to_problems(["none"]) == []
    monkeypatch.setattr(integrations, "get_available_reporting_integrations", lambda: ["tensorboard"])
    assert od.report_to_problems("all") == []  # all: only what transformers finds installed
    (problem,) = od.report_to_problems(["wandb,tensorboard"])
    assert "has no such integration. One integration per value" in problem and "[wandb, tensorboard]" in problem


@pytest.mark.parametrize("bits", [4, 8])
def test_quantization_needs_bitsandbytes(bits, good, monkeypatch):
    _set(monkeypatch, f"--use_{bits}bit_quantization", "True", available=False)
    problems = _problems(good + [f"--use_{bits}bit_quantization", "True"])
    assert any(p.startswith(f"--use_{bits}bit_quantization True: needs accelerate>=") and "bitsandbytes>=" in p and
               f"or --use_{bits}bit_quantization False" in p for p in problems), problems


def test_a_compile_backend_whose_package_is_missing(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(packages, "module_available", lambda name: name != "tvm")
    (problem,) = od.torch_compile_problems(SimpleNamespace(torch_compile=True, torch_compile_backend="tvm"))
    assert problem.startswith("--torch_compile_backend tvm: torch's 'tvm' backend needs tvm, which is not installed")
    (problem,) = od.torch_compile_problems(SimpleNamespace(torch_compile=True, torch_compile_backend="tensorrt"))
    assert "Fix: pip install 'torch-tensorrt', or --torch_compile_backend one of [" in problem
    assert od.torch_compile_problems(SimpleNamespace(torch_compile=True, torch_compile_backend="inductor")) == []
    assert od.torch_compile_problems(SimpleNamespace(torch_compile=False, torch_compile_backend=None)) == []


# --- issue 20's flags, each with the message it prints, none loading a weight ---------------------------------------

ISSUE_FLAGS = {  # flags -> (what is missing: a (setting, value) of the table, the message validate prints)
    "report_to tensorboard": (["--report_to", "tensorboard"], ("--report_to", "tensorboard"),
                              "--report_to tensorboard: needs tensorboard, which is not available here (transformers "
                              "5.24.0's TensorBoardCallback.__init__ checks is_tensorboard_available()). Fix: pip "
                              "install 'tensorboard', or --report_to none (losses go to the log and run_record.json "
                              "only)."),
    "report_to wandb": (["--report_to", "wandb"], ("--report_to", "wandb"),
                        "--report_to wandb: needs wandb, which is not available here (transformers 5.24.0's "
                        "WandbCallback.__init__ checks is_wandb_available()). Fix: pip install 'wandb', or "
                        "--report_to none (losses go to the log and run_record.json only)."),
    "report_to trackio": (["--report_to", "trackio"], ("--report_to", "trackio"),
                          "--report_to trackio: needs trackio, which is not available here (transformers 5.24.0's "
                          "TrackioCallback.__init__ checks is_trackio_available()). Fix: pip install 'trackio', or "
                          "--report_to none (losses go to the log and run_record.json only)."),
    "optim adamw_torch_4bit": (["--optim", "adamw_torch_4bit"], ("--optim", "adamw_torch_4bit"),
                               "--optim adamw_torch_4bit: needs torchao>=0.15.0, which is not installed here "
                               "(transformers 5.24.0's _get_torchao_optimizer checks is_torchao_available()). Fix: "
                               "pip install 'torchao>=0.15.0', or --optim adamw_torch (needs nothing)."),
    "optim galore_adamw": (["--optim", "galore_adamw", "--optim_target_modules", "all-linear"],
                           ("--optim", "galore_adamw"),
                           "--optim galore_adamw: needs galore_torch, which is not installed here (transformers "
                           "5.24.0's _get_galore_optimizer checks is_galore_torch_available()). Fix: pip install "
                           "'git+https://github.com/jiaweizzhao/GaLore', or --optim adamw_torch (needs nothing)."),
    "use_liger_kernel": (["--use_liger_kernel", "True"], ("--use_liger_kernel", "True"),
                         "--use_liger_kernel True: needs liger-kernel>=0.3.0, which is not installed here "
                         "(transformers 5.24.0's apply_liger_kernel checks is_liger_kernel_available(); its Triton "
                         "kernels also need a CUDA GPU). Fix: pip install 'liger-kernel>=0.3.0' on a GPU machine, or "
                         "--use_liger_kernel False."),
    "torch_compile_backend nonexistent": (["--torch_compile", "True", "--torch_compile_backend", "nonexistent"], None,
                                          "--torch_compile_backend nonexistent: accelerate 1.15.0 knows no such "
                                          "torch.compile backend (its DynamoBackend). Fix: --torch_compile_backend "
                                          "one of ['aot_eager', "),
}


@pytest.mark.parametrize("name", list(ISSUE_FLAGS))
def test_issue_flag_is_refused_before_any_weight_loads(name, good, monkeypatch, capsys):
    """train.py's entry point, in this process, with the model loader made to fail the test if it is reached."""
    import transformers

    import train

    flags, missing, message = ISSUE_FLAGS[name]
    if missing is not None:
        _set(monkeypatch, *missing, available=False)

    def loads_a_weight(*args, **kwargs):
        raise AssertionError("a weight was loaded before the configuration was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loads_a_weight)
    monkeypatch.setattr(train, "load_model", loads_a_weight)
    monkeypatch.setattr(train, "load_tokenizer", loads_a_weight)
    monkeypatch.setattr(train.compat, "install", lambda launch: None)  # process-wide library patches: not here
    monkeypatch.setattr(sys, "argv", ["train.py", *good, *flags])
    assert train.run(LaunchEnv()) == 2  # one process
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


# --- DeepSpeed: train.py's side (before transformers parses) and the launcher's side --------------------------------

def test_deepspeed_missing_is_named_before_transformers_parses(good, monkeypatch, tmp_path):
    _set(monkeypatch, "distributed_type", "DEEPSPEED", available=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError) as e:
        parse_args(good + ["--ddp_backend", "gloo"])
    (problem,) = [p for p in e.value.problems if "deepspeed" in p]
    assert problem.startswith("ACCELERATE_USE_DEEPSPEED=true (a DeepSpeed accelerate config): needs deepspeed, "
                              "which is not installed here (accelerate 1.15.0's deepspeed_launcher checks "
                              "is_deepspeed_available(); without it transformers fails while parsing the arguments)."
                              " Fix: pip install 'deepspeed'")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match=r"--deepspeed \S+ds.json: needs deepspeed"):
        parse_args(good + ["--deepspeed", str(ds_json)])


def test_launcher_preflight_for_a_deepspeed_config(monkeypatch, capsys):
    assert od.main(["--accelerate_config", str(REPO / "configs/fsdp_config.yaml")]) == 0
    _set(monkeypatch, "distributed_type", "DEEPSPEED", available=False)
    assert od.main(["--accelerate_config", str(REPO / "configs/deepspeed_config.yaml")]) == 2
    assert "`accelerate launch` stops with its own ImportError before train.py starts). Fix: pip install " \
           "'deepspeed'" in capsys.readouterr().err


