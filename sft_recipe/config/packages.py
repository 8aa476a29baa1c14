"""Which optional package each setting needs, as a declared table: setting and value -> package, minimum version,
install line, the library helper that decides it and the library function that asks.

The facts are those of the pinned stack (transformers 5.24, accelerate 1.15, torch 2.13), read off the libraries'
code once and written down here, so that a reader sees them and a test can hold the libraries to them:
tests/unit/test_package_table.py fails, naming the value, when a library adds an `--optim`/`--report_to`/compile
backend value this table does not classify, renames a helper or function, or when a helper disagrees with what is
installed. The availability itself is still decided at run time by the library's own helper, looked up by its dotted
name in the module of the function that calls it -- the object that function will call, so a helper patched there
(as the tests do) is the one asked. sft_recipe/config/optional_deps.py turns a missing row into the user's message.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    """One optional package one setting value needs (a value needing two checks or two packages has two rows)."""
    setting: str    # the flag or launcher setting: "--optim", "--report_to", "distributed_type"
    value: str      # the value that needs it: "adamw_torch_4bit", "True", "DEEPSPEED"
    package: str    # the package as users know it (pip's name): "torchao", "liger-kernel", "galore_torch"
    version: str    # the minimum version the library checks, "" when it checks none
    install: str    # a pip requirement, a git+/https URL, or "" when the library names nothing to install
    helper: str     # "module.name" of the availability helper (or flag) as `needed_by` sees it, or a module to import
    needed_by: str  # the library function that checks it and raises, dotted: for the message and the reader
    imports: tuple[str, ...] = ()  # what the helper finds on the path (all of them): the test compares
    note: str = ""  # the library's own words when it names nothing to install (Kubeflow: an environment variable)

    @property
    def is_import(self) -> bool:
        """The library imports the package without a helper (torch_xla, tvm): `helper` is that module's name."""
        return "." not in self.helper

    @property
    def check(self) -> str:
        return self.helper.rsplit(".", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}>={self.version}" if self.version else self.package

    def fix(self) -> str:
        if self.install.startswith("http"):  # not a pip requirement: a project to build (torchdistx)
            return f"install {self.package} ({self.install})"
        if self.install:
            return f"pip install '{self.install}'"
        return f'"{self.note}"' if self.note else f"install the package that provides `import {self.check}`"

    def checked_as(self) -> str:
        """How the library checks it, as the message says it: `is_x_available()`, a flag's name, `import x`."""
        if self.is_import:
            return f"import {self.helper}"
        return f"{self.check}()" if callable(_helper(self)) else self.check


# --- the table ---------------------------------------------------------------------------------------------------

_OPT = "transformers.trainer_optimizer"
_INT = "transformers.integrations.integration_utils"


def _rows(setting: str, values: str, package: str, *, helper: str, needed_by: str, install: str = "",
          version: str = "", imports: tuple[str, ...] = (), note: str = "") -> tuple[Package, ...]:
    """The same need for each of several values (transformers dispatches them to one handler)."""
    return tuple(Package(setting, value, package, version, install, helper, needed_by, imports, note)
                 for value in values.split())


def _report_to(value: str, callback: str, package: str, helper: str, imports: tuple[str, ...] | None = None,
               **kw) -> tuple[Package, ...]:
    """A logger: its callback's __init__ checks the helper; what to install is the package, unless said otherwise."""
    return _rows("--report_to", value, package, helper=f"{_INT}.{helper}", needed_by=f"{_INT}.{callback}.__init__",
                 install=kw.pop("install", package), imports=(package,) if imports is None else imports, **kw)


def _bnb_quantizer(bits: int) -> tuple[Package, ...]:
    """transformers' bitsandbytes quantizer checks accelerate, then bitsandbytes (the message keeps that order)."""
    module = f"transformers.quantizers.quantizer_bnb_{bits}bit"
    needed_by = f"{module}.Bnb{bits}BitHfQuantizer.validate_environment"
    return (*_rows(f"--use_{bits}bit_quantization", "True", "accelerate", helper=f"{module}.is_accelerate_available",
                   needed_by=needed_by, **_ACCELERATE),
            *_rows(f"--use_{bits}bit_quantization", "True", "bitsandbytes",
                   helper=f"{module}.is_bitsandbytes_available", needed_by=needed_by, **_BNB))


