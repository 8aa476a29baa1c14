"""Facts about a run, written to `output_dir/run_facts.json`: how it was really distributed, what moved, losses.

Tests read this file to assert, e.g., that a CPU "FSDP" run really was FSDP-wrapped (accelerate can silently run
DDP instead) and that base weights stayed frozen while LoRA weights moved.
"""

from __future__ import annotations

import json
import os
import resource
import time

import torch
from transformers import TrainerCallback

from . import compat

RUN_FACTS = "run_facts.json"


def _shard_of(p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "to_local"):  # FSDP2 DTensor
        return p.to_local()
    ds_shard = getattr(p, "ds_tensor", None)  # DeepSpeed ZeRO-3: p itself is empty, or gathered for a moment
    if ds_shard is not None:
        return ds_shard
    shard = getattr(p, "_local_shard", None)  # FSDP1 FlatParameter keeps its shard even while unsharded
    return shard if shard is not None else p


def _checksum(t: torch.Tensor) -> int:
    """Exact, dtype-agnostic fingerprint of a tensor's bytes (packed 4-bit storage read as bf16 can be NaN)."""
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
    return int(words.sum(dtype=torch.int64))  # reduces without materialising an int64 copy


def _local_sums(model) -> tuple[int, int]:
    """(checksum of frozen params, checksum of trainable params) over this rank's shards: exact change detectors."""
    frozen = trainable = 0
    with torch.no_grad():
        for p in model.parameters():
            local = _shard_of(p)
            if local.numel() and local.untyped_storage().size() == 0:
                continue  # freed unsharded view; its values are counted through the shard
            if p.requires_grad:
                trainable += _checksum(local)
            else:
                frozen += _checksum(local)
    return frozen, trainable


