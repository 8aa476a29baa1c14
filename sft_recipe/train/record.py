"""The run record: one callback, one file (`output_dir/run_record.json`) with named sections, one summary line.

    run           what was trained: model, dataset, quantization, every setting
    distribution  how it really ran: accelerate's distributed type, FSDP version, processes, what wrapped the model
                  (accelerate can silently run DDP where FSDP was asked: tests read this)
    training      steps, seconds, tokens, the logged train and eval losses and their steps
    throughput    tokens/s (all ranks, and per device), MFU, FLOPs per token, and each logging step's values
    memory        per rank: peaks, the model state sharding divides, what loading and wrapping left resident
    weights       checksums (position-weighted word sums, measure.py) before/after: frozen weights must not
                  change, trainable ones must move
    saves         what the final adapter save and each checkpoint cost (seconds, anonymous RSS added per rank)

`SECTIONS` is the one home of the field names; the record refuses a field no section declares.

Every logging step also adds to the Trainer's log line: tokens_per_second (all ranks together since the previous
log; TRL's `num_tokens` counts every rank), tokens_per_second_per_device, mfu (when a peak is known for the device,
see `flops.peak_tflops`) and peak_memory_gib (the highest rank's peak so far; with several ranks also
peak_memory_gib_rank<i>).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from sft_recipe import compat
from sft_recipe.measure import (
    all_ranks_sum,
    gather_per_rank,
    gpu_peak_gib,
    local_sums,
    model_state_mib,
    peak_memory_gib,
    peak_rss_mib,
    rss_kinds_mib,
    unsharded_fsdp2_params,
    weight_mib,
)
from sft_recipe.train.flops import flops_model, peak_tflops

RUN_RECORD = "run_record.json"
LOSS_CURVE = "loss_curve.png"

SECTIONS: dict[str, tuple[str, ...]] = {
    "run": ("model_name_or_path", "dataset_name", "quantization", "config", "skipped_imports",
            "imports_frozen"),
    "distribution": ("distributed_type", "fsdp_version", "num_processes", "device", "wrapped_class",
                     "dtensor_params", "fsdp_modules", "fsdp1_flat_params", "engine_settings"),
    "training": ("global_steps", "train_seconds", "tokens_trained", "losses", "loss_steps", "eval_losses",
                 "eval_loss_steps"),
    "throughput": ("tokens_per_second", "tokens_per_second_per_device", "mfu", "peak_tflops_per_device",
                   "flops_per_token", "per_log"),
    "memory": ("peak_memory_gib_per_rank", "peak_memory_kind", "peak_rss_mib_per_rank", "peak_gpu_memory_gib",
               "peak_gpu_reserved_gib",
               "model_state_mib_per_rank", "rss_anon_after_load_mib_per_rank", "rss_file_after_load_mib_per_rank",
               "weight_mib_after_load_per_rank", "rss_anon_after_wrap_mib_per_rank", "weight_mib_after_wrap_per_rank",
               "gpu_peak_gib_after_load_per_rank", "gpu_peak_gib_after_wrap_per_rank", "fsdp2_unsharded_params"),
    "weights": ("trainable_params", "checksums_before", "checksums_after", "frozen_changed", "trainable_changed"),
    "saves": ("final", "checkpoints"),
    "data": ("prepared_on_ranks", "read_copy_on_ranks", "seconds_per_rank"),
}


class RunRecord(TrainerCallback):
    """Records the run as it happens. Needs the trainer (its accelerator and wrapped model, which callbacks are not
    given); built after the trainer, before training. `attach` puts it first, so the Trainer's own printing and
    reporting callbacks already see the throughput it adds to each log."""

    def __init__(self, trainer, peak_tflops_per_device: float | None = None):
        self.trainer = trainer
        self.record: dict[str, dict] = {name: {} for name in SECTIONS}
        # Counted now, before FSDP1 flattens parameters or FSDP shards them (then only shards are visible).
        self.set("weights", trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))
        self.flops = flops_model(trainer.model, trainer.args)
        self.peak_tflops = peak_tflops(peak_tflops_per_device)
        # Model loaded, not yet wrapped: this rank's private (anonymous) resident memory and its resident file pages.
        # Weights read from safetensors stay file pages (mmapped, shared by every rank through the page cache) until
        # something copies them into private memory; cpu_ram_efficient_loading is about that private copy.
        self._rss_after_load_mib = rss_kinds_mib()
        # Live weight bytes this rank held after loading (meta tensors hold none): with cpu_ram_efficient_loading
        # only local rank 0 reads weights, the others build on the meta device and receive their shards when wrapped.
        # RSS cannot show it on CPU (glibc keeps freed blocks, mmapped files count per process); this can.
        self._weight_mib_after_load = trainer.weight_mib_after_load  # measured before meta placeholders were made
        self._gpu_peak_gib_after_load = trainer.gpu_peak_gib_after_load
        self._start = time.time()
        self._last_log: tuple[float, float] = (self._start, 0.0)  # (time, cumulative tokens)

    @classmethod
    def attach(cls, trainer, peak_tflops_per_device: float | None = None) -> RunRecord:
        record = cls(trainer, peak_tflops_per_device)
        trainer.callback_handler.callbacks.insert(0, record)
        return record

    def set(self, section: str, **fields) -> None:
        unknown = set(fields) - set(SECTIONS[section])
        if unknown:
            raise KeyError(f"run record section {section!r} declares no field {sorted(unknown)} (see SECTIONS)")
        self.record[section].update(fields)

    # --- while training -----------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        wrapped = self.trainer.model_wrapped
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        self.set("distribution",
                 distributed_type=str(accelerator.distributed_type).split(".")[-1],
                 fsdp_version=getattr(plugin, "fsdp_version", None) if plugin is not None else None,
                 num_processes=accelerator.num_processes, device=str(accelerator.device),
                 wrapped_class=type(wrapped).__name__,
                 dtensor_params=sum(type(p).__name__ == "DTensor" for p in wrapped.parameters()),
                 fsdp_modules=sum("FullyShardedDataParallel" in type(m).__name__ or "FSDP" in type(m).__name__
                                  for m in wrapped.modules()))
        self.set("distribution", engine_settings=engine_settings(wrapped, plugin))
        flat = [p for p in wrapped.parameters() if getattr(p, "_is_flat_param", False)]
        if flat:  # FSDP1 use_orig_params=False: PEFT's wrap policy must keep LoRA and frozen weights in separate units
            self.set("distribution", fsdp1_flat_params={"trainable": sum(p.requires_grad for p in flat),
                                                        "frozen": sum(not p.requires_grad for p in flat)})
        self.set("weights", checksums_before=all_ranks_sum(accelerator, local_sums(wrapped)))
        # One gather: after loading (anonymous, file-backed, live weights, GPU peak since start) and after wrapping
        # (anonymous, live weights: this rank's shards + 4-bit constants, GPU peak since start). -1: no GPU.
        gpu_wrap = gpu_peak_gib()
        ranks = gather_per_rank(accelerator, [*self._rss_after_load_mib, self._weight_mib_after_load,
                                              rss_kinds_mib()[0], weight_mib(wrapped),
                                              -1.0 if self._gpu_peak_gib_after_load is None else
                                              self._gpu_peak_gib_after_load, -1.0 if gpu_wrap is None else gpu_wrap])
        self.set("memory",
                 rss_anon_after_load_mib_per_rank=[round(float(x), 1) for x in ranks[:, 0]],
                 rss_file_after_load_mib_per_rank=[round(float(x), 1) for x in ranks[:, 1]],
                 weight_mib_after_load_per_rank=[round(float(x), 3) for x in ranks[:, 2]],
                 rss_anon_after_wrap_mib_per_rank=[round(float(x), 1) for x in ranks[:, 3]],
                 weight_mib_after_wrap_per_rank=[round(float(x), 3) for x in ranks[:, 4]],
                 gpu_peak_gib_after_load_per_rank=_gpu_values(ranks[:, 5]),
                 gpu_peak_gib_after_wrap_per_rank=_gpu_values(ranks[:, 6]))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._start = time.time()
        self._last_log = (self._start, 0.0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # eval and end-of-train logs carry no token count
            return
        accelerator = self.trainer.accelerator
        per_rank = [round(float(x), 3) for x in gather_per_rank(accelerator, [peak_memory_gib()])[:, 0]]
        now, tokens = time.time(), float(logs.get("num_tokens", 0.0))
        tokens_per_second = (tokens - self._last_log[1]) / max(now - self._last_log[0], 1e-9)
        self._last_log = (now, tokens)
        entry = {"tokens_per_second": round(tokens_per_second, 1),
                 "tokens_per_second_per_device": round(tokens_per_second / accelerator.num_processes, 1),
                 "peak_memory_gib": max(per_rank)}
        if len(per_rank) > 1:  # scalars, so every logging integration takes them
            entry.update({f"peak_memory_gib_rank{rank}": value for rank, value in enumerate(per_rank)})
        if self.peak_tflops:
            achieved = tokens_per_second / accelerator.num_processes * self.flops.per_token()
            entry["mfu"] = round(achieved / (self.peak_tflops * 1e12), 4)
        logs.update(entry)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(entry)  # the Trainer recorded this log before calling back
        self.record["throughput"].setdefault("per_log", []).append(
            {"step": state.global_step, **entry, "peak_memory_gib_per_rank": per_rank})

    def on_train_end(self, args, state, control, **kwargs):
        accelerator, trainer = self.trainer.accelerator, self.trainer
        compat.restore_bnb_4bit_storage_layout(trainer.model_wrapped)  # CPU evals re-lay out 4-bit bytes
        after = all_ranks_sum(accelerator, local_sums(trainer.model_wrapped))
        before = self.record["weights"]["checksums_before"]
        self.set("weights", checksums_after=after, frozen_changed=after[0] != before[0],
                 trainable_changed=after[1] != before[1])
        logged = [h for h in state.log_history if "loss" in h]
        evaluated = [h for h in state.log_history if "eval_loss" in h]
        self.set("training", global_steps=state.global_step, train_seconds=round(time.time() - self._start, 2),
                 tokens_trained=max([h.get("num_tokens", 0) for h in state.log_history] or [0]),
                 losses=[h["loss"] for h in logged], loss_steps=[h["step"] for h in logged],
                 eval_losses=[h["eval_loss"] for h in evaluated], eval_loss_steps=[h["step"] for h in evaluated])
        if self.record["distribution"].get("fsdp_version") == 2:  # what evaluations left unsharded, and now
            self.set("memory", fsdp2_unsharded_params={
                "after_evaluation": trainer.reshard_after_evaluation.unsharded_params_seen,
                "at_train_end": unsharded_fsdp2_params(trainer.model_wrapped)})
        peaks = gather_per_rank(accelerator, [peak_rss_mib(), model_state_mib(trainer.model_wrapped,
                                                                                trainer.optimizer)])
        self.set("memory", peak_rss_mib_per_rank=[round(float(x), 1) for x in peaks[:, 0]],
                 model_state_mib_per_rank=[round(float(x), 2) for x in peaks[:, 1]])
        if torch.cuda.is_available():
            # allocated and reserved (what nvidia-smi shows, less the CUDA context): the plan's two figures
            self.set("memory", peak_gpu_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                     peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))
        self._summarize_throughput()

    def _summarize_throughput(self) -> None:
        per_log = self.record["throughput"].get("per_log", [])
        # The first logging interval includes warm-up (allocations, compilation): left out when there are others.
        rates = [h["tokens_per_second"] for h in per_log[1:]] or [h["tokens_per_second"] for h in per_log]
        mfus = [h["mfu"] for h in per_log if "mfu" in h]
        n = self.trainer.accelerator.num_processes
        self.set("throughput", tokens_per_second=round(sum(rates) / len(rates), 1) if rates else None,
                 tokens_per_second_per_device=round(sum(rates) / len(rates) / n, 1) if rates else None,
                 mfu=round(sum(mfus) / len(mfus), 4) if mfus else None, peak_tflops_per_device=self.peak_tflops,
                 flops_per_token=self.flops.per_token())

    # --- end of run -----------------------------------------------------------------------------------------------

    def write(self, output_dir: str, *, run: dict, final_save: dict | None, plot: bool = True) -> dict:
        """Collective (every rank calls it): the memory peaks after the final save, then on the main process
        run_record.json and (with `plot`) loss_curve.png in output_dir, and the summary line in the log."""
        self.set("run", **run)
        self.set("saves", final=final_save, checkpoints=self.trainer.checkpoint_save_costs)
        peaks = gather_per_rank(self.trainer.accelerator, [peak_memory_gib()])
        self.set("memory", peak_memory_gib_per_rank=[round(float(x), 3) for x in peaks[:, 0]],
                 peak_memory_kind="cuda max_memory_allocated" if torch.cuda.is_available() else "process RSS")
        if self.trainer.accelerator.is_main_process:
            from sft_recipe.atomic import write_atomically

            Path(output_dir).mkdir(parents=True, exist_ok=True)
            text = json.dumps(self.record, indent=2)
            write_atomically(Path(output_dir, RUN_RECORD), lambda tmp: tmp.write_text(text))
            if plot:
                plot_losses(self.record, os.path.join(output_dir, LOSS_CURVE))
            else:  # a curve a previous run left here would pass for this run's
                Path(output_dir, LOSS_CURVE).unlink(missing_ok=True)
            print(summary_line(self.record), flush=True)
        return self.record


def _gpu_values(column) -> list[float] | None:
    """A gathered GPU column: None where no rank had a GPU (-1 marks it)."""
    values = [float(x) for x in column]
    return None if all(v < 0 for v in values) else [round(v, 3) for v in values]


def summary_line(record: dict) -> str:
    """One line in the user's words: how it ran, how long, the loss, memory, and what moved."""
    d, t, w = record["distribution"], record["training"], record["weights"]
    kind = d.get("distributed_type", "?")
    if d.get("fsdp_version"):
        how = f"FSDP{d['fsdp_version']} on {d.get('num_processes')} x {d.get('device')}"
    elif kind == "NO":
        how = f"one process on {d.get('device')}"
    else:
        name = {"DEEPSPEED": "DeepSpeed", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}.get(kind, kind)
        how = f"{name} on {d.get('num_processes')} x {d.get('device')}"
    losses = t.get("losses") or []
    if not losses:
        loss = "no training loss logged (--logging_steps is more than the steps run)"
    elif len(losses) == 1:
        loss = f"loss {losses[0]:.3f} (logged once)"
    else:
        loss = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return (f"run summary: {how} ({d.get('wrapped_class')}), {t.get('global_steps')} steps in "
            f"{t.get('train_seconds')} s, {loss}, peak RSS per rank {record['memory'].get('peak_rss_mib_per_rank')} "
            f"MiB, frozen weights {'CHANGED' if w.get('frozen_changed') else 'unchanged'}, "
            f"trainable weights {'moved' if w.get('trainable_changed') else 'DID NOT MOVE'}")


