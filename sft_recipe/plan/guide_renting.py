"""The renting answers for the guide's two runs (`python -m sft_recipe.plan --guide` prints them): the LoRA run's
memory per GPU and fewest 80 GiB GPUs with the recipe's bf16 base and upstream's fp32 one, and the QLoRA run's
longest --max_seq_len on 2 x 24 GiB (renting.py answers; this module asks it about the guide's runs)."""

from __future__ import annotations

from typing import Any

from sft_recipe.plan.guide import GUIDE_RUNS, recipe_flags
from sft_recipe.plan.inputs import parse_train_flags
from sft_recipe.plan.planner import plan_memory
from sft_recipe.plan.renting import Run, fewest_gpus, longest_seq_len
from sft_recipe.plan.result import GIB, MemoryPlan

# The guide's runs as their shipped files launch them (tests/unit/test_plan_guide.py holds GUIDE_RUNS equal to them).
GUIDE_LAUNCH = {"lora-8x80": ("configs/fsdp_config.yaml", "recipes/llama2_70b_lora.yaml"),
                "qlora-2x24-offload": ("configs/fsdp_config_qlora.yaml", "recipes/llama2_70b_qlora.yaml")}


def guide_run(key: str, extra: tuple[str, ...] = ()) -> Run:
    """One of the guide's runs (guide.GUIDE_RUNS) as a Run whose commands name its shipped recipe and YAML."""
    config_file, recipe = GUIDE_LAUNCH[key]
    spec = GUIDE_RUNS[key]
    model_args, data_args, _, training_args = parse_train_flags(recipe_flags(spec.recipe) + list(extra), "cuda")
    return Run(model_args, data_args, training_args, ["--config", recipe, *extra], config_file,
               spec.accelerate_config)


def guide_renting(lora_dtypes: tuple[str, ...] = ("", "float32")) -> dict[str, Any]:
    """The renting answers for the guide's two runs. LoRA, its base loaded as the recipe does ("": bf16 under
    --bf16 True) and as upstream does ("float32"): the plan on the guide's 8 GPUs of 80 GiB (per GPU; host RAM at
    load = runtime + loading) and the fewest 80 GiB GPUs on FSDP1 without and with CPU offload. QLoRA (the guide's
    2 x 24 GiB with CPU offload): the longest --max_seq_len, checkpointing on/off x activation offloading off/on."""
    out: dict[str, Any] = {}
    for dtype in lora_dtypes:
        run = guide_run("lora-8x80", ("--torch_dtype", dtype) if dtype else ())
        on8 = plan_memory(run.model_args, run.data_args, run.training_args, run.accelerate_config, None, 80.0,
                          "cuda", ladder=False, shape=run.shape)
        out[f"lora-8x80{'-' + dtype if dtype else ''}"] = {
            "run": run, "on_8": on8, "fewest": fewest_gpus(run, 80.0, engines=("fsdp1",))}
    out["qlora-2x24-offload"] = longest_seq_len(guide_run("qlora-2x24-offload"), 24.0)
    return out


def host_at_load_gib(plan: MemoryPlan) -> float:
    rows = {r.name: r.bytes for r in plan.host_rows}
    return (rows.get("runtime", 0.0) + rows.get("loading", 0.0)) / GIB


def render_guide_renting(answers: dict[str, Any] | None = None) -> list[str]:
    """The guide's renting lines for `--guide` (the CLI prints them after guide.render_guide_comparison)."""
    answers = answers or guide_renting()
    lines = ["  renting (--fewest_gpus, FSDP1 FULL_SHARD as configs/fsdp_config.yaml; --longest_seq_len):"]
    for key, item in answers.items():
        if not key.startswith("lora"):
            continue
        dtype = "fp32 base, as upstream loads it" if key.endswith("float32") else "bf16 base, this recipe's default"
        on8, (plain, off) = item["on_8"], item["fewest"]
        lines.append(f"    {key:<20}({dtype}): {on8.peak_gib:.1f} GiB/GPU on 8x80, host RAM at load "
                     f"{host_at_load_gib(on8):.0f} GiB; fewest 80 GiB GPUs: {plain.num_processes} "
                     f"({plain.plan.peak_gib:.1f} GiB each), {off.num_processes} with CPU offload "
                     f"({off.plan.peak_gib:.1f} GiB, host {off.plan.host_peak_bytes / GIB:.0f} GiB)")
        lines.append(f"      {plain.command}")
    cells = [f"{a.seq_len if a.fits else 'none'} (checkpointing {'on' if a.checkpointing else 'off'}"
             f"{', activation offloading under FSDP2' if a.activation_offloading else ''}; host "
             f"{a.plan.host_peak_bytes / GIB:.0f} GiB)" for a in answers["qlora-2x24-offload"] if a.plan]
    lines.append("    qlora-2x24-offload: longest --max_seq_len on 2x24 GiB: " + ", ".join(cells))
    best = answers["qlora-2x24-offload"][0]
    lines.append(f"      {best.command}")
    return lines