# the versions are the libraries' constants: integration_utils' _MIN_COMET_VERSION, import_utils' *_MIN_VERSION
_COMET = dict(version="3.43.2", install="comet-ml>=3.43.2", imports=("comet_ml",))
_BNB = dict(version="0.46.1", install="bitsandbytes>=0.46.1", imports=("bitsandbytes",))
_ACCELERATE = dict(version="1.1.0", install="accelerate>=1.1.0", imports=("accelerate",))
_LIGER = "transformers.integrations.liger"

TABLE: tuple[Package, ...] = (
    # --optim: the handler transformers' _OPTIMIZER_HANDLERS dispatches each value to
    *_rows("--optim", "adamw_torch_xla", "torch_xla", helper="torch_xla", needed_by=f"{_OPT}._get_adamw_torch_xla"),
    *_rows("--optim", "adamw_torch_npu_fused", "torch_npu", helper="torch_npu",
           needed_by=f"{_OPT}._get_adamw_torch_npu_fused"),
    *_rows("--optim", "adamw_anyprecision", "torchdistx", helper="torchdistx",
           needed_by=f"{_OPT}._get_adamw_anyprecision", install="https://github.com/pytorch/torchdistx"),
    *_rows("--optim", "adamw_torch_4bit adamw_torch_8bit", "torchao", helper=f"{_OPT}.is_torchao_available",
           needed_by=f"{_OPT}._get_torchao_optimizer", version="0.15.0", install="torchao>=0.15.0",
           imports=("torchao",)),  # import_utils' TORCHAO_MIN_VERSION
    *_rows("--optim", "adamw_bnb_8bit adamw_8bit paged_adamw_8bit paged_adamw_32bit lion_8bit lion_32bit "
           "paged_lion_8bit paged_lion_32bit ademamix ademamix_8bit paged_ademamix_8bit paged_ademamix_32bit "
           "rmsprop_bnb rmsprop_bnb_8bit rmsprop_bnb_32bit", "bitsandbytes", helper=f"{_OPT}.is_bitsandbytes_available",
           needed_by=f"{_OPT}._get_bitsandbytes_optimizer", **_BNB),
    *_rows("--optim", "galore_adamw galore_adamw_8bit galore_adafactor galore_adamw_layerwise "
           "galore_adamw_8bit_layerwise galore_adafactor_layerwise", "galore_torch",
           helper=f"{_OPT}.is_galore_torch_available", needed_by=f"{_OPT}._get_galore_optimizer",
           install="git+https://github.com/jiaweizzhao/GaLore", imports=("galore_torch",)),
    *_rows("--optim", "apollo_adamw apollo_adamw_layerwise", "apollo_torch", helper=f"{_OPT}.is_apollo_torch_available",
           needed_by=f"{_OPT}._get_apollo_optimizer", install="git+https://github.com/zhuhanqing/APOLLO",
           imports=("apollo_torch",)),
    *_rows("--optim", "lomo adalomo", "lomo-optim", helper=f"{_OPT}.is_lomo_available",
           needed_by=f"{_OPT}._get_lomo_optimizer", install="lomo-optim", imports=("lomo_optim",)),
    *_rows("--optim", "grokadamw", "grokadamw", helper=f"{_OPT}.is_grokadamw_available",
           needed_by=f"{_OPT}._get_grokadamw", install="grokadamw", imports=("grokadamw",)),
    # schedule_free_radam also needs 1.4.0, which transformers checks only while building the optimizer
    *_rows("--optim", "schedule_free_adamw schedule_free_sgd schedule_free_radam", "schedulefree",
           helper=f"{_OPT}.is_schedulefree_available", needed_by=f"{_OPT}._get_schedule_free_optimizer",
           version="1.2.6", install="schedulefree>=1.2.6", imports=("schedulefree",)),  # SCHEDULEFREE_MIN_VERSION
    *_rows("--optim", "stable_adamw", "torch-optimi", helper=f"{_OPT}.is_torch_optimi_available",
           needed_by=f"{_OPT}._get_stable_adamw", install="torch-optimi", imports=("optimi",)),
    # --report_to: the callback class INTEGRATION_TO_CALLBACK maps each name to; its __init__ checks
    *_report_to("azure_ml", "AzureMLCallback", "azureml-sdk", "is_azureml_available", imports=("azureml.core.run",)),
    *_report_to("comet_ml", "CometCallback", "comet-ml", "_is_comet_installed", **_COMET),  # module-level flags
    *_report_to("comet_ml", "CometCallback", "comet-ml", "_is_comet_recent_enough", **_COMET),
    *_report_to("mlflow", "MLflowCallback", "mlflow", "is_mlflow_available"),
    *_report_to("neptune", "NeptuneCallback", "neptune", "is_neptune_available"),
    *_report_to("tensorboard", "TensorBoardCallback", "tensorboard", "is_tensorboard_available"),  # or tensorboardX
    *_report_to("trackio", "TrackioCallback", "trackio", "is_trackio_available"),
    *_report_to("wandb", "WandbCallback", "wandb", "is_wandb_available"),
    *_report_to("codecarbon", "CodeCarbonCallback", "codecarbon", "is_codecarbon_available"),
    *_report_to("clearml", "ClearMLCallback", "clearml", "is_clearml_available"),
    *_report_to("dagshub", "DagsHubCallback", "dagshub", "is_dagshub_available", imports=("dagshub", "mlflow")),
    *_report_to("flyte", "FlyteCallback", "flytekit", "is_flytekit_available"),  # pandas there only picks a warning
    *_report_to("dvclive", "DVCLiveCallback", "dvclive", "is_dvclive_available"),
    *_report_to("swanlab", "SwanLabCallback", "swanlab", "is_swanlab_available"),
    *_report_to("kubeflow", "KubeflowCallback", "kubeflow", "is_kubeflow_available", install="", imports=(),
                note="KubeflowCallback requires KUBEFLOW_TRAINER_SERVER_URL environment variable to be set. This is "
                     "automatically set when running inside a Kubeflow TrainJob with TrainJobRuntimeStatus enabled."),
    # the other settings
    *_rows("--use_liger_kernel", "True", "liger-kernel", helper=f"{_LIGER}.is_liger_kernel_available",
           needed_by=f"{_LIGER}.apply_liger_kernel", version="0.3.0",
           install="liger-kernel>=0.3.0", imports=("liger_kernel",)),  # the version is in the helper's own code
    *_bnb_quantizer(4),
    *_bnb_quantizer(8),
    # torch's registered backend function imports it when it compiles
    *_rows("--torch_compile_backend", "tvm", "tvm", helper="tvm", needed_by="torch._dynamo.backends.tvm.tvm"),
    # --deepspeed, ACCELERATE_USE_DEEPSPEED and an accelerate config's distributed_type all mean this launcher
    *_rows("distributed_type", "DEEPSPEED", "deepspeed", helper="accelerate.commands.launch.is_deepspeed_available",
           needed_by="accelerate.commands.launch.deepspeed_launcher", install="deepspeed", imports=("deepspeed",)),
)

