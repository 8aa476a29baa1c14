"""Do the recipe's GPU paths work, and how fast? One call on one lent H200 (started by bench/gpu_check.sh).

Each step is a real `accelerate launch` / launch-script run of train.py on an 8B-shaped random Llama (hidden 4096,
MLP 14336, 32 heads / 8 KV heads, GPU_CHECK_LAYERS decoder layers, default 4; the embedding rows are the tiny
tokenizer's, padded to 64, since train.py refuses a tokenizer that does not fit its model), sequence 2048, packing,
gradient checkpointing, SDPA, the tiny chat data repeated, a few steps. Each is time-boxed and fails soft: a failure
or timeout is a row in the table, and the next step runs. Steps:
    lora / lora+offload     FSDP2 on 1 process (configs/fsdp2_config.yaml --num_processes 1), CPU offload off / on;
                            the base in bf16 (the recipe's default for LoRA under --bf16 True); these four rows run
                            through bench/train_probing_fused_head.py (where TRL's fused LM head finds its weight)
    lora-fp32base           lora with upstream's fp32 base (--torch_dtype float32): memory and tokens/s beside lora
    lora+actoffload         lora with TRL's --activation_offloading True
    lora-diverge            lora at --learning_rate 1e30: stops at the NaN step (exit 4), its step-3 save cancelled
    qlora / qlora+offload   the same with 4-bit NF4, nested quant, bf16 storage (the guide's QLoRA settings)
    qlora-cpuquant          qlora with each 4-bit weight quantized on the CPU (bench/train_quantizing_on_cpu.py), as
                            before the recipe quantized them on the GPU: load s beside qlora's; frozen checksum
    qlora-quantizer         qlora with transformers' own placement of the 4-bit base (no device_map: upstream's path;
                            bench/train_with_quantizer_placement.py): its "GPU at load" column is the whole base
    qlora-1gpu              bash run_peft.sh: one process, no launcher, uint8 storage (upstream's single-GPU default)
    qlora-fsdp1-newrows     the guide's FSDP1 QLoRA config on 1 GPU with fsdp_use_orig_params true and the chatml rows
                            trained (--train_new_tokens): the root unit's gradient the plan adds (~4 B per root param)
    qlora-fsdp1-every/-once the guide's FSDP1 QLoRA config on 2 GPUs, every rank loading its own 4-bit copy vs rank 0
                            alone (cpu_ram_efficient_loading): load s and host RAM per rank side by side (2 GPUs only)
    gptq                    run_peft_fsdp_gptq.sh (FSDP1) on the tiny model quantized with GPTQ on this machine, if
                            optimum + gptqmodel are installed (bench/wheels/gptq)
    upstream                upstream's examples/sft/train.py on the lora flags, if UPSTREAM_SFT_DIR (default
                            bench/upstream/, git-ignored: carry it) holds it and its utils.py; not in this repo,
                            skipped with a note otherwise
One table: tokens/s (mean after the first logging interval), MFU, peak GPU memory during training vs the memory
plan's prediction (sft_recipe.plan, same flags), peak allocated and peak reserved each beside the plan's figure of
that kind (plan_vs_measured.csv beside the table: the rows the published table gains from a GPU run), peak GPU
memory from process start to the end of loading and to the end of wrapping (run_record.json) beside the plan's load
phase, seconds to load and quantize a 4-bit base (rank 0's log) and host RAM per rank at the end of loading, peak
after the final save, its seconds, the adapter check.
GPU_CHECK_SMOKE=1: the same steps on the tiny model in fp32 on CPU, 2 steps each (tests/test_gpu_check.py); the
offload steps are then refused up front (offload needs a GPU), which is what the smoke expects.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SMOKE = os.environ.get("GPU_CHECK_SMOKE", "") not in ("", "0")
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "450"))  # the 8 minutes, minus setup and slack
# WORK holds the GB-sized model and the runs; OUT only the table, its JSON and the logs (on the device machine, what
# is written under $OUT is copied back, so the 8B-shaped weights must not land there).
WORK = Path(os.environ.get("GPU_CHECK_DIR", "/tmp/gpu_check"))
OUT = Path(os.environ["OUT"]) / "gpu_check" if os.environ.get("OUT") else WORK
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
BIN = Path(sys.executable).parent


def build_inputs() -> tuple[Path, Path]:
    """(model folder, data folder): the 8B-shaped random Llama with the tiny tokenizer, and the tiny chat data
    repeated so that packing fills enough 2048-token rows; in smoke mode the tiny model and data as they are."""
    from sft_recipe.tiny import build_tiny

    tiny = build_tiny(WORK / "tiny")
    if SMOKE:
        return tiny.model_dir, tiny.jsonl_dir
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir, data_dir = WORK / "llama-8b-shape", WORK / "data"
    if not (model_dir / "config.json").exists():
        layers = int(os.environ.get("GPU_CHECK_LAYERS", "4"))
        # The embedding rows are the tiny tokenizer's, padded to 64: train.py refuses a tokenizer 10 % smaller than
        # the embeddings (the wrong model's tokenizer), and the plan reads this same config, so the rows compare.
        vocab = -(-len(AutoTokenizer.from_pretrained(str(tiny.model_dir))) // 64) * 64
        config = LlamaConfig(**{**LLAMA_8B, "vocab_size": vocab}, num_hidden_layers=layers, bos_token_id=1,
                             eos_token_id=2)
        torch.manual_seed(0)
        with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes on the CPU
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(model_dir))
        AutoTokenizer.from_pretrained(str(tiny.model_dir)).save_pretrained(str(model_dir))
        del model
        torch.cuda.empty_cache()
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, copies in (("train", 60), ("test", 2)):
        rows = (tiny.jsonl_dir / f"{split}.jsonl").read_text().splitlines()
        (data_dir / f"{split}.jsonl").write_text("\n".join(rows * copies) + "\n")
    return model_dir, data_dir


def common_flags(model: Path, data: Path, out: Path) -> list[str]:
    seq, steps = ("128", "2") if SMOKE else ("2048", os.environ.get("GPU_CHECK_STEPS", "8"))
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--seed", "100", "--max_seq_len", seq, "--max_steps", steps, "--packing", "True",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
            "--learning_rate", "1e-4", "--gradient_checkpointing", "True", "--use_reentrant", "False",
            "--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
            "--lora_target_modules", "all-linear", "--use_flash_attn", "False", "--bf16", str(not SMOKE),
            "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--splits", "train,test",
            "--dataset_text_field", "content"]


def qlora_flags(storage: str) -> list[str]:
    compute = "float32" if SMOKE else "bfloat16"
    return ["--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_quant_type", "nf4",
            "--bnb_4bit_compute_dtype", compute, "--bnb_4bit_quant_storage_dtype", storage]


def steps(model: Path, data: Path) -> list[dict]:
    config = "configs/cpu/fsdp2_config.yaml" if SMOKE else "configs/fsdp2_config.yaml"
    storage = "float32" if SMOKE else "bfloat16"  # FSDP needs the model dtype; the smoke runs fp32
    # `python -m` rather than the `accelerate` script: on the image the interpreter's bin need not hold it.
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", config,
              "--num_processes", "1"]
    plan = ["--config_file", config, "--num_processes", "1"]
    out = WORK / "runs"
    result = []
    for name, extra in (("lora", []), ("qlora", qlora_flags(storage))):
        for offload in ("false", "true"):
            label = name + ("+offload" if offload == "true" else "")
            flags = common_flags(model, data, out / label) + extra
            # Through the fused-head probe: where TRL's LM head found its weight (the offload rows' question).
            result.append(dict(name=label, cmd=launch + ["--fsdp_offload_params", offload,
                                                         "bench/train_probing_fused_head.py", *flags],
                               plan=plan + ["--fsdp_offload_params", offload, *flags], out=out / label))
            if SMOKE and label == "lora+offload":  # the same up-front refusal as qlora+offload: 8 s of suite time
                result[-1] = dict(name=label, skip="smoke: refused on CPU like qlora+offload (offload needs a GPU)")
    # The lora run with upstream's fp32 base (the recipe's default is bf16 under --bf16 True), and with TRL's
    # activation offloading: peak memory and tokens/s beside the lora row.
    for label, extra in (("lora-fp32base", ["--torch_dtype", "float32"]),
                         ("lora+actoffload", ["--activation_offloading", "True"])):
        flags = common_flags(model, data, out / label) + extra
        result.append(dict(name=label, cmd=launch + ["--fsdp_offload_params", "false", "train.py", *flags],
                           plan=plan + ["--fsdp_offload_params", "false", *flags], out=out / label))
        if SMOKE:  # fp32 is the smoke's lora row already (--bf16 False); offloading needs a GPU (refused on CPU)
            result[-1] = dict(name=label, skip="smoke: the lora row covers it on CPU (fp32; offloading needs a GPU)")
    # Divergence on CUDA, where the step-end flags are read one step late (preemption.StopAtStepEnd._read): lr 1e30
    # makes step 2 NaN; step 2 neither logs nor saves, so its flags are read at step 3, whose save must be cancelled.
    flags = common_flags(model, data, out / "lora-diverge") + ["--learning_rate", "1e30", "--max_steps", "6",
                                                                "--logging_steps", "5", "--save_strategy", "steps",
                                                                "--save_steps", "3"]
    result.append(dict(name="lora-diverge", cmd=launch + ["--fsdp_offload_params", "false", "train.py", *flags],
                       plan=None, out=out / "lora-diverge", expect="diverged"))
    if SMOKE:  # tests/e2e/test_divergence_and_ctrl_c.py runs the CPU path (read at once, no lag)
        result[-1] = dict(name="lora-diverge", skip="smoke: the e2e divergence tests cover the CPU path")
    # The same qlora run with the base placed by transformers' quantizer (upstream's path): the load column's contrast.
    flags = common_flags(model, data, out / "qlora-quantizer") + qlora_flags(storage)
    result.append(dict(name="qlora-quantizer", cmd=launch + ["--fsdp_offload_params", "false",
                                                             "bench/train_with_quantizer_placement.py", *flags],
                       plan=plan + ["--fsdp_offload_params", "false", *flags, "--load_path", "upstream"],
                       out=out / "qlora-quantizer"))
    # The same qlora run with each weight quantized on the CPU (as before compat.quantize_each_weight_on): its load
    # seconds beside the qlora row's (quantized on this GPU a weight at a time), and its frozen-weight checksum.
    flags = common_flags(model, data, out / "qlora-cpuquant") + qlora_flags(storage) + ["--max_steps", "2"]
    result.append(dict(name="qlora-cpuquant", cmd=launch + ["--fsdp_offload_params", "false",
                                                            "bench/train_quantizing_on_cpu.py", *flags],
                       plan=plan + ["--fsdp_offload_params", "false", *flags], out=out / "qlora-cpuquant"))
    if SMOKE:  # on a CPU machine both rows quantize on the CPU: nothing to compare
        result[-1] = dict(name="qlora-cpuquant", skip="smoke: a CPU run quantizes on the CPU in the qlora row too")
    # run_peft.sh's own --use_reentrant True stays: that is the path being checked.
    flags = common_flags(model, data, out / "qlora-1gpu")
    at = flags.index("--use_reentrant")
    single = flags[:at] + flags[at + 2:]
    single += ["--push_to_hub", "False"] + qlora_flags("uint8")
    result.append(dict(name="qlora-1gpu", cmd=["bash", "run_peft.sh", *single], plan=single, out=out / "qlora-1gpu",
                       env={"PYTHON": sys.executable}))
    # New-token rows under FSDP1 as its refusal's fix configures them (use_orig_params true), on the guide's QLoRA
    # config: on CPU the root unit's whole gradient cost 4 B per root parameter (bench/use_orig_params.py), and a
    # QLoRA run died at its end until compat.restore_bnb_4bit_storage_layout stopped asking PEFT for merged weights.
    fsdp1 = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
             "configs/fsdp_config_qlora.yaml", "--num_processes", "1", "--fsdp_use_orig_params", "true",
             "--fsdp_offload_params", "false"]
    flags = common_flags(model, data, out / "qlora-fsdp1-newrows") + qlora_flags(storage) + [
        "--chat_template_format", "chatml", "--train_new_tokens", "True", "--use_reentrant", "True"]
    result.append(dict(name="qlora-fsdp1-newrows", cmd=fsdp1 + ["train.py", *flags],
                       plan=["--config_file", "configs/fsdp_config_qlora.yaml", "--num_processes", "1",
                             "--fsdp_use_orig_params", "true", "--fsdp_offload_params", "false", *flags],
                       out=out / "qlora-fsdp1-newrows"))
    if SMOKE:  # the CPU path: bench/use_orig_params.py and tests/unit/test_record.py
        result[-1] = dict(name="qlora-fsdp1-newrows", skip="smoke: bench/use_orig_params.py runs the CPU path")
    result += fsdp1_load_steps(model, data, out, storage)
    result.append(gptq_step(model, out))
    upstream = Path(os.environ.get("UPSTREAM_SFT_DIR", REPO / "bench" / "upstream"))
    if (upstream / "train.py").is_file():
        flags = common_flags(model, data, out / "upstream")
        flags[flags.index("--max_seq_len")] = "--max_length"  # TRL's name; upstream's own parser has no alias
        result.append(dict(name="upstream", cmd=launch + ["--fsdp_offload_params", "false",
                                                          str(upstream / "train.py"), *flags],
                           plan=None, out=out / "upstream", cwd=upstream))
    else:
        result.append(dict(name="upstream", skip=f"no upstream train.py in {upstream} (set UPSTREAM_SFT_DIR to a "
                                                 "checkout of peft's examples/sft to compare side by side)"))
    return result


def fsdp1_load_steps(model: Path, data: Path, out: Path, storage: str) -> list[dict]:
    """The guide's FSDP1 QLoRA config on 2 GPUs, every rank loading its own 4-bit copy vs rank 0 alone
    (cpu_ram_efficient_loading): load seconds, host RAM per rank at load, GPU peak through wrapping side by side.
    Two ranks need two GPUs (NCCL puts one rank on a GPU): skipped with a note on one; tests/e2e/test_quantized_once.py
    runs both on CPU ranks."""
    import torch

    rows = []
    for label, extra in (("qlora-fsdp1-every", ["--fsdp_cpu_ram_efficient_loading", "false",
                                                "--fsdp_sync_module_states", "false"]),
                         ("qlora-fsdp1-once", [])):
        if SMOKE or torch.cuda.device_count() < 2:
            rows.append(dict(name=label, skip=f"needs 2 GPUs ({torch.cuda.device_count()} visible); "
                                              "tests/e2e/test_quantized_once.py runs it on CPU ranks"))
            continue
        config = ["--config_file", "configs/fsdp_config_qlora.yaml", "--num_processes", "2",
                  "--fsdp_offload_params", "false", *extra]
        flags = common_flags(model, data, out / label) + qlora_flags(storage)
        rows.append(dict(name=label, cmd=[sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
                                          *config, "train.py", *flags],
                         plan=[*config[:4], "--fsdp_offload_params", "false", *flags], out=out / label))
    return rows


def gptq_step(model: Path, out: Path) -> dict:
    """run_peft_fsdp_gptq.sh (FSDP1, the GPU config) on the tiny model quantized with GPTQ here: whether GPT-QModel's
    trainable kernel loads and trains on this GPU. Needs optimum + gptqmodel (bench/wheels/gptq)."""
    import importlib.util

    # bench/gpu_check.sh installs them into their own folder, on this step's path alone (see its header: a
    # gptqmodel that cannot import breaks PEFT in every other step).
    site = REPO / "bench" / ".gpu-site-gptq"
    missing = [m for m in ("optimum", "gptqmodel") if importlib.util.find_spec(m) is None and
               not (site / m).is_dir()]
    if missing:
        return dict(name="gptq", skip=f"{' and '.join(missing)} not installed (carry bench/wheels/gptq)")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    base = WORK / "tiny-gptq"
    build = f"{sys.executable} -m sft_recipe.train.gptq --build_tiny {base} --source {WORK / 'tiny' / 'model'}"
    config = "configs/cpu/fsdp_config.yaml" if SMOKE else "configs/fsdp_config.yaml"
    flags = ["--use_flash_attn", "False", "--bf16", str(not SMOKE), "--max_steps", "2", "--max_seq_len", "128",
             "--per_device_train_batch_size", "2", "--eval_strategy", "no", "--save_strategy", "no",
             "--logging_steps", "1", "--dataset_name", str(WORK / "tiny" / "data" / "jsonl")]
    script = f"MODEL={base} OUTPUT_DIR={out / 'gptq'} ACCELERATE_CONFIG={config} NUM_PROCESSES=1 " \
             f"PATH={BIN}:$PATH bash run_peft_fsdp_gptq.sh " + " ".join(flags)
    return dict(name="gptq", cmd=["bash", "-c", f"{build} && {script}"], plan=None, out=out / "gptq",
                env={"PYTHONPATH": path})


def predicted(plan_argv: list[str] | None) -> dict:
    """The memory plan's per-GPU peak and load phase for the same flags (sft_recipe.plan, no weights read), or {}."""
    if plan_argv is None:
        return {}
    from sft_recipe.plan import main as plan_main

    device = ["--device", "cpu"] if SMOKE else []
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            plan_main(["--gpu_memory_gib", "139", "--json", *device, *plan_argv])
        plan = json.loads(buffer.getvalue())
    except (Exception, SystemExit):
        return {}
    rows = {r["name"]: r["gib"] for r in plan["rows"]}
    step = plan["phases_gib"]["train step"]
    # the kinds torch measures: reserved = the step less the CUDA context; allocated = that less the cache's reserve
    reserved = step - rows.get("framework overhead", 0.0)
    return {"plan_gib": plan["peak_gib"], "plan_load_gib": plan["phases_gib"].get("load"),
            "plan_reserved_gib": reserved, "plan_allocated_gib": reserved - rows.get("allocator reserve", 0.0)}


