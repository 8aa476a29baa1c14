"""The plan's load and wrap phases: where a quantized base is while it loads, on the recipe's path and upstream's.

transformers 5.x puts a bitsandbytes base whole onto every rank's GPU unless told otherwise (upstream's path); the
recipe loads it on the CPU under FSDP (compat.quantized_base_device_map). A plan that said "fits" for upstream's
path on the guide's 2 x 24 GB QLoRA run was wrong: it must say where it stops.
"""

from __future__ import annotations

import json

import pytest

from sft_recipe.plan import GIB, guide_plans, main, model_shape, parse_train_flags, plan_memory, render_guide_comparison
from sft_recipe.plan.gpu import (
    DEFAULT_CUDA_CONTEXT_GIB,
    PAGEABLE_COPY_BYTES_PER_S,
    QUANTIZE_WEIGHTS_PER_S_PER_THREAD,
    layer_bytes_as_loaded,
    weight_quantizing_bytes,
)
from sft_recipe.plan.inputs import workload
from tests.helpers import REPO

LLAMA_70B = str(REPO / "sft_recipe" / "plan" / "models" / "llama-2-70b")
QLORA = ["--config", str(REPO / "recipes" / "llama2_70b_qlora.yaml"), "--model_name_or_path", LLAMA_70B]
QLORA_YAML = str(REPO / "configs" / "fsdp_config_qlora.yaml")


@pytest.fixture(scope="module")
def qlora_args():
    return parse_train_flags(QLORA, "cuda")


def _plan(args, config, gpu_gib=24.0, num_processes=None, **kw):
    model_args, data_args, _, training_args = args
    return plan_memory(model_args, data_args, training_args, config, num_processes, gpu_gib, "cuda", ladder=False,
                       **kw)


# The guide's 4-bit base worked by hand from Llama-2-70B's config.json (the counts: tests/unit/test_plan_deepspeed.py):
# 68,451,041,280 weights in its 560 linears (80 layers x 7), 525,656,064 in the embeddings and head (with chatml's 3
# rows) and the norms. What FSDP shards: NF4 packs the linears at half a byte a weight; the rest stays bf16.
FOUR_BIT_SHARDABLE = 68_451_041_280 // 2 + 525_656_064 * 2  # 35,276,832,768 bytes
# What every rank holds whole, the quantization constants: an 8-bit absmax per block of 64 weights, an fp32 absmax per
# 256 of those blocks, and nested quantization's 256-entry fp32 code table per linear.
FOUR_BIT_REPLICATED = 68_451_041_280 * (1 / 64 + 4 / (64 * 256)) + 560 * 256 * 4  # 1,086,832,640 bytes


def _4bit_base(args=None) -> tuple[float, float]:
    """(shardable, replicated) bytes of the guide's 4-bit base (above)."""
    return FOUR_BIT_SHARDABLE, FOUR_BIT_REPLICATED


def _whole_4bit_base(args=None) -> float:
    return FOUR_BIT_SHARDABLE + FOUR_BIT_REPLICATED


def test_the_guides_qlora_run_fits_on_the_recipes_path_and_stops_at_load_on_upstreams():
    recipe, upstream = guide_plans(), guide_plans("upstream")
    assert recipe["qlora-2x24-offload"].fits and recipe["qlora-2x24-offload"].fails_at is None
    assert not upstream["qlora-2x24-offload"].fits
    assert upstream["qlora-2x24-offload"].fails_at == "load"  # the whole 4-bit base, before any sharding
    text = render_guide_comparison(recipe, upstream)
    assert "qlora-2x24-offload  upstream" in text and "does not fit at load in 24 GiB" in text
    assert "qlora-2x24-offload  recipe" in text and "-> fits in 24 GiB" in text