def _all_ranks_sum(accelerator, values: tuple[int, int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=accelerator.device)
    return [int(x) for x in accelerator.reduce(t, reduction="sum")] if accelerator.num_processes > 1 else list(values)


def trainable_checksum(accelerator, model) -> int:
    """Collective under FSDP: the checksum of all trainable weights, summed over ranks."""
    return _all_ranks_sum(accelerator, _local_sums(model))[1]


def live_tensor_mib(tensors) -> float:
    """Bytes of the distinct storages behind `tensors`, meta tensors excluded (they hold no memory)."""
    seen, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total / 2**20


def unsharded_fsdp2_params(model) -> int:
    """Parameters of an FSDP2 model that are not DTensor shards right now (0 when every unit is sharded)."""
    return sum(type(p).__name__ != "DTensor" for p in model.parameters())


def _model_state_mib(model, optimizer) -> float:
    """This rank's share of weights + gradients + optimizer state (shards under FSDP): the part of memory that
    sharding divides by N, measured directly rather than read off RSS (which also holds imports and activations)."""
    tensors = []
    for p in model.parameters():
        local = _shard_of(p)
        tensors.append(local)
        grad = getattr(p, "grad", None)
        if grad is not None:
            tensors.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [t.to_local() if hasattr(t, "to_local") else t for t in state.values()
                        if isinstance(t, torch.Tensor)]
    return live_tensor_mib(tensors)


def _rss_kinds_mib() -> tuple[float, float]:
    """(RssAnon, RssFile) of this process in MiB, from /proc (Linux); zeros elsewhere."""
    values = {"RssAnon:": 0.0, "RssFile:": 0.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, *rest = line.split()
                if name in values:
                    values[name] = float(rest[0]) / 1024  # kB
    except OSError:
        pass
    return values["RssAnon:"], values["RssFile:"]


class RssWatch:
    """Peak private (anonymous) resident memory of this process while a block runs, above its level at entry.

    A thread samples /proc/self/status every `interval_s`. What it can and cannot see: glibc reuses freed blocks
    without growing RSS, so a block that allocates into memory freed earlier reads as adding nothing. Launch with
    `MALLOC_MMAP_THRESHOLD_=65536` (the tests do) and every tensor above 64 KiB is its own mmap, returned to the
    system when freed: RSS then follows live tensor bytes, the quantity that stands for GPU memory in a GPU run.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start_mib = self.peak_mib = 0.0
        self.seconds = 0.0

    def __enter__(self):
        import threading

        self.start_mib = self.peak_mib = _rss_kinds_mib()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, _rss_kinds_mib()[0])
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, _rss_kinds_mib()[0])
        self.seconds = time.perf_counter() - self._started

    @property
    def added_mib(self) -> float:
        return self.peak_mib - self.start_mib


def save_cost(accelerator, watch: RssWatch, **extra) -> dict:
    """Collective: a save's wall seconds (slowest rank) and the anonymous RSS it added on each rank."""
    per_rank = torch.tensor([watch.seconds, watch.added_mib], dtype=torch.float64, device=accelerator.device)
    per_rank = accelerator.gather(per_rank).reshape(-1, 2) if accelerator.num_processes > 1 else per_rank[None]
    return {"seconds": round(float(per_rank[:, 0].max()), 3),
            "rss_anon_added_mib_per_rank": [round(float(x), 1) for x in per_rank[:, 1]], **extra}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class RunFacts(TrainerCallback):
    """Records distribution facts at train start and what changed at train end. Needs the trainer for its
    accelerator and wrapped model, which callbacks are not given."""

    def __init__(self, trainer):
        self.trainer = trainer
        # Counted now, before FSDP1 flattens parameters (then only flat shards are visible).
        self.facts: dict = {"trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}
        # Model loaded, not yet wrapped: this rank's private (anonymous) resident memory and its resident file pages.
        # Weights read from safetensors stay file pages (mmapped, shared by every rank through the page cache) until
        # something copies them into private memory; cpu_ram_efficient_loading is about that private copy.
        self._rss_after_load_mib = _rss_kinds_mib()
        # Live weight bytes this rank held after loading (meta tensors hold none): with cpu_ram_efficient_loading
        # only local rank 0 reads weights, the others build on the meta device and receive their shards when wrapped.
        # RSS cannot show it on CPU (glibc keeps freed blocks, mmapped files count per process); this can.
        self._weight_mib_after_load = trainer.weight_mib_after_load if hasattr(trainer, "weight_mib_after_load") \
            else live_tensor_mib([*trainer.model.parameters(), *trainer.model.buffers()])
        self._start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        wrapped = self.trainer.model_wrapped
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        self.facts.update(
            distributed_type=str(accelerator.distributed_type).split(".")[-1],
            fsdp_version=getattr(plugin, "fsdp_version", None) if plugin is not None else None,
            num_processes=accelerator.num_processes,
            device=str(accelerator.device),
            wrapped_class=type(wrapped).__name__,
            dtensor_params=sum(type(p).__name__ == "DTensor" for p in wrapped.parameters()),
            fsdp_modules=sum("FullyShardedDataParallel" in type(m).__name__ or "FSDP" in type(m).__name__
                             for m in wrapped.modules()),
        )
        flat = [p for p in wrapped.parameters() if getattr(p, "_is_flat_param", False)]
        if flat:  # FSDP1 use_orig_params=False: PEFT's wrap policy must keep LoRA and frozen weights in separate units
            self.facts["fsdp1_flat_params"] = {"trainable": sum(p.requires_grad for p in flat),
                                               "frozen": sum(not p.requires_grad for p in flat)}
        self.facts["checksums_before"] = _all_ranks_sum(accelerator, _local_sums(wrapped))
        loaded = torch.tensor([*self._rss_after_load_mib, self._weight_mib_after_load], dtype=torch.float64,
                              device=accelerator.device)
        loaded = accelerator.gather(loaded).reshape(-1, 3)
        self.facts["rss_anon_after_load_mib_per_rank"] = [round(float(x), 1) for x in loaded[:, 0]]
        self.facts["rss_file_after_load_mib_per_rank"] = [round(float(x), 1) for x in loaded[:, 1]]
        self.facts["weight_mib_after_load_per_rank"] = [round(float(x), 2) for x in loaded[:, 2]]
        self.facts["rss_anon_after_wrap_mib_per_rank"] = [
            round(float(x), 1) for x in accelerator.gather(torch.tensor([_rss_kinds_mib()[0]], dtype=torch.float64,
                                                                        device=accelerator.device))]
        self._start = time.time()

    def on_train_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        compat.restore_bnb_4bit_storage_layout(self.trainer.model_wrapped)  # CPU evals re-lay out 4-bit bytes
        checksums_after = _all_ranks_sum(accelerator, _local_sums(self.trainer.model_wrapped))
        before = self.facts["checksums_before"]
        self.facts.update(
            checksums_after=checksums_after,
            frozen_changed=checksums_after[0] != before[0],
            trainable_changed=checksums_after[1] != before[1],
            train_seconds=round(time.time() - self._start, 2),
            global_steps=state.global_step,
            losses=[h["loss"] for h in state.log_history if "loss" in h],
            eval_losses=[h["eval_loss"] for h in state.log_history if "eval_loss" in h],
        )
        if self.facts.get("fsdp_version") == 2:  # what evaluations left unsharded, and what is unsharded now
            self.facts["fsdp2_unsharded_params"] = {
                "after_evaluation": getattr(getattr(self.trainer, "reshard_after_evaluation", None),
                                            "unsharded_params_seen", None),
                "at_train_end": unsharded_fsdp2_params(self.trainer.model_wrapped)}
        if getattr(self.trainer, "checkpoint_save_costs", None):
            self.facts["checkpoint_saves"] = self.trainer.checkpoint_save_costs
        peaks = torch.tensor([peak_rss_mib(), _model_state_mib(self.trainer.model_wrapped, self.trainer.optimizer)],
                             dtype=torch.float64, device=accelerator.device)
        gathered = accelerator.gather(peaks).reshape(-1, 2)
        self.facts["peak_rss_mib_per_rank"] = [round(float(x), 1) for x in gathered[:, 0]]
        self.facts["model_state_mib_per_rank"] = [round(float(x), 2) for x in gathered[:, 1]]
        if torch.cuda.is_available():
            self.facts["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)

    def summary_line(self) -> str:
        """One line in the user's words: how it ran, how long, the loss, memory, and what moved."""
        f = self.facts
        kind = f.get("distributed_type", "?")
        if f.get("fsdp_version"):
            how = f"FSDP{f['fsdp_version']} on {f.get('num_processes')} x {f.get('device')}"
        elif kind == "NO":
            how = f"one process on {f.get('device')}"
        else:
            name = {"DEEPSPEED": "DeepSpeed", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}.get(kind, kind)
            how = f"{name} on {f.get('num_processes')} x {f.get('device')}"
        losses = f.get("losses") or []
        if not losses:
            loss = "no training loss logged (--logging_steps is more than the steps run)"
        elif len(losses) == 1:
            loss = f"loss {losses[0]:.3f} (logged once)"
        else:
            loss = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        return (f"run summary: {how} ({f.get('wrapped_class')}), {f.get('global_steps')} steps in "
                f"{f.get('train_seconds')} s, {loss}, peak RSS per rank {f.get('peak_rss_mib_per_rank')} MiB, "
                f"frozen weights {'CHANGED' if f.get('frozen_changed') else 'unchanged'}, "
                f"trainable weights {'moved' if f.get('trainable_changed') else 'DID NOT MOVE'}")

    def write(self, output_dir: str, **extra) -> None:
        if not self.trainer.accelerator.is_main_process:
            return
        self.facts.update(extra)
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, RUN_FACTS), "w") as f:
            json.dump(self.facts, f, indent=2)
        print(self.summary_line(), flush=True)
