"""Upstream's other launch paths, run as shipped at tiny scale: run_peft.sh (one process, QLoRA without a quant
storage dtype), run_peft_multigpu.sh (DDP through the real torchrun, no accelerate launcher), run_unsloth_peft.sh
(refused before any weight loads), and --max_seq_len in --help.

Only what this machine forces is overridden, through the scripts' knobs (MODEL/DATASET/OUTPUT_DIR, NPROC_PER_NODE,
LAUNCH_ARGS, extra flags appended): a local model and dataset, --use_flash_attn False and --bf16 False (no CUDA; bf16 on
this CPU is ~20x slower), fp32 4-bit compute, no upload, a few steps. For the DDP parity check both runs also use
--lora_dropout 0 (dropout masks differ per rank), one accumulation step, and the same global batch (8 = 1 x 8 = 2 x 4).

Parity tolerance is looser than tests/e2e/test_parity.py's 1e-5 (fp32 LoRA): with a quantized base TRL 1.16 casts the
LoRA weights to bf16 whatever --bf16 says, so a last-bit difference in the summed gradient rounds to a different bf16
value, and Adam's first steps (update ~ lr * sign(g)) move near-zero-gradient elements by +-lr. Measured here at lr
3e-3: losses within 3.3e-5 (step 2) and 9.2e-5 (step 3) relative, lora_B (all learned: it starts at zero) within
1.2% relative norm, lora_A 0.15%. The adapter is the sharp check: the same DDP run with dropout left on (0.1)
moves the losses by only 3-4e-4 but lora_B by 24%.
Plain LoRA through the same script and torchrun stays within 2e-7 (fp32).
"""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file

from sft_recipe.config.args import build_parser, parse_args
from tests.helpers import REPO, launch_env, run_command, script_train_flags

