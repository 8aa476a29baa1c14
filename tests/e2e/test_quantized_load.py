"""A 4-bit base loaded for FSDP where the recipe puts it (the CPU: compat.quantized_base_device_map), through the
real launcher on 2 CPU ranks.

What a CPU can show (where CUDA would put tensors it cannot; tests/unit/test_quantized_placement.py pins that decision):
- every rank holds the same packed bytes and quantization state as a one-process load;
- FSDP1 and FSDP2 QLoRA (the guide's flags: NF4, double quant, bf16 storage) train as they did before the recipe
  chose the placement (transformers' quantizer placing the base), and save a verified adapter with the keys and
  shapes of the one-process run;
- live weight bytes per rank after loading and after wrapping are what the memory plan says.
The model is a 1024x4 Llama (sft_recipe.tiny.build_bench_model): big enough that the plan's fixed terms are small.
"""

from __future__ import annotations

import json
import sys

import pytest
from safetensors import safe_open

from tests.helpers import (
    SMALL_QLORA_FLAGS,
    SMALL_QLORA_TRAIN_FLAGS,
    assert_losses_match,
    launch_env,
    launch_script,
    launch_train,
    run_command,
)

QLORA, TRAIN = SMALL_QLORA_FLAGS, SMALL_QLORA_TRAIN_FLAGS
ENGINES = {"fsdp1": "cpu/fsdp_config.yaml", "fsdp2": "cpu/fsdp2_config.yaml"}
PLAN_TOLERANCE = 0.05  # measured: after load 0.05%, after wrap 0% (FSDP2) and 2.3% (FSDP1: flat-parameter padding)


@pytest.fixture(scope="module")
def bench_model(tiny, tmp_path_factory):
    from sft_recipe.tiny import build_bench_model

    return build_bench_model(tmp_path_factory.mktemp("bench"), tiny.root, hidden_size=1024, num_hidden_layers=4)


def _data(tiny) -> list[str]:
    return ["--dataset_name", str(tiny.jsonl_dir)]


