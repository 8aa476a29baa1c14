"""Optional integrations that install on a CPU machine, run end to end (docs/integrations.md lists the rest)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import QLORA_FLAGS, REPO, launch_env, launch_train, run_command

FLAGS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear",
         "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--max_seq_len", "128",
         "--save_strategy", "no", "--eval_strategy", "no", "--seed", "3", "--report_to", "tensorboard"]
# name -> (accelerate config, or None for a plain `python train.py`; extra flags; the record's engine)
ENGINES = {
    "lora-one-process": (None, ["--bf16", "False"], ("NO", None)),
    "qlora-one-process": (None, QLORA_FLAGS, ("NO", None)),
    "lora-fsdp1": ("cpu/fsdp_config.yaml", ["--bf16", "False"], ("FSDP", 1)),
    "qlora-fsdp2": ("cpu/fsdp2_config.yaml", QLORA_FLAGS, ("FSDP", 2)),
    # DeepSpeed on CPU: gloo, fp32, and no ACCELERATE_USE_CPU (tests/test_deepspeed.py says why).
    "lora-deepspeed-zero3": ("cpu/deepspeed_config.yaml", ["--ddp_backend", "gloo", "--bf16", "False",
                                                          "--chat_template_format", "none"], ("DEEPSPEED", None)),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_report_to_tensorboard_writes_its_event_files_in_output_dir(engine, tiny, tmp_path):
    """`--report_to tensorboard` with LoRA/QLoRA on each engine: the run passes the up-front check (tensorboard is
    installed, requirements-dev.txt), trains, and TensorBoard's event file under output_dir/runs/ holds every logged
    loss (one file: under FSDP and DeepSpeed rank 0 alone writes it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, extra, (distributed_type, fsdp_version) = ENGINES[engine]
    if "deepspeed" in engine:
        pytest.importorskip("deepspeed")
    out = tmp_path / engine
    env = {k: v for k, v in launch_env(cpu_switch="deepspeed" not in engine).items()
           if k != "TENSORBOARD_LOGGING_DIR"}
    data = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir)]
    if config is None:
        result = run_command([sys.executable, str(REPO / "train.py"), *data, "--output_dir", str(out), *FLAGS,
                              *extra], out, env=env)
    else:
        result = launch_train(config, out, [*data, *FLAGS, *extra], env=env)
    assert result.returncode == 0, result.output[-4000:]
    how = result.record["distribution"]
    assert (how["distributed_type"], how["fsdp_version"]) == (distributed_type, fsdp_version)
    events = sorted(out.glob("runs/*/events.out.tfevents.*"))
    assert len(events) == 1, sorted(str(p.relative_to(out)) for p in out.rglob("*"))  # one writer, also under FSDP
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    scalars = accumulator.Scalars("train/loss")
    assert [event.step for event in scalars] == [1, 2]
    assert [event.value for event in scalars] == pytest.approx(result.record["training"]["losses"], rel=1e-5)
