"""Which checkpoints are complete, which one to resume from, and what a previous run left in `output_dir`.

A checkpoint folder is complete once every rank has written its shards and the main process has written the
marker file last; a run killed mid-save leaves a folder without it, which resume skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

COMPLETE_MARKER = "checkpoint_complete.json"
LATEST = "latest"  # --resume_from_checkpoint latest: the newest complete checkpoint in output_dir
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_complete(checkpoint_dir: str | os.PathLike, global_step: int, world_size: int | None = None,
                  global_batch_size: int | None = None) -> None:
    """Write the marker last. It also records how the run was laid out, so that a resume on another number of
    ranks can be checked before anything loads (`resume_layout_problems`)."""
    from sft_recipe.artifacts.state_io import write_atomically

    marker = json.dumps({"global_step": global_step, "time": time.time(), "world_size": world_size,
                         "global_batch_size": global_batch_size})
    write_atomically(Path(checkpoint_dir) / COMPLETE_MARKER, lambda tmp: tmp.write_text(marker))


def is_complete(checkpoint_dir: str | os.PathLike) -> bool:
    return (Path(checkpoint_dir) / COMPLETE_MARKER).is_file()


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """checkpoint-N folders, oldest step first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> tuple[Path | None, list[Path]]:
    """(newest complete checkpoint or None, newer incomplete ones that were skipped)."""
    skipped: list[Path] = []
    for path in reversed(checkpoints(output_dir)):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def previous_results(output_dir: str | os.PathLike) -> list[str]:
    """What a previous run left that a new run would overwrite or mix with."""
    root = Path(output_dir)
    found = [name for name in ("adapter_model.safetensors", "model.safetensors", "run_record.json", "run_facts.json")
             if (root / name).exists()]
    return found + [p.name for p in checkpoints(root)]


def move_previous_run_aside(output_dir: str | os.PathLike) -> Path | None:
    """--overwrite_output_dir: keep the previous run's checkpoints in output_dir/previous-run-<time>/, so a new run's
    checkpoints are not mixed with older, higher-numbered ones (nothing is deleted)."""
    old = checkpoints(output_dir) + [p for p in (Path(output_dir) / "preempted.json",) if p.exists()]
    if not old:
        return None
    aside = Path(output_dir) / time.strftime("previous-run-%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in old:
        shutil.move(str(path), str(aside / path.name))
    return aside


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str) -> tuple[str | None, list[str]]:
    """(checkpoint path to resume from or None, problems). Accepts a path or `latest`."""
    if not resume_from_checkpoint:
        return None, []
    if resume_from_checkpoint in (LATEST, "True", "true"):
        path, skipped = latest_complete_checkpoint(output_dir)
        if path is None:
            where = f" ({len(skipped)} incomplete ones skipped)" if skipped else ""
            return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: no complete checkpoint in "
                          f"{output_dir}{where}. Fix: drop the flag to start fresh, or name a checkpoint folder."]
        return str(path), _unsafe(path)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: no such checkpoint folder. Fix: a "
                      "checkpoint-N folder of this run, or `latest`."]
    if not is_complete(path):
        return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: incomplete checkpoint (no "
                      f"{COMPLETE_MARKER}; the run was probably stopped while saving it). Fix: resume from an "
                      "earlier checkpoint, or `--resume_from_checkpoint latest` to pick the newest complete one."]
    return str(path), _unsafe(path)


def _unsafe(checkpoint: Path) -> list[str]:
    from sft_recipe.artifacts.state_io import unsafe_dcp_metadata

    problems = unsafe_dcp_metadata(checkpoint)
    if not problems:
        return []
    return [f"--resume_from_checkpoint {checkpoint}: its sharded-checkpoint index holds more than checkpoint "
            f"metadata and torch would unpickle it (code could run): {'; '.join(problems)}. Fix: resume only from "
            "checkpoints written by this recipe, or start fresh."]


def checkpoint_layout(checkpoint_dir: str | os.PathLike) -> dict:
    """The marker's world_size and global_batch_size (absent in checkpoints of earlier versions)."""
    try:
        marker = json.loads((Path(checkpoint_dir) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return {k: marker[k] for k in ("world_size", "global_batch_size") if marker.get(k)}


def resume_layout_problems(checkpoint: str | None, per_device_batch_size: int, accumulation: int,
                           world_size: int) -> list[str]:
    """A resume on another number of ranks continues exactly (weights and optimizer reshard, data order and LR
    schedule follow the optimizer step) only when the global batch is the one the checkpoint was trained with."""
    layout = checkpoint_layout(checkpoint) if checkpoint else {}
    saved = layout.get("global_batch_size")
    now = per_device_batch_size * accumulation * world_size
    if not saved or saved == now:
        return []
    fix = ""
    if saved % (per_device_batch_size * world_size) == 0:
        accumulation = saved // (per_device_batch_size * world_size)
        fix = f" Fix: --gradient_accumulation_steps {accumulation} on {world_size} ranks"
    elif saved % world_size == 0:
        fix = f" Fix: a per-rank batch x accumulation of {saved // world_size} on {world_size} ranks"
    else:
        fix = " Fix: a number of ranks that divides it"
    return [f"--resume_from_checkpoint {checkpoint}: trained with a global batch of {saved} sequences "
            f"({layout.get('world_size')} ranks); this launch gives {now} ({world_size} ranks x "
            f"{per_device_batch_size} x accumulation {accumulation}), so the data order and the learning-rate "
            f"schedule would not continue.{fix}, or start a new run."]