def plot_losses(record: dict, path: str) -> None:
    # A Figure of its own, drawn to a file: no pyplot (its import, backend selection and figure registry cost the
    # main process ~0.3 s at every run's end, and a training machine has no display to select).
    from matplotlib.figure import Figure

    t, d = record["training"], record["distribution"]
    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.subplots()
    axes.plot(t.get("loss_steps", []), t.get("losses", []), label="train loss")
    broken = [s for s, loss in zip(t.get("loss_steps", []), t.get("losses", [])) if not math.isfinite(loss)]
    if broken:  # a NaN/inf loss is a gap in the line: say where the run broke
        axes.axvline(broken[0], color="red", linestyle="--",
                     label=f"non-finite loss from step {broken[0]} ({t['losses'][t['loss_steps'].index(broken[0])]})")
    if t.get("eval_losses"):
        axes.plot(t["eval_loss_steps"], t["eval_losses"], "o-", label="eval loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    rate = record["throughput"].get("tokens_per_second")
    axes.set_title(f"{t.get('global_steps')} steps, {d.get('num_processes')} x {d.get('device')}"
                   + (f", {rate:.0f} tokens/s" if rate else ""))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def engine_settings(wrapped, fsdp_plugin) -> dict:
    """What the engine runs with, read from the wrapped model where it keeps it (FSDP1's root unit, DeepSpeed's
    engine) and from accelerate's plugin where only it does (FSDP2), so a test can tell an accelerate YAML's edit
    reached the engine: what the YAML asked is not evidence of what ran."""
    def name(value):
        return getattr(value, "name", value)

    if hasattr(wrapped, "zero_optimization_stage"):  # DeepSpeedEngine
        return {"zero_stage": wrapped.zero_optimization_stage()}
    if hasattr(wrapped, "sharding_strategy"):  # FSDP1's root FullyShardedDataParallel
        return {"sharding_strategy": name(wrapped.sharding_strategy),
                "backward_prefetch": name(wrapped.backward_prefetch),
                "forward_prefetch": bool(wrapped.forward_prefetch), "use_orig_params": bool(wrapped._use_orig_params),
                "state_dict_type": name(getattr(fsdp_plugin, "state_dict_type", None))}
    if fsdp_plugin is not None:  # FSDP2 keeps no settings object on the modules
        return {"reshard_after_forward": fsdp_plugin.reshard_after_forward,
                "state_dict_type": name(fsdp_plugin.state_dict_type)}
    return {}
