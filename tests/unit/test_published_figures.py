"""The published GPU figures the memory plan is set against (tests/published_gpu_memory.csv, printed beside the plan
by bench/plan_vs_published.py): every row names its source, the configuration as published and what kind of figure
it is; the guide's rows are the figures the planner's --guide prints; each model's architecture ships with the
planner, with the parameter count its model card gives."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from sft_recipe.plan.guide import PUBLISHED
from sft_recipe.plan.shape import KNOWN_MODEL_CONFIGS, MODELS_DIR

TABLE = Path(__file__).resolve().parents[1] / "published_gpu_memory.csv"
KINDS = {"nvidia-smi", "peak reserved", "peak allocated"}
SOURCES = {"peft-fsdp-guide", "peft-deepspeed-guide", "answerai-benchmarks"}
PARAMETERS = {"llama-2-7b": 6_738_415_616, "mistral-7b-v0.2": 7_241_732_096, "yi-34b": 34_388_917_248,
              "llama-2-70b": 68_976_648_192}


def _rows() -> list[dict]:
    with open(TABLE, newline="") as f:
        return list(csv.DictReader(f))


def test_every_figure_names_its_source_configuration_and_kind():
    rows = _rows()
    assert {r["source"] for r in rows} == SOURCES
    for row in rows:
        assert row["kind"] in KINDS and row["unit"] in ("GB", "GiB"), row["run"]
        assert all(float(x) > 0 for x in row["figure"].split("-")), row["run"]
        assert row["method"] in ("lora", "qlora") and row["cpu_offload"] in ("yes", "no"), row["run"]
        assert int(row["gpus"]) >= 1 and int(row["batch"]) >= 1 and int(row["seq_len"]) >= 512, row["run"]
        assert row["engine"] in ("fsdp1-full-shard", "fsdp1-no-shard", "deepspeed-zero3"), row["run"]
    assert len({r["run"] for r in rows}) == len(rows)
    assert sum(r["source"] == "answerai-benchmarks" for r in rows) == 19  # every memory row of benchmarks_03_2024
    assert sum(r["source"] == "peft-deepspeed-guide" for r in rows) == 2


def test_the_guides_rows_are_the_figures_the_planner_prints():
    guide = {r["run"]: r for r in _rows() if r["source"] == "peft-fsdp-guide"}
    assert set(guide) == set(PUBLISHED)
    for run, published in PUBLISHED.items():
        low, high = published["gpu_gib"]
        assert guide[run]["figure"] == (f"{low:g}" if low == high else f"{low:g}-{high:g}")


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_each_shipped_architecture_has_its_model_cards_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(MODELS_DIR / name)))
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]


def test_every_model_the_table_names_ships_with_the_planner():
    for row in _rows():
        path = KNOWN_MODEL_CONFIGS.get(row["model"], Path(row["model"]))
        assert (path / "config.json").is_file() or (Path(__file__).resolve().parents[2] / path / "config.json"
                                                    ).is_file(), row["model"]