LOSS_RELATIVE_TOLERANCE = 2e-4  # bf16 LoRA weights (see above): 2x the measured 9.2e-5
LORA_B_RELATIVE_NORM = 5e-2
LORA_A_RELATIVE_NORM = 1e-2
TINY = ["--use_flash_attn", "False", "--bf16", "False", "--bnb_4bit_compute_dtype", "float32", "--push_to_hub", "False",
        "--max_steps", "3", "--max_seq_len", "128", "--logging_steps", "1", "--per_device_eval_batch_size", "4",
        "--lora_dropout", "0", "--gradient_accumulation_steps", "1", "--learning_rate", "3e-3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tiny, output_dir, **extra):
    env = launch_env()
    env.update(MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(output_dir), **extra)
    return env


@pytest.fixture(scope="module")
def single_and_ddp(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch-paths")
    single = run_command(["bash", "run_peft.sh", *TINY, "--per_device_train_batch_size", "8"], root / "single",
                         env=_env(tiny, root / "single"))
    assert single.returncode == 0, single.output[-5000:]
    # No evaluation here: on CPU, bitsandbytes repacks 4-bit weights for its eval kernel (same values, other bytes) and
    # only rank 0's save packs them back, so the frozen-weight checksum would report a change that is not training.
    ddp = run_command(["bash", "run_peft_multigpu.sh", *TINY, "--per_device_train_batch_size", "4",
                       "--eval_strategy", "no"], root / "ddp",
                      env=_env(tiny, root / "ddp", NPROC_PER_NODE="2", LAUNCH_ARGS=f"--master_port {free_port()}"))
    assert ddp.returncode == 0, ddp.output[-5000:]
    return single, ddp


def test_run_peft_sh_trains_qlora_in_one_process_without_a_storage_dtype(single_and_ddp):
    single, _ = single_and_ddp
    facts = single.record
    how = facts["distribution"]
    assert (how["distributed_type"], how["num_processes"], facts["run"]["quantization"]) == ("NO", 1, "4bit")
    assert facts["weights"]["frozen_changed"] is False and facts["weights"]["trainable_changed"] is True
    assert "adapter check OK" in single.output and facts["training"]["eval_losses"]  # the script's eval ran
    # upstream's single-GPU default: 4-bit weights stay packed in uint8 and the rest loads in fp32
    summary = (single.output_dir / "run_record.json").read_text()
    assert '"bnb_4bit_quant_storage_dtype": "uint8"' in summary and '"use_nested_quant": true' in summary
    assert '"use_reentrant": true' in summary


def test_run_peft_multigpu_sh_is_ddp_over_2_torchrun_processes_matching_one_process(single_and_ddp):
    single, ddp = single_and_ddp
    facts = ddp.record
    how = facts["distribution"]
    assert (how["distributed_type"], how["num_processes"], how["wrapped_class"]) == \
        ("MULTI_CPU", 2, "DistributedDataParallel")
    assert len(facts["memory"]["peak_rss_mib_per_rank"]) == 2, "both ranks reported in"
    assert facts["run"]["quantization"] == "4bit" and facts["weights"]["frozen_changed"] is False
    assert "adapter check OK" in ddp.output
    assert '"use_reentrant": false' in (ddp.output_dir / "run_record.json").read_text()
    reference = single.record["training"]["losses"]
    assert len(facts["training"]["losses"]) == len(reference) == 3
    for step, (a, b) in enumerate(zip(facts["training"]["losses"], reference), start=1):
        assert abs(a - b) <= LOSS_RELATIVE_TOLERANCE * abs(b), f"step {step}: DDP {a} vs one process {b}"
    adapter = load_file(str(ddp.output_dir / "adapter_model.safetensors"))
    reference_adapter = load_file(str(single.output_dir / "adapter_model.safetensors"))
    assert adapter.keys() == reference_adapter.keys()
    for part, tolerance in (("lora_B", LORA_B_RELATIVE_NORM), ("lora_A", LORA_A_RELATIVE_NORM)):
        keys = sorted(k for k in adapter if f"{part}." in k)
        ours = torch.cat([adapter[k].float().flatten() for k in keys])
        theirs = torch.cat([reference_adapter[k].float().flatten() for k in keys])
        assert float((ours - theirs).norm() / theirs.norm()) <= tolerance, part
    for key in (k for k in adapter if "lora_" not in k):  # embedding rows for the chatml tokens: untouched, fp32
        torch.testing.assert_close(adapter[key], reference_adapter[key], msg=key)


def test_run_unsloth_peft_sh_is_refused_before_any_weight_loads(tiny, tmp_path):
    out = tmp_path / "unsloth"
    result = run_command(["bash", "run_unsloth_peft.sh", "--use_flash_attn", "False", "--bf16", "False",
                          "--push_to_hub", "False"], out, env=_env(tiny, out), timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "--use_unsloth True: the unsloth package is not installed; there is no CUDA GPU" in result.output
    assert "Fix: drop --use_unsloth" in result.output and "bash run_peft.sh" in result.output
    assert "Traceback" not in result.output and "Loading weights" not in result.output
    assert not out.exists()


def _script_flags(script: str, tmp_path) -> list[str]:
    """The train.py flags a script passes with its default MODEL/DATASET/OUTPUT_DIR (recorded by a fake launcher)."""
    return script_train_flags(script, tmp_path)[1]


# What each upstream script sets that differs between them; everything else is the guide's common flags.
UPSTREAM = {
    "run_peft.sh": dict(model_name_or_path="mistralai/Mistral-7B-v0.1", use_4bit_quantization=True,
                        use_nested_quant=True, bnb_4bit_quant_storage_dtype="uint8", use_reentrant=True,
                        gradient_accumulation_steps=8, lora_target_modules="all-linear", push_to_hub=True),
    "run_peft_multigpu.sh": dict(model_name_or_path="mistralai/Mistral-7B-v0.1", use_4bit_quantization=True,
                                 use_nested_quant=True, bnb_4bit_quant_storage_dtype="uint8", use_reentrant=False,
                                 gradient_accumulation_steps=8, lora_target_modules="all-linear"),
    "run_peft_fsdp_gptq.sh": dict(model_name_or_path="hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4",
                                  use_4bit_quantization=False, use_reentrant=False, gradient_accumulation_steps=4,
                                  lora_target_modules="q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj",
                                  push_to_hub=False),
    "run_unsloth_peft.sh": dict(use_unsloth=True, use_4bit_quantization=True, use_reentrant=True,
                                lora_target_modules="q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"),
}


@pytest.mark.parametrize("script", sorted(UPSTREAM))
def test_script_passes_upstreams_flags_and_its_header_gives_the_command(script, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # they ask for bf16
    model_args, data_args, _, training_args = parse_args(_script_flags(script, tmp_path))
    for name, value in UPSTREAM[script].items():
        got = getattr(model_args, name, getattr(training_args, name, None))
        assert got == value, f"{script}: --{name} is {got!r}, upstream passes {value!r}"
    assert (training_args.max_length, training_args.learning_rate, model_args.lora_r, model_args.lora_alpha) == \
        (2048, 1e-4, 8, 16)
    assert model_args.use_flash_attn and model_args.use_peft_lora and training_args.bf16
    assert data_args.dataset_name == "smangrul/ultrachat-10k-chatml"
    head = (REPO / script).read_text().splitlines()
    assert head[0] == "#!/usr/bin/env bash" and head[1].startswith("# ")
    assert any(f"bash {script}" in line for line in head[:6]), "the header gives the command"


def test_multigpu_script_launches_torchrun_not_accelerate(tmp_path):
    launcher, _ = script_train_flags("run_peft_multigpu.sh", tmp_path)
    assert launcher == ["--nproc_per_node", "8", "--nnodes", "1"], launcher  # recorded by the fake torchrun
    assert (tmp_path / "fake-launch.jsonl").read_text().count("\n") == 1  # one launcher call: not accelerate
    launcher, _ = script_train_flags("run_peft_multigpu.sh", tmp_path, NPROC_PER_NODE="2")
    assert launcher[:2] == ["--nproc_per_node", "2"]


def test_ddp_with_reentrant_checkpointing_is_refused_up_front(monkeypatch, tmp_path):
    from sft_recipe.config.launch_checks import ddp_problems
    from sft_recipe.config.launch_env import LaunchEnv

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    model_args, _, _, training_args = parse_args(_script_flags("run_peft_multigpu.sh", tmp_path) +
                                              ["--use_reentrant", "True"])
    (problem,) = ddp_problems(model_args, training_args, LaunchEnv(world_size=2))
    assert "--use_reentrant True" in problem and "Fix: --use_reentrant False" in problem
    assert ddp_problems(model_args, training_args, LaunchEnv(world_size=2, use_fsdp=True)) == []  # FSDP handles it
    assert ddp_problems(model_args, training_args, LaunchEnv(world_size=1)) == []  # run_peft.sh: one process


def test_unsloth_reason_names_what_is_missing(monkeypatch):
    import importlib.util

    from sft_recipe.config import launch_checks

    model_args = parse_args(["--use_unsloth", "True"])[0]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(launch_checks.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "unsloth" else real_find_spec(name, *a))
    (problem,) = launch_checks.unsloth_problems(model_args)  # installed, but this machine has no GPU
    assert "--use_unsloth True: there is no CUDA GPU" in problem and "bash run_peft.sh" in problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # installed, on a GPU: still not implemented here
    (problem,) = launch_checks.unsloth_problems(model_args)
    assert "--use_unsloth True: this recipe does not implement the Unsloth model path" in problem


def test_help_lists_the_guides_max_seq_len():
    help_text = build_parser().format_help()
    entry = " ".join(help_text[help_text.index("  --max_length MAX_LENGTH,"):][:700].split())  # not the usage line
    assert "--max_seq_len" in entry and "upstream guide's name for this flag" in entry
