"""One rank of bench/scale.py: the recipe's run with every phase's memory and time recorded, then both final saves.

Launched by bench/scale.py through `accelerate launch`, never by hand in normal use. Trains like train.py (the
library's model loading, RecipeSFTTrainer, a checkpoint at step 1) and records, per rank:
- load: live weight bytes read (meta tensors excluded) and anonymous RSS after `load_model`;
- wrap: anonymous RSS once FSDP/DeepSpeed has wrapped the model (on_train_begin);
- train: peak RSS of the process so far, and this rank's model state (shards + grads + optimizer);
- seconds from process start to the end of the first optimizer step;
- checkpoint: MiB on disk and what its save added; the final save (ours, sft_recipe/artifacts/gather.py) and upstream's
  (every weight gathered to rank 0 by FULL_STATE_DICT, then the adapter's keys kept and saved), each timed and with
  the anonymous RSS it added -- launched with MALLOC_MMAP_THRESHOLD_=65536 so RSS follows live tensor bytes.
`--upstream_load` loads on every rank as transformers does by itself (upstream's path), for the load columns.
Rank 0 writes the JSON file named by --out.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--upstream_load", action="store_true")
    args, train_argv = parser.parse_known_args()

    from sft_recipe.startup import freeze_imports, prepare_tool_imports

    prepare_tool_imports()  # as train.py (sft_recipe/startup.py): no cyclic collector, the models scan cached
    from sft_recipe.compat.unused_imports import skip_unused_deepspeed
    from sft_recipe.config.launch_env import may_use_deepspeed, read_launch_env

    if not may_use_deepspeed():  # as train.py keeps DeepSpeed out of a launch that is not DeepSpeed's
        skip_unused_deepspeed()
    from sft_recipe import compat

    launch = read_launch_env()
    compat.install(launch)
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    import sft_recipe.train.load_plan as load_plan
    import sft_recipe.train.model as model_module
    from sft_recipe.artifacts.adapter import save_final_adapter
    from sft_recipe.config.args import parse_args
    from sft_recipe.measure import RssWatch, live_tensor_mib, model_state_mib, peak_rss_mib, rss_kinds_mib
    from sft_recipe.train.trainer import RecipeSFTTrainer

    freeze_imports()

    if args.upstream_load:  # every rank reads the weights, as transformers 5.24 does without the recipe
        load_plan.weights_arrive_from_rank0 = lambda *a, **k: False
    model_args, _, _, training_args = parse_args(train_argv)
    tokenizer = model_module.load_tokenizer(model_args)
    model = model_module.load_model(model_args, training_args, tokenizer, launch)
    load = {"weight_mib": live_tensor_mib([*model.parameters(), *model.buffers()]), "rss_mib": rss_kinds_mib()[0]}
    texts = [f"fact {i}: the value of item {i} is {i * 7 % 13}, and item {i + 1} follows it." for i in range(64)]
    trainer = RecipeSFTTrainer(model=model, args=training_args, train_dataset=Dataset.from_dict({"text": texts}),
                               processing_class=tokenizer,
                               peft_config=model_module.lora_config(model_args, []))
    facts: dict = {}

    class Phases(TrainerCallback):
        def on_train_begin(self, *a, **k):
            facts["wrap_rss_mib"] = rss_kinds_mib()[0]

        def on_step_end(self, a, state, *rest, **k):
            if state.global_step == 1:
                facts["first_step_seconds"] = time.time() - STARTED

    trainer.add_callback(Phases())
    trainer.train()
    accelerator = trainer.accelerator
    facts["train_peak_rss_mib"] = peak_rss_mib()
    facts["model_state_mib"] = model_state_mib(trainer.model_wrapped, trainer.optimizer)
    ours_dir = Path(training_args.output_dir) / "final-ours"
    ours = save_final_adapter(trainer, str(ours_dir))  # the recipe's final save (adapter-only gather, check, write)
    peak_after_ours = peak_rss_mib()  # the run's peak with our save, before upstream's adds its own

    upstream_dir = Path(training_args.output_dir) / "final-upstream"
    accelerator.wait_for_everyone()
    with RssWatch() as watch:  # upstream: gather every weight, keep the adapter's keys, save
        full = compat.gather_full_state_dict(accelerator, trainer.model_wrapped)
        if accelerator.is_main_process:
            # With the FSDP1 name fix (compat): without it peft 0.21 writes an empty adapter here, as upstream does.
            peft_model = accelerator.unwrap_model(trainer.model)
            with compat.module_names_without_fsdp_segments(peft_model):
                peft_model.save_pretrained(str(upstream_dir), state_dict=full)
        del full
        accelerator.wait_for_everyone()
    per_rank = torch.tensor([load["weight_mib"], load["rss_mib"], facts["wrap_rss_mib"], facts["train_peak_rss_mib"],
                             facts["model_state_mib"], facts["first_step_seconds"], watch.seconds, watch.added_mib,
                             peak_after_ours], dtype=torch.float64)
    per_rank = accelerator.gather(per_rank).reshape(-1, 9) if accelerator.num_processes > 1 else per_rank[None]
    if not accelerator.is_main_process:
        return
    checkpoint = Path(training_args.output_dir) / "checkpoint-1"
    column = lambda i: [round(float(x), 1) for x in per_rank[:, i]]  # noqa: E731
    result = {
        "num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
        "load_weight_mib": column(0), "load_rss_mib": column(1), "wrap_rss_mib": column(2),
        "train_peak_rss_mib": column(3), "model_state_mib": column(4), "peak_rss_mib": column(8),
        "first_step_seconds": round(float(per_rank[:, 5].max()), 2),
        "checkpoint_mib": round(_dir_mib(checkpoint), 2) if checkpoint.is_dir() else None,
        "checkpoint_save": trainer.checkpoint_save_costs[0] if trainer.checkpoint_save_costs else None,
        "save_ours": ours, "save_upstream": {"seconds": round(float(per_rank[:, 6].max()), 3),
                                             "rss_anon_added_mib_per_rank": column(7)},
        "adapter_files_identical": (ours_dir / "adapter_model.safetensors").read_bytes()
        == (upstream_dir / "adapter_model.safetensors").read_bytes(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(training_args.output_dir, ignore_errors=True)
    os.makedirs(training_args.output_dir, exist_ok=True)


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    from sft_recipe import compat

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():  # as train.py: gloo's threads can abort a finished rank at interpreter teardown
        dist.destroy_process_group()
    compat.exit_skipping_teardown(0, world_size)