def run_step(step: dict, deadline: float) -> dict:
    row = {"step": step["name"]}
    if "skip" in step:
        return {**row, "status": "skipped", "note": step["skip"]}
    left = deadline - time.time()
    if left < 20:
        return {**row, "status": "skipped", "note": "out of time"}
    row.update(predicted(step.get("plan")))
    shutil.rmtree(step["out"], ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               **step.get("env", {}))
    if SMOKE:
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    log = OUT / f"{step['name']}.log"
    start = time.time()
    try:
        proc = subprocess.run(step["cmd"], cwd=step.get("cwd", REPO), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=min(left, 240))
        output, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    log.write_text(output)
    row["seconds"] = round(time.time() - start, 1)
    if loaded := re.search(r"quantized base loaded on the CPU for FSDP in ([0-9.]+) s", output):
        row["load_seconds"] = float(loaded.group(1))  # from_pretrained + quantization, as rank 0 logged it
    # A configuration refusal exits 2 in one process; under the launcher every rank's 2 becomes the launcher's 1.
    refused = "configuration problem(s):" in output
    row["status"] = "ok" if code == 0 else ("refused" if refused else f"failed ({code})")
    if probe := re.findall(r"fused head probe: (.*)", output):  # bench/train_probing_fused_head.py
        row["fused_head"] = "; ".join(dict.fromkeys(probe))
        row["note"] = f"fused head: {row['fused_head']}"  # a failure's reasons come first, below
    if code != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        reasons = [line for line in lines if line.startswith("- ")] if refused else \
            [line for line in lines if "Error" in line and "ChildFailedError" not in line  # the launcher's echo
             and not line.startswith("File ")][-2:] or lines[-3:]
        row["note"] = " | ".join(dict.fromkeys(reasons + ([f"fused head: {row['fused_head']}"]
                                                          if "fused_head" in row else [])))[-400:]
    if step.get("expect") == "diverged":  # exit 4 on the rank (the launcher says 1), nothing saved from step 2 on
        stopped = re.search(r"training diverged at step (\d+)", output)
        saved = sorted(p.name for p in step["out"].glob("checkpoint-*"))
        row["status"] = f"ok (stopped at step {stopped.group(1)}, saved: {saved or 'nothing'})" \
            if stopped and not saved and code != 0 else f"FAILED (exit {code}, saved {saved}, no divergence message)"
    row["adapter_check"] = "pass" if "adapter check OK" in output else ("FAIL" if code == 0 else "-")
    return {**row, **read_results(step["out"])}


