"""LoRA on a GPTQ base (upstream's run_peft_fsdp_gptq.sh), on CPU: a real GPTQ quantization of the tiny model, then
the shipped script in one process and under FSDP1 on 2 processes, the merge refusal, and the checks up front.

GPT-QModel 7.7 + optimum 2.3 (what transformers 5.24 loads GPTQ through) quantize and train on CPU here, but
gptqmodel declares torch>=2.14.1 while the recipe pins 2.13.0: scripts/setup_gptq.sh installs them with --no-deps into
.venv/gptq-site, which only these runs put on PYTHONPATH (the rest of the suite never sees them). The runs build no
GPT-QModel kernel, on a fresh machine too (each gets an empty kernel folder): the quantization uses the torch kernel
and the Python packer, and the training's kernel choice no longer compiles the AVX512 inference kernel on its way to
a trainable one (sft_recipe/compat/gptq_kernels.py; it cost ~80 CPU-s on every new machine).
The checks up front need no GPTQ library: a config that says `quant_method: gptq` is enough.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.preflight.validate import validate
from tests.helpers import REPO, launch_env, run_command

SITE = REPO / ".venv" / "gptq-site"
TINY = ["--use_flash_attn", "False", "--bf16", "False", "--max_steps", "2", "--max_seq_len", "128",
        "--logging_steps", "1", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--eval_strategy", "no", "--save_strategy", "no", "--learning_rate", "3e-3"]
TARGETS = "q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj"  # the script's, as upstream


def _gptq_env(**extra) -> dict:
    env = launch_env()
    env["PYTHONPATH"] = str(SITE)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def gptq_model(tiny, tmp_path_factory):
    setup = subprocess.run(["bash", "scripts/setup_gptq.sh"], cwd=REPO, capture_output=True, text=True, timeout=600)
    if setup.returncode != 0:
        pytest.skip(f"scripts/setup_gptq.sh could not install optimum/gptqmodel (package index unreachable?): "
                    f"{setup.stderr[-500:]}")
    dest = tmp_path_factory.mktemp("gptq") / "model"
    # the Python packer: GPT-QModel's C++ one is compiled the first time on a machine (~20 CPU-s), for the same bytes
    build = subprocess.run([sys.executable, "-m", "sft_recipe.train.gptq", "--build_tiny", str(dest), "--source",
                            str(tiny.model_dir)], cwd=REPO, env=_gptq_env(GPTQMODEL_DISABLE_PACK_EXT="1"),
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    quant = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["bits"]) == ("gptq", 4)
    return dest


def test_lora_on_a_gptq_base_in_one_process_and_under_fsdp(gptq_model, tiny, tmp_path):
    runs = {}
    for name, config in (("single", "configs/cpu/single.yaml"), ("fsdp1", "configs/cpu/fsdp_config.yaml")):
        out = tmp_path / name
        env = _gptq_env(MODEL=str(gptq_model), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(out),
                        ACCELERATE_CONFIG=config, NUM_PROCESSES="1" if name == "single" else "2",
                        GPTQMODEL_TORCH_EXTENSIONS_DIR=str(tmp_path / "kernels"))  # as on a machine that built none
        result = run_command(["bash", "run_peft_fsdp_gptq.sh", *TINY], out, env=env)
        assert result.returncode == 0, result.output[-5000:]
        # Loaded quantized: transformers reports checkpoint keys it could not place (qweight ...) and Linear weights
        # it had to initialise when a GPTQ checkpoint is loaded as a plain model.
        assert "UNEXPECTED" not in result.output and "MISSING" not in result.output
        assert "adapter check OK" in result.output
        runs[name] = result
    built = [p.name for p in (tmp_path / "kernels").rglob("*") if p.is_file()]
    assert built == [], f"GPT-QModel built kernels while loading for training: {built}"
    single, fsdp = runs["single"].record, runs["fsdp1"].record
    assert (single["distribution"]["num_processes"], single["run"]["quantization"]) == (1, "gptq")
    how = fsdp["distribution"]
    assert (how["distributed_type"], how["fsdp_version"], how["num_processes"]) == ("FSDP", 1, 2)
    for facts in (single, fsdp):
        assert facts["weights"]["trainable_changed"] is True and facts["weights"]["frozen_changed"] is False
    adapter_config = json.loads((tmp_path / "single" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == sorted(TARGETS.split(","))

    # Merging: refused against the int4 base, with the reason; accepted into the model it was quantized from.
    from sft_recipe.merge import MergeError, merge_adapter, plan_merge

    with pytest.raises(MergeError, match="is a GPTQ int4 checkpoint: LoRA cannot be merged into its packed weights"):
        plan_merge(tmp_path / "single", tmp_path / "merged")
    result = merge_adapter(tmp_path / "single", tmp_path / "merged", log=lambda *_: None,
                           base_model_name_or_path=str(tiny.model_dir))
    assert (tmp_path / "merged" / "config.json").is_file() and result is not None


# Which candidate kernels GPT-QModel's trainable choice validates, with each validate_once (where a kernel is built)
# spied on: an inference-only kernel's stands in for its build (no minutes spent), the others run.
_KERNEL_CHOICE = """
import json, sys
import torch
from gptqmodel.models._const import DEVICE
from gptqmodel.quantization import FORMAT, METHOD
from gptqmodel.utils import BACKEND
from gptqmodel.utils.importer import AUTO_BACKEND_KERNEL_MAPPING, select_quant_linear

