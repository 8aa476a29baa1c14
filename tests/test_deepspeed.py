"""DeepSpeed ZeRO-3, the alternative engine: upstream's two accelerate configs, and real ZeRO-3 runs on CPU.

DeepSpeed 0.19.8 runs here through its CPU accelerator over gloo (no compiled ops, no oneCCL). What that takes,
measured with accelerate 1.15: ACCELERATE_USE_CPU must stay UNSET (with it accelerate drops DeepSpeed and runs DDP
over ZeRO-3-partitioned weights), and --ddp_backend gloo is the CPU switch instead (without it accelerate counts one
process). fp32 only. The end-to-end tests need `pip install deepspeed` and are skipped without it; the config tests
only need accelerate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import RELATIVE_TOLERANCE, REPO, free_port, launch_env, launch_train, run_command
from tests.helpers import TRAIN_FLAGS as SHARED_TRAIN_FLAGS
from tests.shared_runs import SHARED_LAUNCHES, TENSORBOARD

# Upstream's examples/sft configs, key for key (PEFT "DeepSpeed" guide).
UPSTREAM_COMMON = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "DEEPSPEED", "downcast_bf16": "no",
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1,
    "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    "use_cpu": False,
}
ZERO3 = {"deepspeed_multinode_launcher": "standard", "offload_optimizer_device": "none",
         "offload_param_device": "none", "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}
UPSTREAM = {
    "deepspeed_config.yaml": {**UPSTREAM_COMMON, "num_processes": 8,
                              "deepspeed_config": {**ZERO3, "gradient_accumulation_steps": 4}},
    "deepspeed_config_z3_qlora.yaml": {**UPSTREAM_COMMON, "num_processes": 2, "deepspeed_config": ZERO3},
}
CPU_TWIN = "cpu/deepspeed_config.yaml"

# The shared flags (tests/helpers.py); the chat template adds no tokens ("none").
TRAIN_FLAGS = [*SHARED_TRAIN_FLAGS, "--chat_template_format", "none"]
CPU_DEEPSPEED = ["--ddp_backend", "gloo", "--bf16", "False"]


def deepspeed_env() -> dict[str, str]:
    """A launch environment for DeepSpeed on CPU: no ACCELERATE_USE_CPU (see the module docstring)."""
    return launch_env(cpu_switch=False)


@pytest.mark.parametrize("name", UPSTREAM)
def test_gpu_configs_are_exactly_upstreams(name):
    assert yaml.safe_load((REPO / "configs" / name).read_text()) == UPSTREAM[name]


@pytest.mark.parametrize("name,processes,precision", [("deepspeed_config.yaml", 8, "bf16"),
                                                      ("deepspeed_config_z3_qlora.yaml", 2, "bf16"),
                                                      (CPU_TWIN, 2, "no")])
def test_configs_load_in_accelerate_as_zero3(name, processes, precision):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(REPO / "configs" / name))
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert (config.num_processes, config.mixed_precision) == (processes, precision)
    ds = config.deepspeed_config
    assert ds["zero_stage"] == 3
    assert (ds["offload_optimizer_device"], ds["offload_param_device"]) == ("none", "none")
    assert ds["zero3_init_flag"] is True, "upstream's QLoRA + ZeRO-3 recipe needs it"
    assert ds["zero3_save_16bit_model"] is True, "without it the final adapter cannot be gathered"


def test_cpu_twin_differs_only_where_cpu_forces_it():
    twin = yaml.safe_load((REPO / "configs" / CPU_TWIN).read_text())
    gpu = UPSTREAM["deepspeed_config_z3_qlora.yaml"]
    assert twin["deepspeed_config"] == gpu["deepspeed_config"]  # no gradient_accumulation_steps: the flag decides
    differing = {k for k in twin.keys() | gpu.keys() if twin.get(k) != gpu.get(k)}
    assert differing == {"mixed_precision", "use_cpu", "tpu_env", "tpu_use_cluster", "tpu_use_sudo"}


@pytest.mark.parametrize("deepspeed_script,fsdp_script", [("run_peft_deepspeed.sh", "run_peft_fsdp.sh"),
                                                          ("run_peft_qlora_deepspeed.sh", "run_peft_qlora_fsdp.sh")])
def test_deepspeed_scripts_train_what_the_fsdp_scripts_train(deepspeed_script, fsdp_script):
    """Upstream's DeepSpeed scripts pass the FSDP scripts' flags: ours run the FSDP script with another engine and
    output folder, so the two cannot drift apart."""
    text = (REPO / deepspeed_script).read_text()
    assert f'exec bash {fsdp_script} "$@"' in text
    assert "export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/deepspeed_config" in text
    assert "export OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-" in text


# (flags, accelerate's exported environment, what the message must say)
DEEPSPEED_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                 "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}
# --ddp_backend gloo is set on the parsed arguments (_validate_under_deepspeed): parsed in a bare process, it wants a
# process group. "gloo" below stands for it.
MISTAKES = {
    "CPU switch turns DeepSpeed off": (["gloo"], {"ACCELERATE_USE_CPU": "true"},
                                       "ACCELERATE_USE_CPU=true (or --use_cpu True) with a DeepSpeed config"),
    "no gloo without GPUs": ([], {}, "DeepSpeed on a machine without CUDA GPUs needs --ddp_backend gloo"),
    "accumulation differs from the config": (
        ["gloo", "--gradient_accumulation_steps", "2"],
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, "Fix: --gradient_accumulation_steps 4"),
    "ZeRO-3 without 16-bit gather": (["gloo"], {"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false"},
                                     "Fix: zero3_save_16bit_model: true"),
    "QLoRA checkpoints on CPU": (["gloo", "--use_peft_lora", "True", "--use_4bit_quantization", "True",
                                 "--save_strategy", "steps"], {}, "Fix: --save_strategy no for CPU dry runs"),
}


def _good_argv(tiny, tmp_path) -> list[str]:
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out"), "--chat_template_format", "none"]


def _validate_under_deepspeed(argv, env, monkeypatch):
    """Arguments parsed first, then the launcher's DeepSpeed variables set: in a bare process, TrainingArguments
    built under ACCELERATE_USE_DEEPSPEED or with --ddp_backend gloo wants a process group, which only a real launch
    has. So "gloo" in argv is applied to the parsed arguments (what validate reads)."""
    from sft_recipe.config.args import parse_args
    from sft_recipe.preflight.validate import validate

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    parsed = parse_args([a for a in argv if a != "gloo"])
    if "gloo" in argv:
        parsed[3].ddp_backend = "gloo"
    for key, value in {**DEEPSPEED_ENV, **env}.items():
        monkeypatch.setenv(key, value)
    validate(*parsed)


@pytest.mark.parametrize("name", MISTAKES)
def test_deepspeed_mistakes_are_named_before_loading(name, tiny, tmp_path, monkeypatch):
    from sft_recipe.config.args import ConfigError

    flags, env, message = MISTAKES[name]
    with pytest.raises(ConfigError) as error:
        _validate_under_deepspeed([*_good_argv(tiny, tmp_path), *flags], env, monkeypatch)
    assert message in "\n".join(error.value.problems)


def test_bf16_on_cpu_under_deepspeed_names_the_only_fix(tiny, tmp_path, monkeypatch):
    from sft_recipe.config.args import ConfigError, parse_args

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError) as error:
        parse_args([*_good_argv(tiny, tmp_path), "--bf16", "True"])
    problems = "\n".join(error.value.problems)
    assert "DeepSpeed runs on the CPU in fp32 only" in problems and "ACCELERATE_USE_CPU=true" not in problems


def test_a_good_cpu_deepspeed_config_passes(tiny, tmp_path, monkeypatch):
    _validate_under_deepspeed([*_good_argv(tiny, tmp_path), *TRAIN_FLAGS, "--bf16", "False", "gloo"], {}, monkeypatch)


def test_launcher_exports_what_the_check_reads(tiny, tmp_path):
    """Through the real launcher: a config with accumulation 4 and no 16-bit gather, run without gloo -- all three
    problems are reported at once, before any weight is loaded."""
    pytest.importorskip("deepspeed")
    config = yaml.safe_load((REPO / "configs" / CPU_TWIN).read_text())
    config["deepspeed_config"].update(gradient_accumulation_steps=4, zero3_save_16bit_model=False)
    config["num_processes"] = 1
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    result = launch_train(str(config_path), out, ["--model_name_or_path", str(tiny.model_dir), "--dataset_name",
                                                  str(tiny.jsonl_dir), *TRAIN_FLAGS, "--bf16", "False"],
                          env=deepspeed_env())
    assert result.returncode != 0
    for message in ("needs --ddp_backend gloo", "Fix: --gradient_accumulation_steps 4",
                    "Fix: zero3_save_16bit_model: true"):
        assert message in result.output, result.output[-3000:]
    assert not out.exists(), "nothing was loaded or written"


def _logits_base_vs_adapter(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer("What is the opposite of hot?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base_logits = base(ids).logits.clone()
        adapted = PeftModel.from_pretrained(base, adapter_dir)(ids).logits
    return base_logits, adapted


def test_zero3_trains_what_fsdp2_trains_and_the_adapter_loads(tiny, shared_run, tmp_path):
    pytest.importorskip("deepspeed")
    data = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir)]
    zero3 = shared_run("lora-zero3")  # TRAIN_FLAGS + CPU_DEEPSPEED on the tiny jsonl data, reporting to TensorBoard
    assert SHARED_LAUNCHES["lora-zero3"].train_args(tiny) == [*data, "--chat_template_format", "none",
                                                              *SHARED_TRAIN_FLAGS, *CPU_DEEPSPEED, *TENSORBOARD]
    assert zero3.returncode == 0, zero3.output[-5000:]
    facts = zero3.record
    # Really DeepSpeed, on both ranks: not DDP, not one process.
    how = facts["distribution"]
    assert (how["distributed_type"], how["wrapped_class"], how["num_processes"]) == \
        ("DEEPSPEED", "DeepSpeedEngine", 2)
    assert "deepspeed" not in facts["run"]["skipped_imports"]  # a DeepSpeed launch keeps what it runs on
    assert "mlflow" in facts["run"]["skipped_imports"]  # ...not what its autotuner would import (compat.unused_imports)
    # ...but not the shared-memory op of DeepSpeed inference: no rank built or loaded it (compat/deepspeed_cpu.py)
    assert "deepspeed_shm_comm" not in zero3.output
    assert facts["weights"]["frozen_changed"] is False and facts["weights"]["trainable_changed"] is True
    assert "adapter check OK" in zero3.output
    # One process prepared the data, the other read its copy.
    assert facts["data"]["prepared_on_ranks"] == [0] and facts["data"]["read_copy_on_ranks"] == [1]

    fsdp2 = launch_train("cpu/fsdp2_config.yaml", tmp_path / "fsdp2", [*data, *TRAIN_FLAGS])
    assert fsdp2.returncode == 0, fsdp2.output[-5000:]
    losses, reference = facts["training"]["losses"], fsdp2.record["training"]["losses"]
    assert len(losses) == len(reference) == 8
    for step, (a, b) in enumerate(zip(losses, reference), start=1):
        assert abs(a - b) <= RELATIVE_TOLERANCE * abs(b), f"step {step}: {a} vs {b}"
    adapter = load_file(str(zero3.output_dir / "adapter_model.safetensors"))
    reference_adapter = load_file(str(fsdp2.output_dir / "adapter_model.safetensors"))
    assert adapter.keys() == reference_adapter.keys() and adapter
    for key, tensor in adapter.items():
        torch.testing.assert_close(tensor, reference_adapter[key], rtol=RELATIVE_TOLERANCE, atol=1e-6, msg=key)

    base_logits, adapted = _logits_base_vs_adapter(tiny.model_dir, zero3.output_dir)
    assert not torch.allclose(base_logits, adapted), "the adapter changes the model's output"


def test_run_peft_qlora_deepspeed_sh_at_tiny_scale(tiny, tmp_path):
    """The QLoRA + ZeRO-3 script as written, with only what this machine forces overridden."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "qlora-zero3"
    env = deepspeed_env()
    env.update(MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(out),
               ACCELERATE_CONFIG=f"configs/{CPU_TWIN}", NUM_PROCESSES="2")
    result = run_command(["bash", "run_peft_qlora_deepspeed.sh", *CPU_DEEPSPEED, "--bnb_4bit_compute_dtype", "float32",
                          "--bnb_4bit_quant_storage_dtype", "float32", "--use_flash_attn", "False",
                          "--push_to_hub", "False", "--chat_template_format", "none", "--max_steps", "3",
                          # bitsandbytes' CPU format cannot save ZeRO-3-partitioned 4-bit weights: no checkpoints.
                          "--save_strategy", "no",
                          "--max_seq_len", "128", "--logging_steps", "1"], out, env=env)
    assert result.returncode == 0, result.output[-5000:]
    facts = json.loads((out / "run_record.json").read_text())
    assert (facts["distribution"]["distributed_type"], facts["distribution"]["num_processes"]) == ("DEEPSPEED", 2)
    assert facts["weights"]["frozen_changed"] is False and facts["weights"]["trainable_changed"] is True
    assert "adapter check OK" in result.output and facts["training"]["eval_losses"]  # --eval_strategy epoch ran


