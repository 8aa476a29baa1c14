"""Will what the run writes fit on its disk? Estimated from the model config (meta device) before any weight loads.

A checkpoint holds the trainable tensors (LoRA/DoRA in fp32, `--lora_modules_to_save` copies, trainable-token rows;
the memory planner counts them: sft_recipe/plan), the optimizer state (Adam: two moments each), the learning-rate
schedule, one RNG state per rank, the trainer state and the completeness marker; one process or DDP also saves the
adapter folder as `save_pretrained` writes it (with the tokenizer files), FSDP the same tensors split across the ranks'
distributed-checkpoint shards. The run keeps `--save_total_limit` of them (all it makes when unset) and ends with the
final adapter. Every file is rounded up to the filesystem's block, as the free space is counted.

`disk_space_problems` (called by `validate`) refuses a run whose first save cannot fit -- it would fail only after
training that far -- and warns, with the numbers and a `--save_total_limit` that fits, when the later ones cannot.
The per-file constants below were measured on this stack (torch 2.13, safetensors 0.6, transformers 5.24, peft 0.21)
from real checkpoints of the tiny model; tests/unit/test_disk_space.py and tests/e2e/test_disk_full.py compare the
estimate with real checkpoints, one process and FSDP2.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from sft_recipe.artifacts.checkpoints import checkpoints, resolve_resume
from sft_recipe.artifacts.disk_full import free_bytes
from sft_recipe.errors import check_not_run

logger = logging.getLogger(__name__)

SAFETENSORS_HEADER_BYTES_PER_TENSOR = 128  # JSON header entry: name, dtype, shape, offsets (adapter keys ~60 chars)
OPTIMIZER_HEADER_BYTES_PER_TENSOR = 80  # state.<i>.exp_avg ...: shorter names
OPTIMIZER_GROUPS_BYTES = 1024  # param_groups + scalars as JSON metadata
DCP_BYTES_PER_ITEM = 1580  # torch.save framing of one tensor (shard) inside a .distcp file
DCP_BYTES_PER_OBJECT = 1261  # one non-tensor entry (lr, betas, ...) of the optimizer's param_groups
DCP_METADATA_BYTES_PER_ITEM = 340  # the .metadata index: one entry per item written
DCP_OPTIMIZER_GROUP_ENTRIES = 26  # 2 param groups (decay / no decay) x 13 entries
# DeepSpeed (ZeRO-3 over gloo, tiny model; not measured at scale, so a lower bound there): zero_to_fp32.py,
# zero_to_torch.py, `latest`, scheduler.pt; per rank the optimizer partition's pickle framing and its model states.
DEEPSPEED_FILE_BYTES = (38580, 2490, 12, 1401)
DEEPSPEED_BYTES_PER_RANK = 4096
DEEPSPEED_MODEL_STATES_BYTES = 30000
RNG_STATE_BYTES = 15448  # python + numpy + torch CPU generator states, one file per rank
CUDA_RNG_STATE_BYTES = 160  # per visible GPU in that file
ADAPTER_CARD_BYTES = (1600, 5200)  # adapter_config.json, README.md (PEFT's model card)
GENERATION_CONFIG_BYTES = 300  # generation_config.json, in checkpoints and the final adapter
SCHEDULER_BYTES = 256
TRAINER_STATE_BYTES = 800
TRAINER_STATE_BYTES_PER_LOG = 380  # one log_history entry (loss, grad_norm, learning_rate, tokens, ...)
MARKER_BYTES = 1300  # checkpoint_complete.json: step, layout, run identity
MARKER_BYTES_PER_FILE = 64  # + one size/checksum record per file
RECORD_BYTES = (1200, 9500, 29000)  # data_report.json, run_record.json, loss_curve.png
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "merges.txt", "vocab.json", "vocab.txt",
                   "tokenizer.model", "tekken.json")


@dataclass(frozen=True)
class WriteEstimate:
    """What a run writes into output_dir, in bytes on disk (each file rounded up to `block_bytes`)."""

    first_checkpoint_bytes: int
    checkpoint_bytes: int  # the largest: the last one (its log history is the longest)
    checkpoints: int | None  # checkpoints this run makes (None: known only once the data is read)
    save_total_limit: int | None
    existing_checkpoints: int  # checkpoint folders already there (a resume): rotation counts them
    adapter_bytes: int  # the final adapter folder and the run's records
    block_bytes: int
    holds: str  # what one checkpoint holds, for the messages

    def peak_bytes(self, limit: int | None = -1) -> int | None:
        """Most bytes on disk beyond what is there now, with `limit` (-1: this run's --save_total_limit)."""
        limit = self.save_total_limit if limit == -1 else limit
        if self.checkpoints is None:
            return None
        new, on_disk, peak = 0, self.existing_checkpoints, 0
        for _ in range(self.checkpoints):
            new, on_disk = new + self.checkpoint_bytes, on_disk + 1
            peak = max(peak, new)
            if limit and on_disk > limit:  # rotated once the new one is marked complete (trainer.py)
                new, on_disk = new - (on_disk - limit) * self.checkpoint_bytes, limit
                break  # from here every save adds one and removes one: the same peak each time
        return max(peak, new + self.adapter_bytes)

    def limit_that_fits(self, free: int) -> int | None:
        """The largest --save_total_limit whose peak fits in `free` bytes (None: none does). The peak grows with the
        limit, so a bisection finds it."""
        if self.checkpoints is None or self.checkpoints <= 1:
            return None
        low, high = 0, self.checkpoints - 1  # a limit of `checkpoints` or more rotates nothing
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if (self.peak_bytes(mid) or 0) <= free else (low, mid - 1)
        return low or None


def _on_disk(sizes: list[float], block: int) -> int:
    return sum(math.ceil(max(size, 1) / block) * block for size in sizes)


def _strategy(t) -> str:
    return str(t.save_strategy).split(".")[-1].lower()


def _every(steps: float, max_steps: int) -> int | None:
    """transformers' rule: a value below 1 is a fraction of max_steps."""
    if steps >= 1:
        return int(steps)
    return math.ceil(max_steps * steps) if max_steps > 0 and steps > 0 else None


def save_steps(t, resumed_step: int = 0, resumed_epoch: float = 0.0) -> list[int] | None:
    """The global steps this run saves a checkpoint at ([] for none; None where only the data says: epochs of
    unknown length, or --save_strategy best). Steps: every save_steps and the last step; epochs: each epoch end."""
    strategy = _strategy(t)
    if strategy == "no":
        return []
    if strategy == "steps" and t.max_steps > 0 and (every := _every(t.save_steps, t.max_steps)):
        if t.max_steps // every > 100_000:
            return None  # too many to list; counted as unknown
        steps = list(range(every, t.max_steps + 1, every))
        steps += [t.max_steps] if t.max_steps % every else []
        return [s for s in steps if s > resumed_step]
    if strategy == "epoch" and t.max_steps <= 0:
        return [-(e + 1) for e in range(int(resumed_epoch), math.ceil(t.num_train_epochs))]  # -epoch: unknown step
    return None


def tokenizer_file_bytes(model_name_or_path: str) -> list[int]:
    """Sizes of the tokenizer files a save copies (from the local folder, or the Hub cache; [] where unknown)."""
    folder = Path(model_name_or_path)
    if folder.is_dir():
        return [p.stat().st_size for p in sorted(folder.iterdir()) if p.name in TOKENIZER_NAMES]
    try:
        from huggingface_hub import try_to_load_from_cache

        found = [try_to_load_from_cache(model_name_or_path, name) for name in TOKENIZER_NAMES]
        return [os.path.getsize(p) for p in found if isinstance(p, str)]
    except (OSError, ValueError):  # no cache, an invalid repo id (HFValidationError): the estimate goes without them
        return []


def _resume_point(t) -> tuple[int, float]:
    path = resolve_resume(t.resume_from_checkpoint, t.output_dir)[0]
    if not path:
        return 0, 0.0
    try:
        state = json.loads((Path(path) / "trainer_state.json").read_text())
        return int(state.get("global_step", 0)), float(state.get("epoch", 0.0))
    except (OSError, ValueError):
        return int(Path(path).name.split("-")[-1]), 0.0


def _trainable(m, d, t):
    """(the planner's Workload, trainable parameters, their bytes, their tensors, Adam state bytes, the adapter
    file's tensor bytes, a description)."""
    from sft_recipe.plan.components import adapter_bytes, count_trainable, fully_trained, optimizer_bytes
    from sft_recipe.plan.inputs import workload
    from sft_recipe.plan.shape import model_shape

    w = workload(m, d, t, "cpu")  # the device changes activations only
    shape = model_shape(m.model_name_or_path, bool(t.trust_remote_code), w.extra_vocab)
    count, param_bytes = count_trainable(shape, w)
    targets = w.lora_targets if isinstance(w.lora_targets, str) else list(w.lora_targets)
    if w.lora:
        adapted = len(shape.adapted_linears(targets))
        tensors = adapted * (3 if w.dora else 2)
        holds = f"{count:,} LoRA parameters x {param_bytes} B"
    else:
        tensors = (len(shape.layer_linears) + 2) * shape.num_layers + 3  # linears + 2 norms per layer, + root
        holds = f"{count:,} parameters x {param_bytes} B (full fine-tuning)"
    extra_params, extra_tensors, full_bytes, _ = fully_trained(shape, w)  # modules to save, new-token rows
    if extra_params:
        holds += f" + {extra_params:,} x {full_bytes} B (modules to save, new-token rows)"
    trainable_bytes = count * param_bytes + extra_params * full_bytes
    adam, _ = optimizer_bytes(shape, w, count + extra_params, param_bytes)
    saved_tensor_bytes = adapter_bytes(shape, w)[0] + extra_params * full_bytes if w.lora else trainable_bytes
    return w, count + extra_params, trainable_bytes, tensors + extra_tensors, adam, saved_tensor_bytes, \
        holds + " + Adam state"


def estimate_writes(m, d, t, launch, block_bytes: int = 4096) -> WriteEstimate:
    """Every file of a checkpoint and of the final adapter, from the config alone (no weight read)."""
    w, params, trainable, tensors, adam, saved, holds = _trainable(m, d, t)
    ranks = max(1, launch.world_size)
    tokenizer = tokenizer_file_bytes(m.model_name_or_path)
    logging_every = _every(t.logging_steps, t.max_steps) or 1
    resumed_step, resumed_epoch = _resume_point(t)
    steps = save_steps(t, resumed_step, resumed_epoch)
    adapter_files = [saved + SAFETENSORS_HEADER_BYTES_PER_TENSOR * tensors, *ADAPTER_CARD_BYTES, *tokenizer,
                     GENERATION_CONFIG_BYTES]
    rng = RNG_STATE_BYTES + CUDA_RNG_STATE_BYTES * _gpus(launch)

    def checkpoint(step: int) -> int:
        if launch.use_fsdp:  # trainable tensors and Adam moments split across the ranks' DCP shards
            shards = ranks * tensors  # one item per tensor per rank
            steps_items = tensors  # Adam's step counters: replicated, written once
            files = [saved / ranks + DCP_BYTES_PER_ITEM * tensors] * ranks
            files += [DCP_METADATA_BYTES_PER_ITEM * shards, GENERATION_CONFIG_BYTES]
            if not t.save_only_model:
                files += [adam / ranks + DCP_BYTES_PER_ITEM * 2 * tensors] * ranks
                files[-1] += steps_items * (DCP_BYTES_PER_ITEM + 4) + DCP_OPTIMIZER_GROUP_ENTRIES * \
                    DCP_BYTES_PER_OBJECT
                files.append(DCP_METADATA_BYTES_PER_ITEM * (2 * shards + steps_items + DCP_OPTIMIZER_GROUP_ENTRIES))
        elif launch.use_deepspeed:  # the adapter folder + DeepSpeed's own checkpoint (torch.save, per rank)
            files = list(adapter_files) + list(DEEPSPEED_FILE_BYTES)
            if not t.save_only_model:  # ZeRO partitions fp32 master weights and both moments over the ranks
                files += [(params * 4 + adam) / ranks + DEEPSPEED_BYTES_PER_RANK] * ranks
                files += [DEEPSPEED_MODEL_STATES_BYTES] * ranks
        else:  # one process, DDP
            files = list(adapter_files)
            if not t.save_only_model:
                files.append(adam + tensors * (4 + OPTIMIZER_HEADER_BYTES_PER_TENSOR) + OPTIMIZER_GROUPS_BYTES)
        if not t.save_only_model:
            files += [rng] * ranks + [SCHEDULER_BYTES]
        files.append(TRAINER_STATE_BYTES + TRAINER_STATE_BYTES_PER_LOG * (step // logging_every if step > 0 else 0))
        files.append(MARKER_BYTES + MARKER_BYTES_PER_FILE * (len(files) + 1))
        # checkpoint-N, the two DCP folders or global_stepN: a block each on ext4
        folders = 3 if launch.use_fsdp else 2 if launch.use_deepspeed else 1
        return _on_disk(files, block_bytes) + folders * block_bytes

    last = steps[-1] if steps else t.max_steps
    return WriteEstimate(
        first_checkpoint_bytes=checkpoint(steps[0] if steps else 0),
        checkpoint_bytes=checkpoint(last if last > 0 else 0),
        checkpoints=None if steps is None else len(steps),
        save_total_limit=t.save_total_limit if t.save_total_limit and t.save_total_limit > 0 else None,
        # a fresh run's --overwrite_output_dir moves them aside, out of rotation's sight (still on this disk)
        existing_checkpoints=len(checkpoints(t.output_dir)) if t.resume_from_checkpoint else 0,
        adapter_bytes=_on_disk(adapter_files + list(RECORD_BYTES), block_bytes) + block_bytes,  # + its temp folder
        block_bytes=block_bytes,
        holds=holds,
    )


def _gpus(launch) -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and not launch.use_cpu else 0


def _block_bytes(path: Path) -> int:
    try:
        return os.statvfs(path).f_frsize or 4096
    except (OSError, AttributeError):
        return 4096


def disk_space_problems(m, d, t, launch) -> list[str]:
    """Refuse a run whose first save (a checkpoint, or the final adapter) cannot fit where output_dir is; warn when
    all of them cannot. Returns the problems; the warning goes to the log."""
    where, free = free_bytes(t.output_dir)
    try:
        estimate = estimate_writes(m, d, t, launch, _block_bytes(where))
    except Exception as e:  # noqa: BLE001 -- an architecture the planner cannot count, an unreadable config: said
        check_not_run(f"the disk-space check of --output_dir {t.output_dir}", e)
        return []
    out, strategy = t.output_dir, _strategy(t)
    has = f"{free:,} bytes are free on its disk ({where})"
    if estimate.checkpoints == 0 or (strategy == "no"):
        if estimate.adapter_bytes > free:
            return [f"--output_dir {out}: {has}, but the final adapter needs about {estimate.adapter_bytes:,}. Fix: "
                    "free space there or choose an --output_dir on a bigger disk."]
        return []
    first = estimate.first_checkpoint_bytes
    if first > free:
        return [f"--output_dir {out}: {has}, but the first checkpoint needs about {first:,} ({estimate.holds}, "
                "scheduler, RNG and trainer state): the run would fail there after training that far. Fix: free "
                "space there, choose an --output_dir on a bigger disk, or --save_strategy no (only the final "
                f"adapter, about {estimate.adapter_bytes:,} bytes, is written)."]
    peak = estimate.peak_bytes()
    each = estimate.checkpoint_bytes
    if peak is None:
        if not estimate.save_total_limit:
            logger.info(f"--output_dir {out}: {has}; a checkpoint takes about {each:,}, so about "
                        f"{max(0, (free - estimate.adapter_bytes) // each)} fit beside the final adapter (how many "
                        "this run writes is known once the data is read; --save_total_limit caps it).")
        return []
    if peak <= free:
        return []
    count, limit = estimate.checkpoints, estimate.save_total_limit
    kept = f"{limit} of its {count} checkpoints (--save_total_limit {limit})" if limit and limit < count else \
        f"all {count} checkpoints (--save_total_limit {'unset' if not limit else limit})"
    suggestion = estimate.limit_that_fits(free)
    fix = (f"--save_total_limit {suggestion} (keeps the newest {suggestion}; {suggestion + 1} are on disk while the "
           "next is written), free space there, or an --output_dir on a bigger disk." if suggestion else
           "free space there, an --output_dir on a bigger disk, or fewer checkpoints (a larger --save_steps, or "
           "--save_strategy no).")
    logger.warning(f"--output_dir {out}: {has}; this run keeps {kept} of about {each:,} bytes each, plus the final "
                   f"adapter (about {estimate.adapter_bytes:,}): about {peak:,} at the most, so a later save would "
                   f"fail with a full disk. Fix: {fix}")
    return []