def read_results(out: Path) -> dict:
    """tokens/s, MFU and memory from the run record train.py wrote: `peak_memory_gib_per_rank` is taken after the
    final save (it includes the save), `peak_gpu_memory_gib` at the end of training (it does not)."""
    try:
        record = json.loads((out / "run_record.json").read_text())
    except (OSError, ValueError):
        return {}
    throughput, memory, save = record["throughput"], record["memory"], record["saves"].get("final") or {}
    return {"tokens_per_second": throughput.get("tokens_per_second"), "mfu": throughput.get("mfu"),
            "peak_after_save_gib": max(memory.get("peak_memory_gib_per_rank") or [None], key=lambda x: x or 0),
            "peak_train_gib": memory.get("peak_gpu_memory_gib"), "save_seconds": save.get("seconds"),
            "peak_reserved_gib": memory.get("peak_gpu_reserved_gib"),
            # from process start: to the end of loading (+ LoRA layers), and to the end of wrapping
            "load_gpu_gib": max(memory.get("gpu_peak_gib_after_load_per_rank") or [None], key=lambda x: x or 0),
            "wrap_gpu_gib": max(memory.get("gpu_peak_gib_after_wrap_per_rank") or [None], key=lambda x: x or 0),
            # host RAM per rank at the end of loading: anonymous RSS (the 4-bit copies live there until wrapping)
            "host_load_mib_per_rank": memory.get("rss_anon_after_load_mib_per_rank"),
            # exact checksum of the frozen (base) weights as loaded: equal across rows that quantized the same bytes
            "frozen_checksum": (record.get("weights", {}).get("checksums_before") or [None])[0]}


