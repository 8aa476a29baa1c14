"""The memory plan at three sequence lengths against real CPU runs: measured peak RSS of one process within 15% of
the plan's cpu-mode prediction at --max_seq_len 128, 512 and 1024 -- what `--longest_seq_len --device cpu` searches
over, so the length it answers is one a run reaches.

The model is a random Llama (hidden 512, 4 layers, 10M parameters, 38 MiB) whose saved activations grow from ~10% to
~50% of the peak over these lengths (micro-batch 2, packing, no checkpointing, fp32), so the activation term is what
is tested, not the fixed cost. The runs use glibc's default allocator, as users launch them: the plan's CPU heap
factor (sft_recipe/plan/cpu.py) is measured against it. With MALLOC_MMAP_THRESHOLD_=65536 freed activations go back
to the OS and RSS keeps ~1.2x the live activations instead of ~2x, so the plan over-predicts (measured here: +4%, +15%,
+28% at 128, 512, 1024); the load/save tests set it because they measure live tensor bytes, this one does not.
Three launches in parallel: ~30 s on 2 cores.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import REPO, launch_env, launch_train

LENGTHS = (128, 512, 1024)
TOLERANCE = 0.15
FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--learning_rate", "1e-3", "--logging_steps", "1", "--packing", "True", "--report_to", "none",
         "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7", "--bf16", "False",
         "--gradient_checkpointing", "False"]


@pytest.fixture(scope="module")
def model_512x4(tiny, tmp_path_factory):
    from sft_recipe.tiny import build_bench_model

    return build_bench_model(tmp_path_factory.mktemp("seq-len"), tiny.root, hidden_size=512, num_hidden_layers=4)


def test_peak_rss_matches_the_plan_at_three_sequence_lengths(tiny, model_512x4, tmp_path):
    from sft_recipe.plan import MIB, parse_train_flags, plan_memory, read_accelerate_config

    base = ["--model_name_or_path", str(model_512x4), "--dataset_name", str(tiny.jsonl_dir), *FLAGS]
    env = launch_env()
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # see the module docstring

    def launch(seq_len: int):
        return launch_train("cpu/single.yaml", tmp_path / f"s{seq_len}", [*base, "--max_seq_len", str(seq_len)], env)

    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = dict(zip(LENGTHS, pool.map(launch, LENGTHS)))
    config = read_accelerate_config(REPO / "configs" / "cpu" / "single.yaml")
    table, misses = [], []
    for seq_len, result in results.items():
        assert result.returncode == 0, result.output[-6000:]
        measured = result.record["memory"]["peak_rss_mib_per_rank"][0]
        model_args, data_args, _, training_args = parse_train_flags([*base, "--max_seq_len", str(seq_len)], "cpu")
        plan = plan_memory(model_args, data_args, training_args, config, None, 64.0, "cpu", ladder=False)
        predicted = plan.per_rank_bytes[0] / MIB
        activations = next(r.bytes for r in plan.rows if r.name.startswith("activations")) / MIB
        table.append(f"--max_seq_len {seq_len:>5}: predicted {predicted:6.0f} MiB (activations {activations:4.0f}), "
                     f"measured {measured:6.0f} MiB, {(predicted - measured) / measured:+.1%}")
        if abs(predicted - measured) > TOLERANCE * measured:
            misses.append(seq_len)
    print("\n".join(table))
    assert not misses, "\n".join(table)
