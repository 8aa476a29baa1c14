"""FSDP1 QLoRA with `fsdp_cpu_ram_efficient_loading: true` (the guide's configs/fsdp_config_qlora.yaml) loads the
4-bit base once: rank 0 reads and quantizes it, the other ranks build the same layers without weights and receive
rank 0's quantization state; FSDP1's module sync fills their packed weights as it wraps
(sft_recipe/train/quantized_from_rank0.py). Through the real launcher on CPU ranks: torch syncs module states only
from GPU tensors, so these runs go through bench/train_syncing_module_states_on_cpu.py, train.py with the
test-only compat relaxation; everything else is the run a GPU machine makes.

Shown here, against every rank loading its own copy (configs/cpu/fsdp_config.yaml, train.py as users run it):
- the same losses and the same saved adapter (keys, shapes, values), on the Llama demo, a tied model and an MoE;
- live weight bytes per rank after loading: rank 0 one 4-bit copy, every other rank only the quantization state
  (the plan's numbers), on 4 ranks; after wrapping, the same shards as before;
- on two machines (over loopback), the second machine's rank reads nothing either, though it is its machine's local
  rank 0: FSDP1 broadcasts from global rank 0.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.helpers import (
    SMALL_QLORA_FLAGS,
    SMALL_QLORA_TRAIN_FLAGS,
    assert_losses_match,
    launch_env,
    launch_script,
    launch_train,
    launch_two_machines,
)

WORKER = "bench/train_syncing_module_states_on_cpu.py"
QLORA, TRAIN = SMALL_QLORA_FLAGS, SMALL_QLORA_TRAIN_FLAGS
FAMILIES = ["llama", "qwen2", "qwen3-moe"]  # the demo, tied embeddings, fused MoE experts
PLAN_TOLERANCE = 0.05  # as tests/e2e/test_quantized_load.py: FSDP1's flat-parameter padding after wrapping


# configs/cpu/fsdp_config.yaml with the guide's loading settings, as launcher flags override the YAML's
ONCE = ("--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "true")


def _once(output_dir, model_flags: list[str], processes: int = 2, extra: tuple[str, ...] = ()):
    return launch_script("cpu/fsdp_config.yaml", WORKER, ["--output_dir", str(output_dir), *model_flags, *TRAIN,
                                                          *extra], output_dir,
                         {**launch_env(), "MALLOC_MMAP_THRESHOLD_": "65536"},
                         launcher_args=(*ONCE, "--num_processes", str(processes)))


@pytest.fixture(scope="module")
def runs(tiny, family_model, tmp_path_factory):
    """family -> (loaded once, loaded by every rank), both trained the same way on 2 CPU ranks."""
    out = {}
    for family in FAMILIES:
        path = tiny.model_dir if family == "llama" else family_model(family)
        model = ["--model_name_or_path", str(path), "--dataset_name", str(tiny.jsonl_dir)]
        once = _once(tmp_path_factory.mktemp(f"{family}-once"), model)
        every = launch_train("cpu/fsdp_config.yaml", tmp_path_factory.mktemp(f"{family}-every"), [*model, *TRAIN])
        for name, result in (("once", once), ("every rank", every)):
            assert result.returncode == 0, f"{family} {name}:\n{result.output[-4000:]}"
            assert "adapter check OK" in result.output, f"{family} {name}"
        out[family] = once, every
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_once_trains_and_saves_what_every_rank_loading_did(runs, family):
    once, every = runs[family]
    assert once.output.count("4-bit base loaded once, on rank 0") == 1  # said once, by rank 0
    assert "the other 1 rank, which hold no packed weights until FSDP1 broadcasts them" in once.output
    assert "packed weights on 1 of them, the others' filled from rank 0 at wrapping" in once.output  # identity
    assert "Each of the 2 ranks on this machine holds its own copy" in every.output
    losses, reference = once.record["training"]["losses"], every.record["training"]["losses"]
    assert_losses_match(losses, reference, steps=3)
    ours = load_file(str(once.output_dir / "adapter_model.safetensors"))
    theirs = load_file(str(every.output_dir / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        assert ours[key].shape == theirs[key].shape, key
        assert (ours[key].float() - theirs[key].float()).abs().max() <= 1e-4 * theirs[key].float().abs().max(), key
    assert once.record["weights"]["frozen_changed"] is False and once.record["weights"]["trainable_changed"]


def _planned_mib(bench_model, ranks: int) -> dict[str, float]:
    """Per rank, from the plan's formulas: rank 0 after load (the whole 4-bit base + LoRA), another rank after load
    (the replicated quantization state: its LoRA is still on meta), and every rank after wrap."""
    from sft_recipe.plan import model_shape, parse_train_flags
    from sft_recipe.plan.components import base_weight_bytes, count_trainable
    from sft_recipe.plan.inputs import workload

    model_args, data_args, _, training_args = parse_train_flags(
        ["--model_name_or_path", str(bench_model), *QLORA], "cpu")
    w = workload(model_args, data_args, training_args, "cpu")
    shardable, replicated, _ = base_weight_bytes(model_shape(str(bench_model), False, w.extra_vocab), w)
    trainable, per = count_trainable(model_shape(str(bench_model), False, w.extra_vocab), w)
    mib = 2 ** 20
    return {"rank0": (shardable + replicated + trainable * per) / mib, "other": replicated / mib,
            "wrapped": (shardable / ranks + replicated + trainable * per / ranks) / mib}


def test_on_4_ranks_rank_0_holds_the_one_copy_and_the_others_only_its_quantization_state(
        tiny, tmp_path, monkeypatch):
    from sft_recipe.tiny import build_bench_model

    bench_model = build_bench_model(tmp_path / "bench", tiny.root, hidden_size=1024, num_hidden_layers=4)
    model = ["--model_name_or_path", str(bench_model), "--dataset_name", str(tiny.jsonl_dir)]
    result = _once(tmp_path / "out", model, processes=4, extra=("--max_steps", "1"))
    assert result.returncode == 0, result.output[-4000:]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the plan parses --bf16 True as the CPU runs do
    planned = _planned_mib(bench_model, 4)
    memory = result.record["memory"]
    loaded, wrapped = memory["weight_mib_after_load_per_rank"], memory["weight_mib_after_wrap_per_rank"]
    assert len(loaded) == 4
    assert loaded[0] == pytest.approx(planned["rank0"], rel=PLAN_TOLERANCE)
    for other in loaded[1:]:
        assert other == pytest.approx(planned["other"], rel=PLAN_TOLERANCE)
        assert other < loaded[0] / 20  # the quantization state is ~1/36 of the 4-bit base
    for shard in wrapped:
        assert shard == pytest.approx(planned["wrapped"], rel=PLAN_TOLERANCE)


def test_on_two_machines_only_global_rank_0_reads_the_base(runs, tiny, tmp_path):
    """Two "machines" of one rank each, over loopback (configs/cpu/multi_node_fsdp_config.yaml): machine 1's rank
    holds only rank 0's quantization state after loading, and the run trains what one machine's two ranks did."""
    out = tmp_path / "two-machines"
    model = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir)]
    logs = launch_two_machines("cpu/multi_node_fsdp_config.yaml", WORKER, ["--output_dir", str(out), *model, *TRAIN],
                               tmp_path, {"MALLOC_MMAP_THRESHOLD_": "65536"}, launcher_args=ONCE)
    assert "4-bit base loaded once, on rank 0" in logs[0] and "quantized base loaded" not in logs[1]
    record = json.loads((out / "run_record.json").read_text())
    loaded = record["memory"]["weight_mib_after_load_per_rank"]
    assert loaded[1] < loaded[0] / 10  # its quantization state (and real buffers), no packed weights
    assert_losses_match(record["training"]["losses"], runs["llama"][1].record["training"]["losses"], steps=3)
