"""Which checkpoints are complete, which one to resume from, and what a previous run left in `output_dir`.

A checkpoint folder is complete once every rank has written its shards and the main process has written the
marker file last; a run killed mid-save leaves a folder without it, which resume skips. The marker records the size
of every file and the SHA-256 of the small ones (`integrity.file_records`), and what the run was (base model,
tokenizer size, LoRA shape: `resume_match`), so that a damaged checkpoint and a resume with other settings are both
found before anything loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
LATEST = "latest"  # --resume_from_checkpoint latest: the newest complete checkpoint in output_dir
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_complete(checkpoint_dir: str | os.PathLike, global_step: int, world_size: int | None = None,
                  global_batch_size: int | None = None, run: dict | None = None) -> None:
    """Write the marker last. It also records how the run was laid out, so that a resume on another number of
    ranks can be checked before anything loads (`resume_layout_problems`); every file's size (and the small ones'
    checksums), so that damage is found before anything loads (`checkpoint_damage`); and `run`, what was trained
    (`resume_match.run_identity`), so that a resume with another base, tokenizer or LoRA shape is refused."""
    from sft_recipe.artifacts.integrity import file_records
    from sft_recipe.atomic import write_atomically

    marker = json.dumps({"global_step": global_step, "time": time.time(), "world_size": world_size,
                         "global_batch_size": global_batch_size, "run": run,
                         "files": file_records(checkpoint_dir, skip=(COMPLETE_MARKER,))})
    write_atomically(Path(checkpoint_dir) / COMPLETE_MARKER, lambda tmp: tmp.write_text(marker))


def read_marker(checkpoint_dir: str | os.PathLike) -> dict:
    """The completeness marker's content ({} where it is missing or unreadable)."""
    try:
        marker = json.loads((Path(checkpoint_dir) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def checkpoint_damage(checkpoint_dir: str | os.PathLike) -> list[str]:
    """What is wrong with a complete checkpoint's files (empty: intact), found without loading any of them: files
    missing or of another size than recorded, small files whose checksum changed, safetensors files shorter or longer
    than their header says, JSON files that do not parse. Markers of earlier versions record no files: their
    safetensors and JSON files are still checked, and trainer_state.json must be there."""
    from sft_recipe.artifacts.integrity import content_problems, json_problem, recorded_file_problems

    path = Path(checkpoint_dir)
    if (why := json_problem(path / COMPLETE_MARKER)) is not None:
        return [f"{COMPLETE_MARKER} {why}"]
    records = read_marker(path).get("files")
    if isinstance(records, dict):
        problems = recorded_file_problems(path, records)
    else:
        problems = [] if (path / "trainer_state.json").is_file() else ["trainer_state.json is missing"]
    said = {p.split(" ", 1)[0] for p in problems}
    return problems + [p for p in content_problems(path) if p.split(" ", 1)[0] not in said and
                       not p.startswith(COMPLETE_MARKER)]


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


def latest_intact_checkpoint(output_dir: str | os.PathLike) -> tuple[Path | None, list[Path], list[tuple[Path, str]]]:
    """(newest complete and intact checkpoint or None, newer incomplete ones, newer damaged ones with why)."""
    incomplete: list[Path] = []
    damaged: list[tuple[Path, str]] = []
    for path in reversed(checkpoints(output_dir)):
        if not is_complete(path):
            incomplete.append(path)
        elif problems := checkpoint_damage(path):
            damaged.append((path, "; ".join(problems)))
        else:
            return path, incomplete, damaged
    return None, incomplete, damaged


def intact_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete, intact checkpoints, newest first."""
    return [p for p in reversed(checkpoints(output_dir)) if is_complete(p) and not checkpoint_damage(p)]


def previous_results(output_dir: str | os.PathLike) -> list[str]:
    """What a previous run left that a new run would overwrite or mix with."""
    root = Path(output_dir)
    found = [name for name in ("adapter_model.safetensors", "model.safetensors", "run_record.json", "run_facts.json")
             if (root / name).exists()]
    return found + [p.name for p in checkpoints(root)]


def move_previous_run_aside(output_dir: str | os.PathLike) -> Path | None:
    """--overwrite_output_dir: keep the previous run's checkpoints in output_dir/_previous-run-<time>/, so a new run's
    checkpoints are not mixed with older, higher-numbered ones (nothing is deleted)."""
    old = checkpoints(output_dir) + [p for p in (Path(output_dir) / "preempted.json",) if p.exists()]
    return _move_aside(output_dir, "_previous-run", old) if old else None


def _move_aside(output_dir: str | os.PathLike, prefix: str, paths: list[Path]) -> Path:
    """Move `paths` into output_dir/<prefix>-<time>/ (nothing is deleted); returns that folder."""
    aside = Path(output_dir) / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.move(str(path), str(aside / path.name))
    return aside


def move_damaged_aside(output_dir: str | os.PathLike, resume_from: str | None, main: bool = True) -> Path | None:
    """Before a resume: move complete-but-damaged checkpoints newer than the one resumed from to
    output_dir/_damaged-<time>/, where the resumed run would otherwise write its own checkpoint over them (nothing is
    deleted; the files may still be worth copying back). The main process moves; the others leave it alone."""
    if not resume_from or not main:
        return None
    match = _CHECKPOINT.match(Path(resume_from).name)
    step = int(match.group(1)) if match else None
    newer = [p for p in checkpoints(output_dir) if step is not None and int(p.name.split("-")[1]) > step
             and is_complete(p) and checkpoint_damage(p)]
    if not newer:
        return None
    aside = _move_aside(output_dir, "_damaged", newer)
    logger.warning(f"moved the damaged {', '.join(p.name for p in newer)} to {aside} (nothing is deleted): the "
                   "resumed run writes its own checkpoints at those steps.")
    return aside


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str) -> tuple[str | None, list[str]]:
    """(checkpoint path to resume from or None, problems). Accepts a path or `latest` (the newest complete checkpoint
    whose files are intact; damaged ones are skipped, with a warning saying which and why, and left as they are)."""
    if not resume_from_checkpoint:
        return None, []
    if resume_from_checkpoint in (LATEST, "True", "true"):
        path, incomplete, damaged = latest_intact_checkpoint(output_dir)
        if path is None:
            where = f" ({len(incomplete)} incomplete ones skipped)" if incomplete else ""
            if not damaged:
                return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: no complete checkpoint in "
                              f"{output_dir}{where}. Fix: drop the flag to start fresh, or name a checkpoint folder."]
            return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: no intact checkpoint in {output_dir}"
                          f"{where}; damaged: {_damage_list(damaged)}. Fix: copy the damaged files back if you "
                          "have them, or start afresh with --overwrite_output_dir True (the checkpoints move to "
                          f"{output_dir}/_previous-run-<time>/; nothing is deleted) or another --output_dir."]
        if damaged:
            _warn_once(f"--resume_from_checkpoint {resume_from_checkpoint}: resuming from {path}, the newest intact "
                       f"checkpoint; skipped as damaged: {_damage_list(damaged)}.")
        return str(path), _unsafe(path)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: no such checkpoint folder. Fix: a "
                      "checkpoint-N folder of this run, or `latest`."]
    if not is_complete(path):
        return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: incomplete checkpoint (no "
                      f"{COMPLETE_MARKER}; the run was probably stopped while saving it). Fix: resume from an "
                      "earlier checkpoint, or `--resume_from_checkpoint latest` to pick the newest complete one."]
    if damage := checkpoint_damage(path):
        intact = intact_checkpoints(path.parent)
        fix = (f"Fix: --resume_from_checkpoint {intact[0]} (intact here: {', '.join(p.name for p in intact)}), "
               "or `latest` to take the newest intact one." if intact else
               "Fix: no intact checkpoint is left beside it: copy the damaged files back if you have them, or start "
               "afresh with --overwrite_output_dir True (checkpoints move aside; nothing is deleted).")
        return None, [f"--resume_from_checkpoint {resume_from_checkpoint}: damaged: {'; '.join(damage)}. {fix}"]
    return str(path), _unsafe(path)


def _damage_list(damaged: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path.name} ({why})" for path, why in damaged)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """validate and main both resolve the resume: say a skip once."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


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
    marker = read_marker(checkpoint_dir)
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