def quantization_contrast(rows: list[dict]) -> str | None:
    """The qlora row (each 4-bit weight quantized on this GPU) beside qlora-cpuquant (on the CPU): load seconds and
    whether the two quantized the same bytes."""
    by_name = {r["step"]: r for r in rows}
    gpu, cpu = by_name.get("qlora", {}), by_name.get("qlora-cpuquant", {})
    if gpu.get("load_seconds") is None or cpu.get("load_seconds") is None:
        return None
    same = gpu.get("frozen_checksum") is not None and gpu.get("frozen_checksum") == cpu.get("frozen_checksum")
    return (f"4-bit base quantized on the GPU vs on the CPU: load {gpu['load_seconds']:.1f} s vs "
            f"{cpu['load_seconds']:.1f} s ({cpu['load_seconds'] / max(gpu['load_seconds'], 1e-9):.1f}x faster); "
            f"packed bytes {'identical' if same else 'DIFFERENT'} (frozen-weight checksums)")


def fmt(value, pattern="{:.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def versus(row: dict, measured: str, planned: str) -> str:
    """'measured / plan (ratio plan/measured)': the figure bench/plan_vs_published.py sets beside published ones."""
    m, p = row.get(measured), row.get(planned)
    if m is None or p is None or not m:
        return "-"
    return f"{m:.2f} / {p:.2f} ({p / m:.2f}x)"


def render(rows: list[dict], header: str) -> str:
    lines = [header, "", "| step | status | tokens/s | MFU | peak GiB (train) | plan GiB | allocated / plan | "
             "reserved / plan | GPU GiB at load | through wrap | plan load | load s | host MiB at load per rank | "
             "peak GiB after save | save s | adapter check | s |", "|---" * 17 + "|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['status']} | {fmt(r.get('tokens_per_second'), '{:.0f}')} | "
                     f"{fmt(r.get('mfu'), '{:.1%}')} | {fmt(r.get('peak_train_gib'), '{:.2f}')} | "
                     f"{fmt(r.get('plan_gib'), '{:.2f}')} | {versus(r, 'peak_train_gib', 'plan_allocated_gib')} | "
                     f"{versus(r, 'peak_reserved_gib', 'plan_reserved_gib')} | "
                     f"{fmt(r.get('load_gpu_gib'), '{:.2f}')} | "
                     f"{fmt(r.get('wrap_gpu_gib'), '{:.2f}')} | {fmt(r.get('plan_load_gib'), '{:.2f}')} | "
                     f"{fmt(r.get('load_seconds'))} | "
                     f"{' / '.join(f'{x:.0f}' for x in r.get('host_load_mib_per_rank') or []) or '-'} | "
                     f"{fmt(r.get('peak_after_save_gib'), '{:.2f}')} | "
                     f"{fmt(r.get('save_seconds'), '{:.2f}')} | {r.get('adapter_check', '-')} | "
                     f"{fmt(r.get('seconds'))} |")
    lines += [f"- {r['step']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines)


def main() -> int:
    import torch

    started = time.time()
    deadline = started + BUDGET_S
    if not SMOKE and not torch.cuda.is_available():
        print("error: no CUDA GPU visible. On CPU run GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh.", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    device = "CPU smoke (tiny model, fp32)" if SMOKE else torch.cuda.get_device_name()
    import transformers

    header = (f"gpu_check on {device}: torch {torch.__version__}, transformers {transformers.__version__}, "
              f"python {sys.version.split()[0]}; logs in {OUT}")
    print(header, flush=True)
    try:  # what every step imports: one row naming it beats every step failing the same way
        import importlib

        for module in ("bitsandbytes", "datasets", "huggingface_hub.hf_api", "peft", "trl"):
            importlib.import_module(module)
    except Exception as e:
        print(render([{"step": "imports", "status": f"failed ({type(e).__name__}: {e})"}], header))
        return 1
    try:
        model, data = build_inputs()
    except Exception as e:  # nothing can run without inputs; still print the table's reason
        print(render([{"step": "build inputs", "status": f"failed ({type(e).__name__}: {e})"}], header))
        return 1
    rows = []
    for step in steps(model, data):
        rows.append(run_step(step, deadline))
        print(f"  {step['name']}: {rows[-1]['status']} ({time.time() - started:.0f} s so far)", flush=True)
    table = render(rows, header + f"; {time.time() - started:.0f} s in all")
    if contrast := quantization_contrast(rows):
        table += f"\n- {contrast}"
    print(table)
    (OUT / "gpu_check.md").write_text(table + "\n")
    (OUT / "gpu_check.json").write_text(json.dumps(rows, indent=2))
    write_plan_vs_measured(rows, model, OUT / "plan_vs_measured.csv")
    return 0


def write_plan_vs_measured(rows: list[dict], model: Path, path: Path) -> None:
    """The plan beside what torch measured, per step that trained: the GPU's own rows for
    tests/published_gpu_memory.csv (its model is the 8B-shaped config written beside it: ship it under
    sft_recipe/plan/models/ to plan those rows there)."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["step", "peak_allocated_gib", "plan_allocated_gib", "peak_reserved_gib", "plan_reserved_gib",
                         "model_config"])
        for r in rows:
            if r.get("peak_train_gib") is not None:
                writer.writerow([r["step"], r["peak_train_gib"], round(r.get("plan_allocated_gib") or 0, 3),
                                 r.get("peak_reserved_gib"), round(r.get("plan_reserved_gib") or 0, 3),
                                 "config.json"])
    if (model / "config.json").is_file():
        shutil.copyfile(model / "config.json", path.parent / "config.json")


if __name__ == "__main__":
    sys.exit(main())
