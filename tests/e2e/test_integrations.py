"""Optional integrations that install on a CPU machine, run end to end (docs/integrations.md lists the rest)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, launch_env, launch_train, run_command

# QLoRA on one process, the FSDP runs and ZeRO-3 are shared (tests/shared_runs.py: they report to TensorBoard); LoRA on
# one process is the tracked run below (a plain `python train.py`, no launcher, reporting to TensorBoard, W&B and
# MLflow at once).
FLAGS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear",
         "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--max_seq_len", "128",
         "--save_strategy", "no", "--eval_strategy", "no", "--seed", "3", "--report_to", "tensorboard"]
# engine -> (the shared run, or "tracked": the one-process tracked run below; what the run record must say ran)
ENGINES = {
    "lora-one-process": ("tracked", ("NO", None)),
    "qlora-one-process": ("qlora-single", ("NO", None)),
    "lora-fsdp1": ("lora-fsdp1", ("FSDP", 1)),
    "qlora-fsdp2": ("qlora-fsdp2", ("FSDP", 2)),
    "lora-deepspeed-zero3": ("lora-zero3", ("DEEPSPEED", None)),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_report_to_tensorboard_writes_its_event_files_in_output_dir(engine, tiny, shared_run, tracked, tmp_path):
    """`--report_to tensorboard` with LoRA/QLoRA on each engine: the run passes the up-front check (tensorboard is
    installed, requirements-dev.txt), trains, and TensorBoard's event file under output_dir/runs/ holds every logged
    loss (one file: under FSDP and DeepSpeed rank 0 alone writes it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, (distributed_type, fsdp_version) = ENGINES[engine]
    if "deepspeed" in engine:
        pytest.importorskip("deepspeed")
    result = tracked("one-process") if run == "tracked" else shared_run(run)
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


def _tracker_args(tiny) -> list[str]:
    """The tracked runs' flags: FLAGS without its --report_to (the recipe YAML names the trackers), 3 steps at 3e-3."""
    assert FLAGS[-2:] == ["--report_to", "tensorboard"]
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *FLAGS[:-2],
            "--max_steps", "3", "--learning_rate", "3e-3"]


@pytest.fixture(scope="module")
def tracked(tiny, tmp_path_factory):
    """engine -> the one run of that engine ("one-process": `python train.py`, no launcher; "fsdp2") that reports to
    W&B in its offline mode (no account, no network) and to MLflow on a local file store (MLFLOW_ALLOW_FILE_STORE=true:
    MLflow 3's opt-in) at once, the one-process run to TensorBoard too: a recipe YAML's `report_to` list. Launched on
    first use; each test reads what its tracker wrote (`run.output_dir.parent`: wandb-runs/, mlruns/)."""
    runs = {}

    def run(engine: str):
        if engine not in runs:
            root = tmp_path_factory.mktemp(f"tracked-{engine}")
            trackers = (["tensorboard"] if engine == "one-process" else []) + ["wandb", "mlflow"]
            recipe = root / "trackers.yaml"
            recipe.write_text(f"report_to: [{', '.join(trackers)}]\n")
            env = {**launch_env(cpu_switch=engine != "one-process"), "WANDB_MODE": "offline",
                   "WANDB_DIR": str(root / "wandb-runs"), "WANDB_SILENT": "true",
                   "MLFLOW_TRACKING_URI": f"file://{root / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true",
                   "MLFLOW_EXPERIMENT_NAME": "sft"}
            env.pop("TENSORBOARD_LOGGING_DIR", None)
            args, out = [*_tracker_args(tiny), "--config", str(recipe)], root / "out"
            if engine == "one-process":
                result = run_command([sys.executable, str(REPO / "train.py"), *args, "--output_dir", str(out),
                                      "--bf16", "False"], out, env=env)
            else:
                result = launch_train("cpu/fsdp2_config.yaml", out, args, env=env)
            assert result.returncode == 0, result.output[-4000:]
            runs[engine] = result
        return runs[engine]

    return run


def _planned(engine: str, tiny, budget_gib: float, capsys) -> dict:
    """What `python -m sft_recipe.plan --device cpu --json` prints for the run's flags and engine, on the budget the
    tracker shows (the machine's RAM, which the test does not know)."""
    from sft_recipe.plan.cli import main as plan_cli

    engine_flags = [] if engine == "one-process" else ["--config_file", str(REPO / "configs/cpu/fsdp2_config.yaml")]
    capsys.readouterr()
    assert plan_cli(["--device", "cpu", "--json", "--gpu_memory_gib", str(budget_gib), *engine_flags,
                     *_tracker_args(tiny), "--bf16", "False"]) == 0
    return json.loads(capsys.readouterr().out)