def test_fsdp_load_puts_nothing_on_the_gpu_and_wrapping_one_layer_beyond_the_shard(qlora_args):
    plan = _plan(qlora_args, QLORA_YAML)
    context = DEFAULT_CUDA_CONTEXT_GIB * GIB
    shardable, replicated = _4bit_base(qlora_args)
    # loaded on the CPU, by rank 0 alone: the CUDA context, and on the other rank rank 0's quantization state
    assert plan.phases["load"] == pytest.approx(context + replicated)
    per_rank = _plan(qlora_args, _yaml_with(fsdp_cpu_ram_efficient_loading=False))
    whole = _whole_4bit_base(qlora_args)
    model_args, data_args, _, training_args = qlora_args
    w = workload(model_args, data_args, training_args, "cuda")
    shape = model_shape(LLAMA_70B, extra_vocab=w.extra_vocab)
    # every rank loads its own copy on the CPU, each weight quantized on its GPU: the largest (an MLP projection,
    # 28672 x 8192) in bf16, packed, and its absmax, never more
    at_a_time = weight_quantizing_bytes(shape, w)
    assert at_a_time == pytest.approx(28672 * 8192 * (2 + 0.5 + 4 / 64)) and at_a_time < 0.6 * GIB
    assert per_rank.phases["load"] == pytest.approx(context + at_a_time)
    assert replicated > at_a_time  # rank 0's state outweighs one weight on the ranks that receive it (above)
    # one packed 70B decoder layer, not its bf16 size (~1.6 GiB): its linears' 855,638,016 weights at half a byte and
    # its two bf16 norms (its constants are among those held whole, above)
    layer = 855_638_016 // 2 + 2 * 8192 * 2
    assert layer_bytes_as_loaded(shape, w) == layer
    # With CPU offload the shards live in host RAM: the GPU holds the 4-bit constants and one layer at a time.
    assert plan.phases["wrap"] < context + 0.05 * whole + layer
    no_offload = _plan(qlora_args, _yaml_with(fsdp_offload_params=False))
    # a shard of 2, the constants every rank keeps whole, and one layer moved before it is sharded
    assert no_offload.phases["wrap"] == pytest.approx(context + shardable / 2 + replicated + layer, rel=1e-6)


def _yaml_with(**fsdp_settings) -> dict:
    import yaml

    cfg = yaml.safe_load(open(QLORA_YAML))
    cfg["fsdp_config"].update(fsdp_settings)
    return cfg


def test_upstreams_path_and_one_process_put_the_whole_quantized_base_on_the_gpu(qlora_args):
    whole = _whole_4bit_base(qlora_args)
    upstream = _plan(qlora_args, QLORA_YAML, load_path="upstream")
    assert upstream.phases["load"] == pytest.approx(DEFAULT_CUDA_CONTEXT_GIB * GIB + whole, rel=1e-6)
    assert upstream.phases["wrap"] > upstream.phases["load"]  # a unit's flat copy before it is sharded
    single = _plan(qlora_args, None, gpu_gib=80.0)  # one process: the quantizer's map is the right one
    assert single.phases["load"] == pytest.approx(DEFAULT_CUDA_CONTEXT_GIB * GIB + whole, rel=1e-6)