# Values that need no optional package, declared so that every value the libraries accept is classified.
NEEDS_NOTHING: dict[str, frozenset[str]] = {
    "--optim": frozenset({"adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"}),
    "--report_to": frozenset({"all", "none"}),  # all: what transformers finds installed; none: no callback
    "--torch_compile_backend": frozenset({"no", "inductor", "eager", "aot_eager", "cudagraphs"}),
    "--use_liger_kernel": frozenset({"False"}),
    "--use_4bit_quantization": frozenset({"False"}),
    "--use_8bit_quantization": frozenset({"False"}),
    "distributed_type": frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "FSDP"}),  # the recipe's other engines
}

# `--torch_compile_backend` values accelerate 1.15 accepts but torch 2.13 does not register by itself: what provides
# each (torch registers a backend when its package is imported or declares the entry point).
COMPILE_BACKENDS_TORCH_LACKS = {  # name: (why torch lacks it here, the pip package that registers it or "")
    "tensorrt": ("it comes with the torch-tensorrt package, for NVIDIA GPUs", "torch-tensorrt"),
    "fx2trt": ("it came with torch-tensorrt's retired FX path", ""),
    "onnxrt": ("torch no longer ships it; onnxruntime provides its own torch.compile backend", ""),
    "aot_torchxla_trace_once": ("torch_xla now registers its backend as openxla, on TPU/XLA machines", ""),
    "torchxla_trace_once": ("torch_xla now registers its backend as openxla_eval, on TPU/XLA machines", ""),
    "hpu_backend": ("it comes with Intel Gaudi's habana_frameworks, on HPU machines only", ""),
    "neuron": ("it comes with AWS Neuron's torch-neuronx, on Trainium/Inferentia only", ""),
    "aot_ts_nvfuser": ("torch removed nvFuser's TorchScript backend", ""),
    "nvprims_nvfuser": ("torch removed nvFuser's PrimTorch backend", ""),
    "ofi": ("torch no longer registers optimize_for_inference as a backend", ""),
}


