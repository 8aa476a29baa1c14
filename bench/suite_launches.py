"""Print what the test suite launched: per file, the launches and their seconds; the engine x feature cells; and,
given two logs, the cells one has that the other lacks.

    PYTEST_LAUNCH_LOG=/tmp/launches.json .venv/bin/python -m pytest -q tests     (tests/launch_budget.py writes it)
    .venv/bin/python bench/suite_launches.py /tmp/launches.json
    .venv/bin/python bench/suite_launches.py before.json after.json           (cells lost and gained)

A cell counts as kept when a launch of the other log exercises it or a superset of it (the same program, engine and
model, with every feature it has, and maybe more).

A cell is what a launch exercises: the program (train.py, a worker, a run_peft*.sh script), the engine (the
accelerate config, or a plain process), the model (its folder's name: the tiny Llama or a family), the method (LoRA,
QLoRA, DoRA, QDoRA, 8-bit) and the features that take their own code path (chat format, new tokens, answer-only loss,
modules to save, expert parameters, resume, checkpoints, a reporter, a bf16 base, packing). The data's file format
and the step count are not part of a cell: the data layer is the same on every engine (tests/unit/test_data_*.py and
tests/e2e/test_train_data_formats.py test it).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ENGINES = {"single.yaml": "one process (launcher)", "fsdp_config.yaml": "FSDP1", "fsdp2_config.yaml": "FSDP2",
           "deepspeed_config.yaml": "ZeRO-3", "multi_node_fsdp_config.yaml": "FSDP1 two machines"}
# flag -> how the cell names it when the run sets it (value shown where it matters)
FEATURES = {"--chat_template_format": "chat", "--train_new_tokens": "new-tokens",
            "--assistant_only_loss": "answer-loss",
            "--lora_modules_to_save": "modules-to-save", "--lora_target_parameters": "expert-params",
            "--resume_from_checkpoint": "resume", "--adapter_name_or_path": "adapter-start",
            "--save_strategy": "save", "--report_to": "report",
            "--torch_dtype": "dtype", "--optim": "optim", "--use_dora": "dora", "--use_4bit_quantization": "4bit",
            "--use_8bit_quantization": "8bit", "--bf16": "bf16", "--packing": "packing"}


PATHS = ("--resume_from_checkpoint", "--adapter_name_or_path")  # a folder: the cell says only that one is given


def _value(argv: list[str], flag: str) -> str | None:
    values = [b for a, b in zip(argv, argv[1:]) if a == flag]
    return values[-1] if values else None


def engine_of(argv: list[str]) -> str:
    if "--config_file" in argv:
        name = Path(_value(argv, "--config_file")).name
        return ENGINES.get(name, name) + (" x4" if _value(argv, "--num_processes") == "4" else "")
    if any(word.endswith("torchrun") for word in argv):
        return "DDP (torchrun)"
    return "one process (python)"


def program_of(argv: list[str]) -> str | None:
    """What a recipe launch runs: train.py, merge_adapter.py, a worker or bench script, a run_peft*.sh script."""
    for word in argv:
        name = Path(word).name
        if name in ("train.py", "merge_adapter.py") or name.endswith(("_worker.py", ".sh")) or (
                word.startswith("bench/") and name.endswith(".py")):
            return name
    return None


def cell_of(argv: list[str], recipe_yaml: dict | None = None) -> tuple[str, ...] | None:
    """The cell a launch exercises (program, engine, model, features), or None for a process that is not a launch
    of the recipe's code (a tool, a check). `recipe_yaml`: the values of its `--config` YAML (the log's
    "recipe_yaml"), which count where the command line does not give the flag; a list (report_to) is one feature per
    value."""
    program = program_of(argv)
    if program is None:
        return None
    model = re.sub(r"\d+$", "", Path(_value(argv, "--model_name_or_path") or "?").name)  # mktemp adds digits
    features = []
    for flag, name in FEATURES.items():
        value = _value(argv, flag)
        if value is None and (recipe_yaml or {}).get(flag.lstrip("-")) is not None:
            given = recipe_yaml[flag.lstrip("-")]
            value = ",".join(map(str, given)) if isinstance(given, list) else str(given)
        if value is None or value in ("False", "no", "none") and flag not in ("--chat_template_format",):
            continue
        for one in value.split(",") if flag == "--report_to" else [value]:
            features.append(name if one == "True" else f"{name}={one if flag not in PATHS else '*'}")
    return (program, engine_of(argv), model, *sorted(features))


def covers(cell: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """`cell` exercises what `other` does: the same program, engine and model, and every feature of `other` (a run
    that also checkpoints or reports still runs every path of one that does not)."""
    return cell[:3] == other[:3] and set(other[3:]) <= set(cell[3:])


def read(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())


def cells(records: list[dict]) -> dict[tuple, list[str]]:
    found: dict[tuple, list[str]] = defaultdict(list)
    for record in records:
        cell = cell_of(record["argv"], record.get("recipe_yaml"))
        if cell:
            found[cell].append(record["test"])
    return found


def per_file(records: list[dict]) -> list[tuple[str, int, float]]:
    rows: dict[str, list[float]] = defaultdict(list)
    for record in records:
        if record["recipe"]:
            rows[record["test"].split("::")[0]].append(record["seconds"] or 0.0)
    return sorted(((name, len(v), sum(v)) for name, v in rows.items()), key=lambda row: -row[2])


def main(argv: list[str]) -> int:
    before = read(argv[0])
    recipe = [r for r in before if r["recipe"]]
    print(f"{len(recipe)} recipe launches, {sum(r['seconds'] or 0 for r in recipe):.0f} s; "
          f"{len(cells(before))} cells (program x engine x model x features)")
    print(f"{'file':<52} {'launches':>8} {'seconds':>8}")
    for name, count, seconds in per_file(before):
        print(f"{name:<52} {count:>8} {seconds:>8.0f}")
    if len(argv) == 1:
        for cell in sorted(cells(before)):
            print("  " + " | ".join(cell))
        return 0
    after = read(argv[1])
    lost = sorted(c for c in cells(before) if not any(covers(a, c) for a in cells(after)))
    gained = sorted(c for c in cells(after) if not any(covers(b, c) for b in cells(before)))
    print(f"after: {sum(r['recipe'] for r in after)} recipe launches, {len(cells(after))} cells; "
          f"{len(lost)} cells lost, {len(gained)} gained")
    for label, rows in (("lost", lost), ("gained", gained)):
        for cell in rows:
            print(f"  {label}: " + " | ".join(cell) + f"   (before: {cells(before).get(cell, ['-'])[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