@pytest.fixture(scope="module")
def runs(tiny, bench_model, tmp_path_factory):
    """Each engine trained the recipe's way and with the quantizer's own placement; one process for reference."""
    env = {**launch_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    model = ["--model_name_or_path", str(bench_model), *_data(tiny)]
    out = {}
    for engine, config in ENGINES.items():
        out[engine] = launch_train(config, tmp_path_factory.mktemp(engine), [*model, *TRAIN], env=env)
        before = tmp_path_factory.mktemp(f"{engine}-quantizer")
        out[f"{engine}-quantizer"] = launch_script(config, "bench/train_with_quantizer_placement.py",
                                                   ["--output_dir", str(before), *model, *TRAIN], before, env)
    one = tmp_path_factory.mktemp("one-process")
    out["one-process"] = launch_train("cpu/single.yaml", one, [*model, *TRAIN,
                                                               "--per_device_train_batch_size", "2"], env=env)
    for name, result in out.items():
        assert result.returncode == 0, f"{name}:\n{result.output[-4000:]}"
        assert "adapter check OK" in result.output, name
    return out


def _adapter_shapes(result) -> dict[str, tuple]:
    with safe_open(str(result.output_dir / "adapter_model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fsdp_qlora_trains_as_before_and_saves_the_one_process_adapter_layout(runs, engine):
    ours, before = runs[engine], runs[f"{engine}-quantizer"]
    assert "quantized base loaded on the CPU for FSDP" in ours.output  # the recipe placed it, and said so once
    assert ours.output.count("quantized base loaded on the CPU for FSDP") == 1
    assert "the 4-bit base is identical on all 2 ranks" in ours.output  # train.py's run-time check, said once
    assert "quantized base loaded on the CPU" not in before.output
    assert ours.record["distribution"]["distributed_type"] == "FSDP"
    losses, reference = ours.record["training"]["losses"], before.record["training"]["losses"]
    assert_losses_match(losses, reference, steps=3)
    assert _adapter_shapes(ours) == _adapter_shapes(before) == _adapter_shapes(runs["one-process"])
    assert ours.record["weights"]["frozen_changed"] is False and ours.record["weights"]["trainable_changed"]


def _plan_weight_mib(bench_model) -> tuple[float, float]:
    """(after load, after wrap on 2 ranks) per rank, from the plan's formulas: the whole 4-bit base + LoRA, then
    half the shardable part + the replicated 4-bit constants + half the LoRA weights."""
    from sft_recipe.plan import model_shape, parse_train_flags
    from sft_recipe.plan.components import base_weight_bytes, count_trainable
    from sft_recipe.plan.inputs import workload

    model_args, data_args, _, training_args = parse_train_flags(
        ["--model_name_or_path", str(bench_model), *QLORA], "cpu")
    w = workload(model_args, data_args, training_args, "cpu")
    shape = model_shape(str(bench_model), False, w.extra_vocab)
    shardable, replicated, _ = base_weight_bytes(shape, w)
    trainable, per = count_trainable(shape, w)
    mib = 2 ** 20
    return (shardable + replicated + trainable * per) / mib, (shardable / 2 + replicated + trainable * per / 2) / mib


@pytest.mark.parametrize("engine", list(ENGINES))
def test_live_weight_bytes_per_rank_after_load_and_wrap_are_the_plans(runs, bench_model, engine, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the plan parses --bf16 True as the CPU runs do
    planned_load, planned_wrap = _plan_weight_mib(bench_model)
    memory = runs[engine].record["memory"]
    for loaded, wrapped in zip(memory["weight_mib_after_load_per_rank"], memory["weight_mib_after_wrap_per_rank"]):
        assert loaded == pytest.approx(planned_load, rel=PLAN_TOLERANCE)  # one 4-bit copy on every rank
        assert wrapped == pytest.approx(planned_wrap, rel=PLAN_TOLERANCE)  # its shard, once wrapped
    assert memory["gpu_peak_gib_after_load_per_rank"] is None  # no GPU here: recorded only where there is one


def test_every_rank_loads_the_bytes_of_a_one_process_load(tiny, tmp_path):
    worker = "tests/e2e/quantized_load_worker.py"
    flags = ["--model_name_or_path", str(tiny.model_dir), *_data(tiny), *QLORA, "--out_dir", str(tmp_path)]
    result = launch_script("cpu/fsdp2_config.yaml", worker, flags, tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    env = {**launch_env(), "ACCELERATE_USE_CPU": "true"}
    single = run_command([sys.executable, worker, *flags], tmp_path, env)
    assert single.returncode == 0, single.output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    one = json.loads((tmp_path / "one-process.json").read_text())
    assert ranks[0]["device_map"] == ranks[1]["device_map"] == {"": "cpu"}  # FSDP: the recipe's placement
    # the run-time check compared the same bytes on both ranks; one process has nothing to compare
    assert all("the 4-bit base is identical on all 2 ranks" in r["identity"]["note"] for r in ranks)
    assert one["identity"] == {"note": None}
    assert one["device_map"] is None  # one process: the quantizer's own
    # 14 linears x (packed weight, absmax, code, offset, nested absmax, nested code): double quantization
    assert len(one["fingerprints"]) == 14 * 6
    assert ranks[0]["fingerprints"] == ranks[1]["fingerprints"] == one["fingerprints"]


def test_a_rank_that_quantized_differently_stops_every_rank_before_training(tiny, tmp_path):
    """One absmax value changed on rank 1 (what another bitsandbytes build or CPU would do): both ranks stop with the
    message naming rank 1 and the fix, before any weight is wrapped."""
    worker = "tests/e2e/quantized_load_worker.py"
    flags = ["--model_name_or_path", str(tiny.model_dir), *_data(tiny), *QLORA, "--out_dir", str(tmp_path),
             "--perturb_rank", "1"]
    result = launch_script("cpu/fsdp_config.yaml", worker, flags, tmp_path)
    assert result.returncode != 0
    for rank in (0, 1):
        (problem,) = json.loads((tmp_path / f"rank{rank}.json").read_text())["identity"]["problems"]
        assert "the 4-bit base differs between ranks: rank 1 quantized it" in problem
        assert "the same bitsandbytes, torch and CPU kind on every machine" in problem