# --- the run-time check ------------------------------------------------------------------------------------------

def rows(setting: str, value: str) -> list[Package]:
    return [row for row in TABLE if row.setting == setting and row.value == value]


def missing(setting: str, value: str) -> list[Package]:
    """The rows of (setting, value) whose helper says no now; [] for a value needing nothing or not in the table (a
    value a newer library adds: its own error still speaks, and the table's test names the value)."""
    return [row for row in rows(setting, value) if not available(row)]


def available(row: Package) -> bool:
    if row.is_import:
        return module_available(row.helper)
    try:
        helper = _helper(row)
    except (ImportError, AttributeError):  # a helper a newer library renamed: never stop a run on the table's age
        return True
    if isinstance(helper, bool):  # comet's module-level flags
        return helper is not False
    try:
        return bool(helper())
    except Exception:  # a helper that cannot even answer: its package is broken
        return False


def module_available(name: str) -> bool:
    """Whether `import name` would find the package (as the libraries' own try/except-import does)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _helper(row: Package):
    module, name = row.helper.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)  # read each time: a patched helper is the one asked


def resolve(dotted: str) -> tuple[str, object]:
    """(the module part, the object) of a dotted name such as `pkg.mod.Class.method`."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return module, obj
    raise ImportError(dotted)


def version_of(library: str) -> str:
    return getattr(sys.modules.get(library), "__version__", "")


def owner(row: Package) -> str:
    """"transformers 5.24.0's _get_torchao_optimizer": the function that checks, for the messages."""
    library = row.needed_by.split(".")[0]
    importlib.import_module(library)
    module = row.needed_by.rsplit(".", 1)[0]
    try:
        module, _ = resolve(row.needed_by)
    except (ImportError, AttributeError):  # renamed in a newer library: the name as declared still reads right
        pass
    return f"{library} {version_of(library)}'s {row.needed_by[len(module) + 1:]}"


def needs_text(absent: list[Package], state: str = "installed") -> str:
    """"torchao>=0.15.0, which is not installed here" (each requirement once)."""
    requirements = list(dict.fromkeys(row.requirement for row in absent))
    return f"{' and '.join(requirements)}, which {'is' if len(requirements) == 1 else 'are'} not {state} here"


def fix_text(absent: list[Package]) -> str:
    return "; ".join(dict.fromkeys(row.fix() for row in absent))


def checks_text(absent: list[Package]) -> str:
    """"transformers 5.24.0's CometCallback.__init__ checks _is_comet_installed, _is_comet_recent_enough"."""
    return f"{owner(absent[0])} checks {', '.join(row.checked_as() for row in absent)}"
