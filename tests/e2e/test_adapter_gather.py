"""The final save gathers only what the adapter holds (sft_recipe/artifacts/gather.py), on every engine,
bit-identically.

One real launch per engine (`accelerate launch` of tests/e2e/adapter_gather_worker.py, 2 CPU ranks over gloo; one
process for the single-process engine) trains LoRA and QLoRA, each with and without a chatml vocabulary resize, and
gathers the adapter two ways: ours, and upstream's full FULL_STATE_DICT gather. What must hold:
- the adapter PEFT would save from ours is byte-for-byte the one from the full gather (keys, dtypes, bytes);
- ours gathered nothing but those tensors (the full gather held every weight);
- after a resize, the embedding and LM-head rows are among them.
On the FSDP and ZeRO-3 engines the launch also runs a 1024x4 Llama (149 MiB fp32) with MALLOC_MMAP_THRESHOLD_=65536,
so that anonymous RSS follows live tensor bytes (report.RssWatch): rank 0's added memory for our gather must stay
within 2 x adapter bytes + 64 MiB, while the full gather -- the negative control that shows the probe can see a
gather -- adds at least 80 % of the model's bytes.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, launch_env, launch_script

WORKER = REPO / "tests" / "e2e" / "adapter_gather_worker.py"
COMBOS = ("lora", "lora-chatml", "qlora", "qlora-chatml")
# engine -> (accelerate config, extra worker flags, env with the CPU switch, 2 ranks)
ENGINES = {
    "single": ("cpu/single.yaml", [], True),
    "fsdp1": ("cpu/fsdp_config.yaml", [], True),
    "fsdp2": ("cpu/fsdp2_config.yaml", [], True),
    # DeepSpeed on CPU: gloo is its CPU switch, ACCELERATE_USE_CPU must stay unset, fp32 storage (tests/test_deepspeed).
    "deepspeed": ("cpu/deepspeed_config.yaml", ["--ddp_backend", "gloo", "--bf16", "False",
                                                "--bnb_4bit_quant_storage_dtype", "float32"], False),
}
MEMORY_SLACK_MIB = 64


@pytest.fixture(scope="module")
def bench_model(tiny, tmp_path_factory):
    from sft_recipe.tiny import build_bench_model

    return build_bench_model(tmp_path_factory.mktemp("bench"), tiny.root, hidden_size=1024, num_hidden_layers=4)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_adapter_only_gather_is_bit_identical_and_small(engine, tiny, bench_model, tmp_path):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    config, extra, cpu_switch = ENGINES[engine]
    env = launch_env(cpu_switch=cpu_switch)
    measure_memory = engine in ("fsdp1", "fsdp2", "deepspeed")
    if measure_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    args = ["--model_dir", str(tiny.model_dir), "--out_dir", str(tmp_path), "--combos", ",".join(COMBOS), *extra]
    if measure_memory:
        args += ["--big_model_dir", str(bench_model)]
    result = launch_script(config, str(WORKER), args, tmp_path, env=env)
    assert result.returncode == 0, result.output[-4000:]

    for combo in COMBOS + (("big-lora-chatml",) if measure_memory else ()):
        facts = json.loads((tmp_path / f"{combo}.json").read_text())
        assert facts["num_processes"] == (1 if engine == "single" else 2)
        assert facts["keys_ours"] == facts["keys_full"] and facts["keys_ours"], combo
        assert facts["identical"] == facts["keys_full"], f"{combo}: tensors differ from the full gather"
        assert facts["gathered_keys"] == len(facts["keys_ours"]) < facts["full_keys"], combo
        assert facts["lora_b_nonzero"] > 0, combo
        resized = combo.endswith("chatml")
        assert bool(facts["embedding_keys"]) == resized, (combo, facts["embedding_keys"])
        if combo.startswith("big"):
            bound = 2 * facts["adapter_mib"] + MEMORY_SLACK_MIB
            assert facts["ours_added_mib_per_rank"][0] <= bound, facts
            assert facts["full_added_mib_per_rank"][0] >= 0.8 * facts["full_mib"], facts  # the probe sees a gather
