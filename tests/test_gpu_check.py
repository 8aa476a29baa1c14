"""bench/gpu_check.sh cannot rot: its CPU smoke runs every step's real command (accelerate launch / run_peft.sh /
train.py) on the tiny model, reads what train.py wrote, asks the memory plan, and prints the table the GPU run prints.
On CPU the offload step is refused up front (offloading needs a GPU; the LoRA one is not launched again), the
upstream row is skipped (upstream's train.py is not in this repo) and so is the GPTQ row (its libraries are not on
the suite's path; with PYTHONPATH=.venv/gptq-site it runs and passes, 20 s): the table must say so rather than fail."""

from __future__ import annotations

import json
import re

from tests.helpers import REPO, launch_env, run_command


def test_gpu_check_smoke_prints_one_row_per_step(tmp_path):
    env = launch_env(cpu_switch=False)  # the script sets the CPU switch for its own runs
    env.update(GPU_CHECK_SMOKE="1", GPU_CHECK_DIR=str(tmp_path))
    env.pop("UPSTREAM_SFT_DIR", None)
    result = run_command(["bash", "bench/gpu_check.sh"], tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.output[-5000:]
    rows = {r["step"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())}
    assert list(rows) == ["lora", "lora+offload", "qlora", "qlora+offload", "lora-fp32base", "lora+actoffload",
                          "lora-diverge", "qlora-quantizer", "qlora-cpuquant", "qlora-1gpu", "qlora-fsdp1-newrows",
                          "qlora-fsdp1-every", "qlora-fsdp1-once", "gptq", "upstream"]
    assert rows["lora-fp32base"]["status"] == rows["lora+actoffload"]["status"] == "skipped"  # GPU-only contrasts
    assert rows["lora-diverge"]["status"] == "skipped"  # its CPU path is tests/e2e/test_divergence_and_ctrl_c.py
    assert rows["qlora-fsdp1-newrows"]["status"] == "skipped"  # its CPU path is bench/use_orig_params.py
    assert rows["qlora-cpuquant"]["status"] == "skipped"  # a CPU run quantizes on the CPU in the qlora row already
    for name in ("lora", "qlora", "qlora-quantizer", "qlora-1gpu"):
        row = rows[name]
        assert (row["status"], row["adapter_check"]) == ("ok", "pass"), row
        assert row["tokens_per_second"] > 0 and row["plan_gib"] > 0 and row["peak_after_save_gib"] > 0, row
    # The fused-head probe (bench/train_probing_fused_head.py) speaks from inside TRL's LM head on every lora/qlora
    # row: on the GPU this line says where the offload rows' head weight was.
    for name in ("lora", "qlora"):
        assert re.search(r"weight \w+ on cpu \(\d+, \d+\), hidden states on cpu", rows[name]["fused_head"]), rows[name]
    assert rows["qlora+offload"]["status"] == "refused"
    assert "fsdp_offload_params: true on a CPU run" in rows["qlora+offload"]["note"]
    assert rows["lora+offload"]["status"] == "skipped"  # the same refusal; not launched twice in the smoke
    assert rows["upstream"]["status"] == "skipped" and "UPSTREAM_SFT_DIR" in rows["upstream"]["note"]
    # GPTQ's libraries live in .venv/gptq-site, off this run's path (tests/test_gptq.py runs that path on CPU)
    assert rows["gptq"]["status"] == "skipped" and "not installed" in rows["gptq"]["note"]
    # The load columns come from run_record.json's GPU peaks: none on a CPU (the GPU run fills them); the load's
    # seconds and host RAM per rank are measured on CPU too.
    assert rows["qlora"]["load_gpu_gib"] is None and rows["qlora"]["wrap_gpu_gib"] is None
    assert rows["qlora"]["load_seconds"] > 0 and len(rows["qlora"]["host_load_mib_per_rank"]) == 1
    for name in ("qlora-fsdp1-every", "qlora-fsdp1-once"):  # two ranks need two GPUs
        assert rows[name]["status"] == "skipped" and "tests/e2e/test_quantized_once.py" in rows[name]["note"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| GPU GiB at load | through wrap | plan load | load s | host MiB at load per rank |" in table
    # allocated and reserved beside the plan's figure of each kind (filled where torch measures them: on the GPU)
    assert "| allocated / plan | reserved / plan |" in table
    assert rows["lora"]["plan_allocated_gib"] <= rows["lora"]["plan_reserved_gib"] <= rows["lora"]["plan_gib"]
    csv_lines = (tmp_path / "plan_vs_measured.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,peak_allocated_gib,plan_allocated_gib,peak_reserved_gib,plan_reserved_gib")
    assert table in result.output, "the table is printed"
    assert re.search(r"^\| qlora-1gpu \| ok \| \d+ \|", table, flags=re.M)
    # run_peft.sh ran as shipped: its own reentrant checkpointing and uint8 4-bit storage
    summary = json.loads((tmp_path / "runs" / "qlora-1gpu" / "run_record.json").read_text())
    assert summary["run"]["config"]["model"]["use_reentrant"] is True
    assert summary["run"]["config"]["model"]["bnb_4bit_quant_storage_dtype"] == "uint8"


def test_wheel_fetch_never_asks_for_torch_and_headers_give_the_command():
    fetch = (REPO / "bench" / "fetch_gpu_wheels.sh").read_text()
    assert "--no-deps" in fetch and not re.search(r"\btorch==", fetch), "a resolved torch would be a CUDA build"
    for script in ("bench/gpu_check.sh", "bench/fetch_gpu_wheels.sh"):
        head = (REPO / script).read_text().splitlines()
        assert head[0] == "#!/usr/bin/env bash" and head[1].startswith("# ")
        assert any(f"bash {script}" in line for line in head[:6]), script
    ignored = (REPO / ".gitignore").read_text()
    assert "/bench/wheels/" in ignored, "tens of MiB of wheels must never be committed"


def test_a_gpu_row_sets_the_plan_beside_both_measured_kinds(tmp_path):
    """What the GPU run writes for a trained step: measured / plan (plan/measured) per kind, and a CSV row for the
    published table with the model's config beside it."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    row = {"step": "lora", "peak_train_gib": 20.0, "plan_allocated_gib": 21.0, "peak_reserved_gib": 24.0,
           "plan_reserved_gib": 22.8}
    assert gpu_check.versus(row, "peak_train_gib", "plan_allocated_gib") == "20.00 / 21.00 (1.05x)"
    assert gpu_check.versus({"step": "x"}, "peak_train_gib", "plan_allocated_gib") == "-"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    gpu_check.write_plan_vs_measured([row, {"step": "refused"}], model, tmp_path / "plan_vs_measured.csv")
    lines = (tmp_path / "plan_vs_measured.csv").read_text().splitlines()
    assert lines[1:] == ["lora,20.0,21.0,24.0,22.8,config.json"] and (tmp_path / "config.json").is_file()


def test_the_gpu_run_says_whether_quantizing_on_the_gpu_gave_the_cpus_bytes_and_how_much_faster():
    """The qlora row (each weight quantized on the GPU) beside qlora-cpuquant (on the CPU): a differing checksum is
    said in capitals, and no line is printed when either row has no load time (skipped, failed)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    gpu = {"step": "qlora", "load_seconds": 4.0, "frozen_checksum": 17}
    cpu = {"step": "qlora-cpuquant", "load_seconds": 60.0, "frozen_checksum": 17}
    line = gpu_check.quantization_contrast([gpu, cpu])
    assert "load 4.0 s vs 60.0 s (15.0x faster)" in line and "packed bytes identical" in line
    assert "DIFFERENT" in gpu_check.quantization_contrast([gpu, {**cpu, "frozen_checksum": 18}])
    assert gpu_check.quantization_contrast([gpu, {"step": "qlora-cpuquant", "status": "skipped"}]) is None