candidates = list(AUTO_BACKEND_KERNEL_MAPPING[METHOD.GPTQ][FORMAT.GPTQ].values())
built = []
for cls in candidates:
    def spy(kls, real=cls.__dict__.get("validate_once")):
        built.append(kls)
        if not kls.SUPPORTS_TRAINING:
            return True, None
        return real.__func__(kls) if real is not None else (True, None)
    cls.validate_once = classmethod(spy)

def choose():
    for cls in candidates:
        cls.cached_validate_once.__func__.cache_clear()
    built.clear()
    chosen = select_quant_linear(bits=4, group_size=32, desc_act=False, sym=True, device=DEVICE.CPU,
                                 backend=BACKEND.AUTO_TRAINABLE, pack_dtype=torch.int32, dtype=torch.float32)
    return {"chosen": chosen.__name__, "built_untrainable": [k.__name__ for k in built if not k.SUPPORTS_TRAINING]}

upstream = choose()
from sft_recipe.compat.gptq_kernels import check_trainability_before_building
patched_now, patched_again = check_trainability_before_building(), check_trainability_before_building()
print(json.dumps({"upstream": upstream, "patched": choose(), "calls": [patched_now, patched_again]}))
"""


def test_gpt_qmodel_builds_no_kernel_it_cannot_train_with(gptq_model):
    """compat.check_trainability_before_building: GPT-QModel 7.7's own choice builds the AVX512 inference kernel (its
    validate_once) before it reads SUPPORTS_TRAINING; with the workaround nothing untrainable is built and the
    choice is the same. When the first assertion fails, GPT-QModel checks first itself: the workaround can go."""
    proc = subprocess.run([sys.executable, "-c", _KERNEL_CHOICE], cwd=REPO, env=_gptq_env(PYTHONPATH=f"{SITE}:{REPO}"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "TorchCpuAvx512Linear" in facts["upstream"]["built_untrainable"], facts
    assert facts["patched"] == {"chosen": facts["upstream"]["chosen"], "built_untrainable": []}, facts
    assert facts["calls"] == [True, False]  # patched once, however often the loading asks


@pytest.fixture()
def gptq_config_only(tiny, tmp_path):
    """A folder whose config says GPTQ, with a whole (placeholder) weights file: what the checks before loading read.
    No weight is ever loaded from it."""
    from safetensors.torch import save_file

    folder = tmp_path / "gptq-config"
    folder.mkdir()
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))
    config = json.loads((tiny.model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                     "sym": True}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.model_dir / name, folder / name)
    return folder


def _problems(argv) -> str:
    with pytest.raises(ConfigError) as e:
        validate(*parse_args(argv))
    return "\n".join(e.value.problems)


def test_gptq_configurations_that_cannot_work_are_refused_up_front(gptq_config_only, tiny, tmp_path, monkeypatch):
    base = ["--model_name_or_path", str(gptq_config_only), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out"), "--use_peft_lora", "True", "--lora_target_modules", TARGETS]
    # This pytest process has no optimum/gptqmodel (they live in .venv/gptq-site): the first thing said.
    text = _problems(base)
    assert "is a GPTQ checkpoint, and loading it needs optimum and gptqmodel (not installed)" in text
    assert "pip install optimum gptqmodel" in text
    from sft_recipe.train import gptq

    monkeypatch.setattr(gptq, "missing_gptq_packages", lambda: [])
    validate(*parse_args(base))  # everything else about the script's configuration is fine
    cases = {
        "--use_4bit_quantization True asks bitsandbytes to quantize it again": ["--use_4bit_quantization", "True"],
        "its packed int4 weights cannot be fine-tuned directly": ["--use_peft_lora", "False"],
        "--lora_target_modules all-linear finds only torch.nn.Linear layers": ["--lora_target_modules", "all-linear"],
        "PEFT has no DoRA for GPTQ layers": ["--use_dora", "True"],
        "--gptq_backend auto lets GPT-QModel pick an inference-only kernel": ["--gptq_backend", "auto"],
    }
    for message, flags in cases.items():
        assert message in _problems(base + flags), flags
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    text = _problems(base)
    assert "FSDP2 with fsdp_cpu_ram_efficient_loading: true" in text and "fsdp_cpu_ram_efficient_loading: false" in text
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # FSDP2 without it trained on CPU (measured)
    validate(*parse_args(base))