def test_host_ram_and_quantization_time_follow_the_path(qlora_args):
    recipe = _plan(qlora_args, QLORA_YAML)
    upstream = _plan(qlora_args, QLORA_YAML, load_path="upstream")
    whole = _whole_4bit_base(qlora_args)
    recipe_rows = {r.name: r.bytes for r in recipe.host_rows}
    upstream_rows = {r.name: r.bytes for r in upstream.host_rows}
    assert recipe_rows["loading"] == pytest.approx(whole)  # rank 0's one copy; the other rank: its state, on GPU
    assert upstream_rows["loading"] == 0.0  # quantized on the GPU as read
    per_rank = _plan(qlora_args, _yaml_with(fsdp_cpu_ram_efficient_loading=False, fsdp_sync_module_states=False))
    assert {r.name: r.bytes for r in per_rank.host_rows}["loading"] == pytest.approx(2 * whole)  # each its own
    shape = model_shape(LLAMA_70B, extra_vocab=8)
    # On GPUs each weight is quantized on the loading rank's GPU: bounded by the copies there (bf16 in, packed and
    # absmax back), seconds where the CPU takes minutes; the same for rank 0 alone and for every rank.
    assert recipe.quantization_seconds == pytest.approx(
        shape.quantizable_params * (2 + 0.5 + 4 / 64) / PAGEABLE_COPY_BYTES_PER_S)
    assert 10 < recipe.quantization_seconds < 60 and per_rank.quantization_seconds == recipe.quantization_seconds
    # beside it, what the CPU would take (rank 0 alone with its machine's 2 x 8 threads; every rank with its 8)
    assert recipe.cpu_quantization_seconds == pytest.approx(shape.quantizable_params /
                                                            (QUANTIZE_WEIGHTS_PER_S_PER_THREAD * 16))
    assert per_rank.cpu_quantization_seconds == pytest.approx(2 * recipe.cpu_quantization_seconds)
    assert any("rank 0 alone quantizes the base on its GPU, a weight at a time" in note for note in recipe.notes)
    assert any("every rank quantizes the base on its GPU" in note for note in per_rank.notes)
    assert upstream.quantization_seconds == 0.0
    # A CPU run quantizes on the CPU: rank 0 alone with its machine's threads (2 ranks x 8); every rank with its share
    model_args, data_args, _, training_args = qlora_args
    cpu = [plan_memory(model_args, data_args, training_args, config, None, 64.0, "cpu", ladder=False, **kw)
           for config, kw in ((_yaml_with(fsdp_offload_params=False), {}),
                              (_yaml_with(fsdp_offload_params=False, fsdp_cpu_ram_efficient_loading=False,
                                          fsdp_sync_module_states=False), {}),
                              (_yaml_with(fsdp_offload_params=False), {"quantize_threads_per_rank": 1}))]
    assert cpu[0].quantization_seconds == pytest.approx(shape.quantizable_params /
                                                        (QUANTIZE_WEIGHTS_PER_S_PER_THREAD * 16))
    assert cpu[1].quantization_seconds == pytest.approx(2 * cpu[0].quantization_seconds)
    assert 3 * 60 < cpu[1].quantization_seconds < 6 * 60  # minutes at 70B on 8 threads per rank, in a note
    assert any("rank 0 alone quantizes the base on the CPU" in note for note in cpu[0].notes)
    assert any("every rank quantizes the base on the CPU" in note for note in cpu[1].notes)
    assert cpu[2].quantization_seconds == pytest.approx(8 * cpu[0].quantization_seconds)


def test_an_8_rank_70b_qlora_loads_one_4bit_copy_not_eight(qlora_args):
    """The issue's figure: FSDP1 + cpu_ram_efficient_loading on 8 ranks holds ~34 GiB of host RAM at load (rank 0's
    copy), not 8 x 34 = 271 GiB; FSDP2 keeps one copy per rank (accelerate broadcasts no 4-bit weights there)."""
    whole = _whole_4bit_base(qlora_args)
    fsdp1 = {r.name: r for r in _plan(qlora_args, QLORA_YAML, num_processes=8).host_rows}["loading"]
    assert fsdp1.bytes == pytest.approx(whole) and 33 * GIB < fsdp1.bytes < 35 * GIB
    assert "on rank 0" in fsdp1.formula
    fsdp2 = _yaml_with()
    fsdp2["fsdp_config"]["fsdp_version"] = 2
    loading = {r.name: r.bytes for r in _plan(qlora_args, fsdp2, num_processes=8).host_rows}["loading"]
    assert loading == pytest.approx(8 * whole) and loading > 265 * GIB


def test_cli_prints_where_the_run_stops(capsys):
    argv = ["--config_file", QLORA_YAML, "--gpu_memory_gib", "24", *QLORA]
    assert main([*argv, "--load_path", "upstream"]) == 0
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT in 24 GiB per GPU at load" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    _, replicated = _4bit_base(parse_train_flags(QLORA, "cuda"))
    assert plan["fits"] and plan["phases_gib"]["load"] == pytest.approx(DEFAULT_CUDA_CONTEXT_GIB + replicated / GIB,
                                                                        abs=1e-3)
    assert plan["quantization_seconds"] > 0 and plan["fails_at"] is None
