"""Optional integrations that install on a CPU machine, run end to end (docs/integrations.md lists the rest)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import QLORA_FLAGS, REPO, launch_env, launch_train, run_command

# The FSDP runs are shared (tests/shared_runs.py: they report to TensorBoard); the rest are launched here, 2 steps:
# one process as a plain `python train.py` (no launcher), and DeepSpeed.
FLAGS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear",
         "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--max_seq_len", "128",
         "--save_strategy", "no", "--eval_strategy", "no", "--seed", "3", "--report_to", "tensorboard"]
# engine -> (the shared run, or the accelerate config (None: plain python) and flags of a launch here; the engine)
ENGINES = {
    "lora-one-process": ((None, ["--bf16", "False"]), ("NO", None)),
    "qlora-one-process": ((None, QLORA_FLAGS), ("NO", None)),
    "lora-fsdp1": ("lora-fsdp1", ("FSDP", 1)),
    "qlora-fsdp2": ("qlora-fsdp2", ("FSDP", 2)),
    # DeepSpeed on CPU: gloo, fp32, and no ACCELERATE_USE_CPU (tests/test_deepspeed.py says why).
    "lora-deepspeed-zero3": (("cpu/deepspeed_config.yaml", ["--ddp_backend", "gloo", "--bf16", "False",
                                                            "--chat_template_format", "none"]), ("DEEPSPEED", None)),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_report_to_tensorboard_writes_its_event_files_in_output_dir(engine, tiny, shared_run, tmp_path):
    """`--report_to tensorboard` with LoRA/QLoRA on each engine: the run passes the up-front check (tensorboard is
    installed, requirements-dev.txt), trains, and TensorBoard's event file under output_dir/runs/ holds every logged
    loss (one file: under FSDP and DeepSpeed rank 0 alone writes it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, (distributed_type, fsdp_version) = ENGINES[engine]
    if isinstance(run, str):
        result = shared_run(run)
    else:
        config, extra = run
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
    out = result.output_dir
    assert result.returncode == 0, result.output[-4000:]
    how = result.record["distribution"]
    assert (how["distributed_type"], how["fsdp_version"]) == (distributed_type, fsdp_version)
    events = sorted(out.glob("runs/*/events.out.tfevents.*"))
    assert len(events) == 1, sorted(str(p.relative_to(out)) for p in out.rglob("*"))  # one writer, also under FSDP
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    scalars = accumulator.Scalars("train/loss")
    losses = result.record["training"]["losses"]
    assert [event.step for event in scalars] == list(range(1, len(losses) + 1))
    assert [event.value for event in scalars] == pytest.approx(losses, rel=1e-5)
