"""Optional packages that a setting implies, checked before any weight loads, as the pinned libraries decide them.

Every setting that pulls in an optional package ends in one function of transformers, accelerate or torch: the
handler transformers dispatches `--optim` to, the callback class a `--report_to` name maps to, `apply_liger_kernel`,
the bitsandbytes quantizers, the backend torch's registry returns for `--torch_compile_backend`, accelerate's DeepSpeed
launcher. That function checks its package itself and raises when it is missing -- after the model has loaded. The
declared table (sft_recipe/config/packages.py) says, per setting and value, which package, version and install line,
and which helper of the library decides; here each missing one becomes the user's message, before anything loads.
tests/unit/test_package_table.py fails when a value the pinned libraries accept is in neither the table nor its
"needs nothing" lists, or when the table and the libraries' helpers disagree. docs/integrations.md says what works
with LoRA/QLoRA under each engine.
"""

from __future__ import annotations

import sys

from sft_recipe.config import packages
from sft_recipe.config.packages import COMPILE_BACKENDS_TORCH_LACKS, checks_text, fix_text, needs_text, version_of
from sft_recipe.errors import check_not_run

SAFE_OPTIMIZER = "adamw_torch"  # the fix offered for an optimizer whose package is missing

# --- the values the pinned libraries accept ------------------------------------------------------------------------

def optimizer_names() -> list[str]:
    from transformers.training_args import OptimizerNames

    return [o.value for o in OptimizerNames]


def bitsandbytes_optimizers() -> frozenset[str]:
    """The `--optim` values transformers builds with bitsandbytes (its handler checks is_bitsandbytes_available)."""
    return frozenset(row.value for row in packages.TABLE if row.setting == "--optim" and row.package == "bitsandbytes")


def report_to_names() -> list[str]:
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return list(INTEGRATION_TO_CALLBACK)


# --- the checks --------------------------------------------------------------------------------------------------

def package_problem(asked: str, setting: str, value: str, alternative: str, *, state: str = "installed",
                    note: str = "") -> list[str]:
    """[] when every package (setting, value) needs is there; else the one problem every optional setting reports:
    `asked: needs X>=V, which is not <state> here (how the library checks<note>). Fix: <install><alternative>`."""
    missing = packages.missing(setting, value)
    if not missing:
        return []
    return [f"{asked}: needs {needs_text(missing, state)} ({checks_text(missing)}{note}). "
            f"Fix: {fix_text(missing)}{alternative}"]


def optimizer_problems(optim: str) -> list[str]:
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS

    if optim not in _OPTIMIZER_HANDLERS:  # what transformers dispatches on
        return [f"--optim {optim}: transformers {version_of('transformers')} has no handler for it. Fix: "
                f"--optim {SAFE_OPTIMIZER}."]
    return package_problem(f"--optim {optim}", "--optim", optim, f", or --optim {SAFE_OPTIMIZER} (needs nothing).")


def report_to_problems(report_to) -> list[str]:
    names = [] if report_to is None else [report_to] if isinstance(report_to, str) else list(report_to)
    if names == ["none"]:
        return []
    if names == ["all"]:  # what transformers expands it to (TrainingArguments already did, once parsed)
        from transformers.integrations import get_available_reporting_integrations

        names = get_available_reporting_integrations()
    known = report_to_names()
    problems = []
    for name in names:
        if name not in known:
            comma = (" One integration per value: for several, a --config YAML with report_to: "
                     f"[{', '.join(x.strip() for x in name.split(','))}].") if "," in name else ""
            problems.append(f"--report_to {name}: transformers {version_of('transformers')} has no such "
                            f"integration.{comma} Fix: one of {sorted(known)}, or --report_to none.")
            continue
        other = f"leave {name} out of report_to, or " if len(names) > 1 else ""
        missing = package_problem(f"--report_to {name}", "--report_to", name, f", or {other}--report_to none "
                                  "(losses go to the log and run_record.json only).", state="available")
        problems += missing
        if name in ("mlflow", "dagshub") and not missing:
            problems += mlflow_store_problems(name, other)
    return problems


def mlflow_store_problems(name: str, other: str = "") -> list[str]:
    """MLflow opens its tracking store only when transformers' MLflowCallback starts the run, after the model has
    loaded. MLflow 3 refuses a local `./mlruns` (file) store ("maintenance mode") unless MLFLOW_ALLOW_FILE_STORE=true,
    and mlflow-skinny, which provides the `mlflow` module, has no sqlite store, MLflow 3's default: such a run died at
    its first step. The store is
    opened here the way the callback does (`MlflowClient()` on MLFLOW_TRACKING_URI or MLflow's default): a remote
    server is not contacted (its client connects on first use)."""
    try:
        import mlflow
    except Exception as e:  # noqa: BLE001 -- found but not importable: said, and transformers fails loudly later
        check_not_run("the MLflow tracking-store check", e)
        return []
    try:
        mlflow.MlflowClient()
    except Exception as e:  # noqa: BLE001 -- whatever MLflow raises for a store it cannot open is the user's message
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return [f"--report_to {name}: MLflow cannot open its tracking store {mlflow.get_tracking_uri()} ({first}). "
                "Fix: MLFLOW_TRACKING_URI=http://<your tracking server>; or a local store this MLflow opens: "
                "MLFLOW_ALLOW_FILE_STORE=true with MLFLOW_TRACKING_URI=file:///<folder>/mlruns (MLflow's own opt-in), "
                f"or sqlite:///mlflow.db with the full `pip install mlflow`; or {other}--report_to none."]
    return []


