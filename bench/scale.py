"""How every cost grows with the model: ours vs upstream's path, side by side in one run, and the slopes.

    .venv/bin/python bench/scale.py                # 3 sizes x {one process, FSDP1, FSDP2} x {LoRA, QLoRA} (~25 min)
    .venv/bin/python bench/scale.py --smoke        # two tiny sizes, LoRA, FSDP2 (the test suite's run, ~35 s)

Each setup is one real `accelerate launch` of bench/scale_worker.py (2 CPU ranks over gloo; 4 ranks for the middle
size), fp32 (QLoRA: NF4, fp32 compute; bf16 storage under FSDP1, which refuses fp32 storage), 2 steps of a 64-token
micro-batch with a checkpoint at step 1, launched with MALLOC_MMAP_THRESHOLD_=65536 so anonymous RSS follows live
tensor bytes. Per rank it reports memory at load (live weight bytes and RSS), wrap and train, the checkpoint size,
seconds to the first optimizer step, and both final saves: ours (only the adapter's tensors gathered) and upstream's
(`trainer.save_model()` after FULL_STATE_DICT: every weight gathered onto rank 0, then the adapter kept). FSDP2 LoRA
also runs upstream's load (every rank reads the weights) for the load column. The table ends with each figure's
slope against the model's MiB (least squares over the sizes): flat is what a 70B run needs.

What CPU measurements cannot separate: device memory *is* host memory here, so "rank 0 RAM added by the save" is
the GPU's device memory and the host's at once; RSS after load includes ~480 MiB of imports; glibc arenas keep small
freed blocks (the mmap threshold makes tensors above 64 KiB visible). Live weight bytes at load are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
WORKER = REPO / "bench" / "scale_worker.py"
FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "2", "--per_device_train_batch_size", "1",
         "--max_seq_len", "64", "--packing", "True", "--learning_rate", "1e-3", "--logging_steps", "1",
         "--report_to", "none", "--save_strategy", "steps", "--save_steps", "1", "--eval_strategy", "no",
         "--seed", "7", "--dataset_text_field", "text", "--chat_template_format", "none", "--bf16", "False"]
QLORA = {"fp32": ["--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "float32",
                  "--bnb_4bit_compute_dtype", "float32"],
         "bf16": ["--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16",
                  "--bnb_4bit_compute_dtype", "float32", "--bf16", "True"]}
ENGINES = {"single": "cpu/single.yaml", "fsdp1": "cpu/fsdp_config.yaml", "fsdp2": "cpu/fsdp2_config.yaml"}
SIZES = {"full": [(768, 8), (1536, 8), (2048, 12)], "smoke": [(256, 2), (512, 2)]}


def launch(config: str, model_dir: Path, method: str, engine: str, ranks: int, out: Path, upstream_load=False):
    extra = QLORA["bf16" if engine == "fsdp1" else "fp32"] if method == "qlora" else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    cmd = [ACCELERATE, "launch", "--config_file", str(REPO / "configs" / config), "--num_processes", str(ranks),
           "--main_process_port", str(_free_port()), str(WORKER), "--out", str(out),
           *(["--upstream_load"] if upstream_load else []), "--model_name_or_path", str(model_dir),
           "--output_dir", str(out.with_suffix("")), *FLAGS, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out.is_file():
        print(proc.stdout[-3000:], file=sys.stderr)
        raise SystemExit(f"{engine} {method} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_models(root: Path, sizes) -> list[tuple[str, Path, float, int]]:
    from sft_recipe.tiny import build_bench_model, build_tiny

    tiny = REPO / ".tiny"
    build_tiny(tiny)
    models = []
    for hidden, layers in sizes:
        path = build_bench_model(root, tiny, hidden_size=hidden, num_hidden_layers=layers)
        mib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        models.append((f"{hidden}x{layers}", path, mib, int(mib * 2**20 / 4)))
    return models


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def plan_predictions(model_dir: Path, engine: str, method: str, ranks: int) -> dict:
    """The memory plan's CPU predictions: weights loaded per rank, the final save's added bytes on rank 0 (an upper
    bound: 2 x adapter), and each rank's peak RSS (`plan_memory(..., device="cpu")`)."""
    from sft_recipe.plan import (
        _base_weight_bytes,
        adapter_bytes,
        model_shape,
        parse_train_flags,
        plan_memory,
        read_accelerate_config,
        workload,
    )

    extra = QLORA["bf16" if engine == "fsdp1" else "fp32"] if method == "qlora" else []
    argv = ["--model_name_or_path", str(model_dir), *FLAGS, *extra]
    model_args, data_args, _, training_args = parse_train_flags(argv, "cpu")
    shape = model_shape(str(model_dir))
    w = workload(model_args, data_args, training_args, "cpu")
    efficient = engine == "fsdp2" and method == "lora"  # the FSDP2 CPU config loads on rank 0 only; FSDP1 cannot
    shardable, replicated, _ = _base_weight_bytes(shape, w)
    weights = (shardable + replicated) / 2**20
    plan = plan_memory(model_args, data_args, training_args, dict(read_accelerate_config(REPO / "configs" /
                                                                                          ENGINES[engine])),
                       ranks, 1000.0, "cpu", ladder=False)
    return {"load_weight_mib": [weights] + [0.0 if efficient else weights] * (ranks - 1),
            "save_added_mib": 2 * adapter_bytes(shape, w)[0] / 2**20,
            "peak_rss_mib": [b / 2**20 for b in plan.per_rank_bytes]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="two tiny sizes, LoRA, FSDP2 only")
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    args = parser.parse_args(argv)
    # The plan parses the same flags as the runs, bf16 included (QLoRA under FSDP1): the CPU switch allows it.
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    sizes = SIZES["smoke" if args.smoke else "full"]
    engines = ["fsdp2"] if args.smoke else list(ENGINES)
    methods = ["lora"] if args.smoke else ["lora", "qlora"]
    results = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        root = Path(tmp)
        models = build_models(root, sizes)
        for index, (size, model_dir, model_mib, _) in enumerate(models):
            for engine in engines:
                for method in methods:
                    ranks_list = [1] if engine == "single" else [2] + ([4] if index == 1 and not args.smoke
                                                                       and method == "lora" else [])
                    for ranks in ranks_list:
                        out = root / f"{size}-{engine}-{method}-{ranks}.json"
                        run = launch(ENGINES[engine], model_dir, method, engine, ranks, out)
                        # upstream's load beside ours (the smoke: at the first size only, the path still run)
                        if engine == "fsdp2" and method == "lora" and (index == 0 or not args.smoke):
                            up = launch(ENGINES[engine], model_dir, method, engine, ranks,
                                        out.with_name(out.stem + "-upload.json"), upstream_load=True)
                            run["upstream_load_weight_mib"] = up["load_weight_mib"]
                        run.update(size=size, model_mib=model_mib, engine=engine, method=method, ranks=ranks,
                                   plan=plan_predictions(model_dir, engine, method, ranks))
                        results.append(run)
                        print(f"done: {size} {engine} {method} x{ranks}", file=sys.stderr, flush=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def print_table(results: list[dict]) -> None:
    print("| model | MiB | engine | ranks | load weights MiB/rank (upstream) [plan] | wrap RSS | "
          "peak RSS/rank [plan] | "
          "ckpt MiB | 1st step s | save s ours / upstream | save +MiB rank 0 ours / upstream (ratio) [plan bound] | "
          "identical |")
    print("|---" * 12 + "|")
    for r in results:
        ours, up = r["save_ours"], r["save_upstream"]
        added_ours, added_up = ours["rss_anon_added_mib_per_rank"][0], up["rss_anon_added_mib_per_rank"][0]
        load = "/".join(f"{x:.0f}" for x in r["load_weight_mib"])
        if "upstream_load_weight_mib" in r:
            load += " (" + "/".join(f"{x:.0f}" for x in r["upstream_load_weight_mib"]) + ")"
        load += " [" + "/".join(f"{x:.0f}" for x in r["plan"]["load_weight_mib"]) + "]"
        print(f"| {r['size']} {r['method']} | {r['model_mib']:.0f} | {r['engine']} | {r['ranks']} | {load} | "
              f"{'/'.join(f'{x:.0f}' for x in r['wrap_rss_mib'])} | "
              f"{'/'.join(f'{x:.0f}' for x in r['peak_rss_mib'])} "
              f"[{'/'.join(f'{x:.0f}' for x in r['plan']['peak_rss_mib'])}] | {r['checkpoint_mib']} | "
              f"{r['first_step_seconds']} | {ours['seconds']:.2f} / {up['seconds']:.2f} | "
              f"{added_ours:.1f} / {added_up:.1f} ({ratio(added_ours, added_up)}) "
              f"[{r['plan']['save_added_mib']:.1f}] | "
              f"{'yes' if r['adapter_files_identical'] else 'NO'} |")
    errors = [abs(p - m) / m for r in results for p, m in zip(r["plan"]["peak_rss_mib"], r["peak_rss_mib"])]
    worst = max(errors) if errors else 0.0
    print(f"\nPlan vs measured peak RSS per rank: worst {worst:.0%}, median {sorted(errors)[len(errors) // 2]:.0%} "
          f"over {len(errors)} ranks ({'within' if worst <= 0.15 else 'NOT within'} 15%); load weights: exact where "
          "the plan's column matches.")
    print("\nSlope against model MiB (least squares over the sizes; 0 = flat, 1 = one model copy per model byte):")
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["engine"], r["method"], r["ranks"]), []).append(r)
    print("| engine | method | ranks | save +MiB ours | save +MiB upstream | save s/GiB ours | save s/GiB upstream | "
          "ckpt MiB | load MiB on the last rank ours | upstream |")
    print("|---" * 10 + "|")
    for (engine, method, ranks), rows in groups.items():
        if len(rows) < 2:
            continue
        xs = [r["model_mib"] for r in rows]

        def fit(values, xs=xs):
            return slope(xs, values)

        ours_mem = fit([r["save_ours"]["rss_anon_added_mib_per_rank"][0] for r in rows])
        up_mem = fit([r["save_upstream"]["rss_anon_added_mib_per_rank"][0] for r in rows])
        ours_s = fit([r["save_ours"]["seconds"] for r in rows]) * 1024
        up_s = fit([r["save_upstream"]["seconds"] for r in rows]) * 1024
        ckpt = fit([r["checkpoint_mib"] or 0.0 for r in rows])
        rank1 = fit([r["load_weight_mib"][-1] for r in rows])
        up_rank1 = fit([r.get("upstream_load_weight_mib", r["load_weight_mib"])[-1] for r in rows])
        print(f"| {engine} | {method} | {ranks} | {ours_mem:.3f} | {up_mem:.3f} | {ours_s:.3f} | {up_s:.3f} | "
              f"{ckpt:.4f} | {rank1:.3f} | {up_rank1:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