ZERO_INIT_DTYPES = """
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
from sft_recipe.compat.deepspeed_cpu import skip_cpu_inference_op_build
skip_cpu_inference_op_build()  # as train.py: no C++ build of DeepSpeed's CPU inference op (21 s on a fresh machine)
deepspeed.init_distributed(dist_backend="gloo")
for name, mixed in {"bf16": {"bf16": {"enabled": True}}, "fp32": {}}.items():
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **mixed}
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(8, 8, dtype=torch.float32)
    print(name, layer.weight.dtype)
"""


def test_zero_init_gives_every_weight_the_configs_dtype_whatever_it_was_created_in():
    """What the memory plan's DeepSpeed rows rest on (sft_recipe/plan/planner.py): a weight created in fp32 under
    zero.Init with bf16 enabled is bf16, so --torch_dtype float32 does not double the base under ZeRO-3 + bf16."""
    pytest.importorskip("deepspeed")
    env = {**launch_env(cpu_switch=False), "PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", ZERO_INIT_DTYPES], env=env, capture_output=True, text=True,
                         timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bf16 torch.bfloat16" in out.stdout and "fp32 torch.float32" in out.stdout, out.stdout


def test_deepspeed_scripts_check_before_accelerate_launch(tmp_path):
    """bash run_peft_deepspeed.sh without DeepSpeed: exit 2 with the recipe's message, accelerate never started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text("#!/usr/bin/env bash\ntouch \"$FAKE_LAUNCHED\"\n")
    (bin_dir / "python").write_text(  # the real interpreter, with accelerate's helper answering "not installed"
        f"#!/usr/bin/env bash\nexec {sys.executable} -c 'import sys, accelerate.commands.launch as l; "
        "l.is_deepspeed_available = lambda: False; from sft_recipe.config.optional_deps import main; "
        "sys.exit(main(sys.argv[3:]))' \"$@\"\n")
    for tool in ("accelerate", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "FAKE_LAUNCHED": str(tmp_path / "launched"), "OUTPUT_DIR": str(tmp_path / "o")}
    proc = subprocess.run(["bash", "run_peft_deepspeed.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--config_file configs/deepspeed_config.yaml (distributed_type: DEEPSPEED): needs deepspeed" in proc.stderr
    assert not (tmp_path / "launched").exists()