def _wandb_records(run_file) -> list:
    """The records of an offline W&B run (`run-<id>.wandb`), decoded with W&B's own protobuf classes. The file is
    LevelDB's log format (32 KiB blocks, each record a 7-byte header -- checksum, length, type -- and its bytes, a
    record cut across blocks as first/middle/last pieces) after W&B's 7-byte header; wandb 0.31 ships no Python reader
    of it (its sync tool is Go)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, header = 32768, 7
    offset, pieces, records = 7, b"", []
    while offset + header <= len(data):
        if block - offset % block < header:  # too little room left in the block for a header: zero padding
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(data[offset + 4:offset + 6], "little"), data[offset + 6]
        piece = data[offset + header:offset + header + length]
        offset += header + length
        if kind in (1, 2):  # full, first
            pieces = piece
        elif kind in (3, 4):  # middle, last
            pieces += piece
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pieces))
    return records


@pytest.mark.parametrize("engine", ["one-process", "fsdp2"])
def test_report_to_wandb_offline_holds_the_runs_losses_and_config(engine, tiny, tracked, capsys):
    """`--report_to wandb` with W&B's offline mode (no account, no network), on one process and under FSDP2: one
    offline run (rank 0 alone reports), whose history holds every logged loss of the run record, the measured peak
    memory per step, and whose config holds the run's flags (learning rate, LoRA rank, the base model) and the memory
    plan the planner gives for them on this engine."""
    pytest.importorskip("wandb")  # requirements-dev.txt installs it
    result = tracked(engine)
    wandb_dir = result.output_dir.parent / "wandb-runs"
    run_files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, sorted(str(p) for p in wandb_dir.rglob("*"))  # one run, also under FSDP
    records = _wandb_records(run_files[0])
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [row["train/loss"] for row in history if "train/loss" in row]
    assert losses == pytest.approx(result.record["training"]["losses"], rel=1e-6) and len(losses) == 3
    assert all(row["train/peak_memory_gib"] > 0 for row in history if "train/loss" in row)
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    assert config["learning_rate"] == 3e-3 and config["_name_or_path"] == str(tiny.model_dir)
    assert json.dumps(config["peft_config"]).count('"r": 4') == 1
    plan = config["memory_plan"]
    assert plan == _planned(engine, tiny, plan["budget_gib"], capsys)
    assert plan["device"] == "cpu" and len(plan["per_rank_gib"]) == (1 if engine == "one-process" else 2), plan


@pytest.mark.parametrize("engine", ["one-process", "fsdp2"])
def test_report_to_mlflow_on_a_local_store_holds_the_runs_losses_and_flags(engine, tiny, tracked, tmp_path, capsys):
    """`--report_to mlflow` on a local file store (MLFLOW_ALLOW_FILE_STORE=true: MLflow 3's opt-in), on one process
    and under FSDP2: one finished run (rank 0 alone reports) whose metric history holds every logged loss of the run
    record and the measured peak memory, whose parameters hold the run's flags and the memory plan's headline, and
    whose artifacts hold the whole plan the planner gives for the flags on this engine."""
    pytest.importorskip("mlflow")  # requirements-dev.txt installs mlflow-skinny
    from mlflow import MlflowClient

    result = tracked(engine)
    store = f"file://{result.output_dir.parent / 'mlruns'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(store)
        (run,) = client.search_runs([client.get_experiment_by_name("sft").experiment_id])  # one, also under FSDP
        losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
        plan = json.loads(Path(client.download_artifacts(run.info.run_id, "memory_plan.json", str(tmp_path)))
                          .read_text())
    assert run.info.status == "FINISHED"
    assert losses == pytest.approx(result.record["training"]["losses"], rel=1e-6) and len(losses) == 3
    assert run.data.metrics["peak_memory_gib"] > 0
    assert float(run.data.params["learning_rate"]) == 3e-3 and run.data.params["_name_or_path"] == str(tiny.model_dir)
    assert plan == _planned(engine, tiny, plan["budget_gib"], capsys)
    assert float(run.data.params["memory_plan/peak_gib"]) == plan["peak_gib"] > 0
    assert run.data.params["memory_plan/setup"] == plan["setup"]
