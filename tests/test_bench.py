"""The bench scripts run: the GPU benchmark's code path on a tiny CPU config, its refusal without a GPU, and the CPU
throughput table's arithmetic (full bench runs are not tests: they print tables, see docs/memory-and-speed.md)."""

import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, launch_env


def _bench(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_bench_code_path_runs_on_a_tiny_cpu_config():
    proc = _bench("bench/gpu_throughput.py", "--cpu_smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| sdpa |")]
    assert len(rows) == 2 and "packed (padding-free)" in rows[0] and "padded" in rows[1]
    assert "skipped: flash_attention_2" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_gpu_bench_refuses_clearly_without_a_gpu():
    proc = _bench("bench/gpu_throughput.py")
    assert proc.returncode == 2 and "no CUDA GPU is visible" in proc.stderr and "--cpu_smoke" in proc.stderr


def test_throughput_table_reports_sharing_and_loading(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    from throughput import print_table

    rows = [{"name": "lora-single", "what": "", "ranks": 1, "tokens_per_second": 60.0, "model_state": [300.0],
             "after_load": [290.0], "after_load_file": [10.0], "peak_rss": [1100.0]},
            {"name": "lora-fsdp2", "what": "", "ranks": 2, "tokens_per_second": 70.0, "model_state": [150.0, 150.0],
             "after_load": [290.0, 0.0], "after_load_file": [10.0, 10.0], "peak_rss": [1200.0, 1100.0]},
            {"name": "lora-fsdp2-full-load", "what": "", "ranks": 2, "tokens_per_second": 70.0,
             "model_state": [150.0, 150.0], "after_load": [290.0, 290.0], "after_load_file": [10.0, 10.0],
             "peak_rss": [1300.0, 1300.0]}]
    print_table(rows)
    out = capsys.readouterr().out
    assert "lora-fsdp2: model state per rank = 0.50 / 0.50 of one process (ideal 1/2)" in out
    assert "private memory after load, all ranks: 290 MiB with cpu_ram_efficient_loading, 580 MiB without" in out


def test_scale_bench_smoke_prints_the_table_and_flat_save_slopes():
    """bench/scale.py --smoke: two tiny models through FSDP2 on 2 ranks, ours and upstream's path side by side."""
    proc = _bench("bench/scale.py", "--smoke", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256x2 lora") or
            line.startswith("| 512x2 lora")]
    assert len(rows) == 2 and all("| fsdp2 | 2 |" in row and row.endswith("| yes |") for row in rows), rows
    # rank 1 loads no weight with cpu_ram_efficient_loading; upstream's load (the first size only) reads on both
    assert "/0 [" in rows[1] and (upstream := re.search(r"/0 \((\d+)/(\d+)\)", rows[0])), rows
    assert int(upstream[1]) > 0 and int(upstream[2]) > 0, rows[0]
    slope_rows = [line for line in proc.stdout.splitlines() if line.startswith("| fsdp2 | lora | 2 |")]
    assert len(slope_rows) == 1
    ours_save_slope, upstream_save_slope = (float(x) for x in slope_rows[0].split("|")[4:6])
    assert abs(ours_save_slope) < 0.2 and upstream_save_slope > 0.5, slope_rows[0]  # flat vs a copy per model byte
    assert "(within 15%)" in proc.stdout  # the plan's peak RSS per rank


def test_quantized_load_bench_smoke_measures_the_plans_bytes_and_plans_every_engine():
    proc = _bench("bench/quantized_load.py", "--smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = [line for line in proc.stdout.splitlines() if line.startswith("| llama-256x2 |")]
    assert len(measured) == 1
    ratio = float(measured[0].strip("| ").split("|")[-1])
    assert abs(ratio - 1) < 0.02, measured  # live weight bytes after loading = the plan's quantized base
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    guide = rows["FSDP1 (guide's config: rank 0 loads once)"]
    assert '{"": "cpu"} on rank 0' in guide and guide.endswith("| fits |")
    # quantized on the loading rank's GPU in seconds, beside the CPU's minutes
    gpu_s, cpu_min = re.search(r"\| (\d+) s \(([\d.]+) min\) \|", guide).groups()
    assert 10 < int(gpu_s) < 60 and 1.0 < float(cpu_min) < 3.0
    # host RAM at load per machine, 2 ranks / 8 ranks: one 4-bit copy when rank 0 alone loads, one per rank else
    once = [float(x) for x in guide.split("|")[5].split("/")]
    every = [float(x) for x in rows["FSDP2"].split("|")[5].split("/")]
    assert once[0] == once[1] and every == pytest.approx([2 * once[0], 8 * once[0]], rel=0.01)
    assert rows["FSDP1, upstream's path"].endswith("| does not fit at load |")
    assert "refused before loading" in rows["DeepSpeed ZeRO-3"]


def test_dtype_bench_smoke_halves_the_base_as_the_plan_says():
    proc = _bench("bench/dtype_scale.py", "--smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| llama-256x2-bf16 | fsdp2 |")]
    assert len(rows) == 1, proc.stdout
    load_ratio, wrap_ratio = (float(x) for x in rows[0].split("|")[5].split("/"))
    assert abs(load_ratio - 1) < 0.05 and abs(wrap_ratio - 1) < 0.05, rows[0]  # the base's bytes halved, as planned


def test_data_prep_bench_smoke_prints_both_paths_cold_and_warm_and_ours_reads_its_copy_warm(tmp_path):
    """bench/data_prep.py at 200 rows: upstream's path and ours, cold and warm, with the ratio."""
    proc = _bench("bench/data_prep.py", "--rows", "200", "--max_length", "256", "--keep", str(tmp_path),
                  "--warm_rounds", "1", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 200 |")]
    assert [r[1].strip() for r in rows] == ["upstream", "ours", "ours / upstream"]
    assert all(float(v) > 0 for r in rows[:2] for v in r[2:6])  # seconds and peak RSS, cold and warm
    assert rows[2][2].strip().endswith("x") and rows[2][3].strip().endswith("x")
    assert "data: prepared by rank 0" in (tmp_path / "ours-200-cold.log").read_text()
    assert "data: read the copy a previous launch prepared" in (tmp_path / "ours-200-warm.log").read_text()