def liger_problems() -> list[str]:
    return package_problem("--use_liger_kernel True", "--use_liger_kernel", "True", " on a GPU machine, or "
                           "--use_liger_kernel False.", note="; its Triton kernels also need a CUDA GPU")


def quantization_problems(m) -> list[str]:
    problems = []
    for flag in ("use_4bit_quantization", "use_8bit_quantization"):
        if getattr(m, flag):
            problems += package_problem(f"--{flag} True", f"--{flag}", "True", " (requirements.txt pins the tested "
                                        f"versions), or --{flag} False (LoRA on the unquantized model).")
    return problems


def torch_compile_problems(t) -> list[str]:
    """The backend name goes through accelerate (its DynamoBackend enum) to torch's backend registry, and the
    registered backend function then imports what it needs (tvm); each step is checked as the libraries do it."""
    if not t.torch_compile:
        return []
    from accelerate.utils import DynamoBackend

    backend = str(t.torch_compile_backend or "inductor")
    usable = sorted(b for b in (d.value.lower() for d in DynamoBackend) if b != "no" and not compile_backend_problem(b))
    fix = f"--torch_compile_backend one of {usable} (inductor, the default, needs nothing), or --torch_compile False"
    if backend.upper() not in DynamoBackend.__members__:
        import accelerate

        return [f"--torch_compile_backend {backend}: accelerate {accelerate.__version__} knows no such torch.compile "
                f"backend (its DynamoBackend). Fix: {fix}."]
    problem = compile_backend_problem(backend.lower()) if backend.lower() != "no" else None
    if problem is None:
        return []
    why, install = problem
    return [f"--torch_compile_backend {backend}: {why}. Fix: {install + ', or ' if install else ''}{fix}."]


def compile_backend_registered(name: str) -> bool:
    """Whether torch's backend registry (third-party entry points included) has `name`."""
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend(name)
        return True
    except Exception:
        return False


def compile_backend_problem(name: str) -> tuple[str, str] | None:
    """(why torch.compile(backend=name) cannot run here, what to install or ""), or None when it can."""
    import torch

    if not compile_backend_registered(name):
        why, package = COMPILE_BACKENDS_TORCH_LACKS.get(name, ("a package must register it with torch", ""))
        return f"torch {torch.__version__} has no '{name}' backend here ({why})", \
            f"pip install '{package}'" if package else ""
    missing = packages.missing("--torch_compile_backend", name)  # what the registered backend function imports
    if missing:
        return f"torch's '{name}' backend needs {needs_text(missing)} ({checks_text(missing)})", fix_text(missing)
    return None


def deepspeed_problems(asked_by: str, fails: str = "transformers fails while parsing the arguments") -> list[str]:
    """`asked_by` (the flag or launcher setting) needs DeepSpeed: [] when accelerate finds it installed."""
    return package_problem(asked_by, "distributed_type", "DEEPSPEED", " (requirements-dev.txt pins the tested "
                           "version), or an FSDP config instead (configs/fsdp_config.yaml; CPU: "
                           "configs/cpu/fsdp2_config.yaml).", note=f"; without it {fails}")


def engine_problems(deepspeed_flag, launch) -> list[str]:
    """DeepSpeed asked for by --deepspeed or by the launcher (ACCELERATE_USE_DEEPSPEED): checked by parse_args before
    transformers builds its arguments, which is where a missing DeepSpeed fails (a TypeError in __post_init__)."""
    if deepspeed_flag:
        return deepspeed_problems(f"--deepspeed {deepspeed_flag}")
    if launch.use_deepspeed:
        return deepspeed_problems("ACCELERATE_USE_DEEPSPEED=true (a DeepSpeed accelerate config)")
    return []


def optional_dependency_problems(m, t, launch) -> list[str]:
    """Every optional package the settings imply that is missing, one problem each (validate() lists them)."""
    problems = optimizer_problems(str(getattr(t.optim, "value", t.optim)))  # an OptimizerNames enum once parsed
    problems += report_to_problems(t.report_to)
    problems += liger_problems() if t.use_liger_kernel else []
    problems += torch_compile_problems(t)
    problems += quantization_problems(m)
    problems += engine_problems(t.deepspeed, launch)  # parse_args asked first: transformers fails there without it
    return problems


def accelerate_config_problems(config_file: str) -> list[str]:
    """The launcher's side: what `accelerate launch --config_file config_file` itself needs before any rank starts
    (DeepSpeed: accelerate raises its own ImportError otherwise)."""
    import yaml

    with open(config_file) as f:
        config = yaml.safe_load(f) or {}
    if str(config.get("distributed_type", "")).upper() == "DEEPSPEED":
        return deepspeed_problems(f"--config_file {config_file} (distributed_type: DEEPSPEED)",
                                  "`accelerate launch` stops with its own ImportError before train.py starts")
    return []


def main(argv: list[str] | None = None) -> int:
    """python -m sft_recipe.config.optional_deps --accelerate_config FILE: exit 2 listing what the launcher lacks."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--accelerate_config", required=True)
    problems = accelerate_config_problems(parser.parse_args(argv).accelerate_config)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
