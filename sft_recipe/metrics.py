"""Live throughput and memory while training, and the end-of-run summary (JSON + loss-curve PNG).

Every logging step adds to the Trainer's log line:
    tokens_per_second            all ranks together, since the previous log (TRL's `num_tokens` counts every rank)
    tokens_per_second_per_device that divided by the number of processes
    mfu                          model FLOPs utilisation, when a peak is known for the device (see `peak_tflops`)
    peak_memory_gib              the highest rank's peak so far: GPU memory allocated by torch where there is a GPU,
                                 process RSS on CPU; with several ranks also `peak_memory_gib_rank<i>` for each

Model FLOPs per trained token (the formula behind `mfu`), with N = all weights of the model, N_t = trainable ones,
L layers, d hidden size, S sequence length:
    forward 2N + backward through activations 2N + weight gradients 2N_t (+ 2N recompute with gradient checkpointing)
    + attention scores 12*L*d*S (4*L*d*S forward, twice that backward; + 4*L*d*S with recompute).
Frozen weights need no weight gradient, so LoRA costs ~4N per token rather than full fine-tuning's 6N. Quantized base
weights count as N too: they are dequantized and multiplied at full size. `mfu` = achieved FLOPs per second per device
/ the device's peak dense bf16 FLOPs; it is an estimate (packing makes S the packed length, an upper bound for
attention).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

RUN_SUMMARY = "run_summary.json"
LOSS_CURVE = "loss_curve.png"

# Dense bf16 tensor-core peak, TFLOPS per device (vendor datasheets, SXM parts without sparsity).
PEAK_TFLOPS_BY_DEVICE_NAME = {
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.0,
    "RTX 3090": 71.0, "V100": 125.0,
}


def peak_tflops(configured: float | None) -> float | None:
    """The peak used for MFU: `--peak_tflops_per_device` if given, else looked up from the GPU's name; None on CPU
    (no meaningful published peak), which leaves `mfu` out of the logs."""
    if configured:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((value for key, value in PEAK_TFLOPS_BY_DEVICE_NAME.items() if key in name), None)


@dataclass(frozen=True)
class FlopsModel:
    total_params: int
    trainable_params: int
    num_layers: int
    hidden_size: int
    seq_len: int
    gradient_checkpointing: bool

    def per_token(self) -> float:
        n, n_t = self.total_params, self.trainable_params
        recompute = 1 if self.gradient_checkpointing else 0
        dense = (2 + 2 + 2 * recompute) * n + 2 * n_t
        attention = (12 + 4 * recompute) * self.num_layers * self.hidden_size * self.seq_len
        return float(dense + attention)


def count_params(model) -> tuple[int, int]:
    """(all weights, trainable) as the model's user sees them: 4-bit packed weights count their real element count."""
    total = trainable = 0
    for p in model.parameters():
        numel = p.numel()
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None and getattr(quant_state, "shape", None) is not None:
            numel = int(torch.Size(quant_state.shape).numel())
        total += numel
        trainable += numel if p.requires_grad else 0
    return total, trainable


def flops_model(model, args) -> FlopsModel:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total, trainable = count_params(model)
    return FlopsModel(total_params=total, trainable_params=trainable,
                      num_layers=int(getattr(config, "num_hidden_layers", 0)),
                      hidden_size=int(getattr(config, "hidden_size", 0)),
                      seq_len=int(args.max_length or 1024), gradient_checkpointing=bool(args.gradient_checkpointing))


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    from .report import peak_rss_mib

    return peak_rss_mib() / 1024


class ThroughputCallback(TrainerCallback):
    """Adds tokens/s, MFU and peak memory per rank to every training log; writes the run summary at the end."""

    def __init__(self, trainer, peak_tflops_per_device: float | None = None):
        self.trainer = trainer
        self.flops = flops_model(trainer.model, trainer.args)  # counted before FSDP flattens or shards parameters
        self.peak_tflops = peak_tflops(peak_tflops_per_device)
        self._last: tuple[float, float] | None = None  # (time, cumulative tokens)
        self._start = time.time()
        self.history: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.time()
        self._last = (self._start, 0.0)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # eval and end-of-train logs carry no token count
            return
        accelerator = self.trainer.accelerator
        peaks = torch.tensor([peak_memory_gib()], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            peaks = accelerator.gather(peaks)
        per_rank = [round(float(x), 3) for x in peaks.reshape(-1)]
        now, tokens = time.time(), float(logs.get("num_tokens", 0.0))
        seconds = max(now - self._last[0], 1e-9)
        tokens_per_second = (tokens - self._last[1]) / seconds
        self._last = (now, tokens)
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
        self.history.append({"step": state.global_step, **entry, "peak_memory_gib_per_rank": per_rank})

    # --- end of run ---------------------------------------------------------------------------------------------

    def summary(self, state, config: dict) -> dict:
        train = [{"step": h["step"], "loss": h["loss"]} for h in state.log_history if "loss" in h]
        evals = [{"step": h["step"], "eval_loss": h["eval_loss"]} for h in state.log_history if "eval_loss" in h]
        rates = [h["tokens_per_second"] for h in self.history[1:]] or [h["tokens_per_second"] for h in self.history]
        tokens = max([h.get("num_tokens", 0) for h in state.log_history if "num_tokens" in h] or [0])
        mfus = [h["mfu"] for h in self.history if "mfu" in h]
        accelerator = self.trainer.accelerator
        return {
            "config": config,
            "num_processes": accelerator.num_processes,
            "device": str(accelerator.device),
            "train_seconds": round(time.time() - self._start, 2),
            "global_steps": state.global_step,
            "tokens_trained": tokens,
            # The first logging interval includes warm-up (allocations, compilation): left out of the mean when
            # there are others.
            "tokens_per_second": round(sum(rates) / len(rates), 1) if rates else None,
            "tokens_per_second_per_device": round(sum(rates) / len(rates) / accelerator.num_processes, 1)
            if rates else None,
            "mfu": round(sum(mfus) / len(mfus), 4) if mfus else None,
            "peak_tflops_per_device": self.peak_tflops,
            "flops_per_token": self.flops.per_token(),
            "peak_memory_gib_per_rank": self.history[-1]["peak_memory_gib_per_rank"] if self.history else None,
            "peak_memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "process RSS",
            "losses": train,
            "eval_losses": evals,
        }

    def write_summary(self, output_dir: str, state, config: dict) -> dict:
        """Main process: run_summary.json and loss_curve.png in output_dir. Collective: every rank calls it."""
        accelerator = self.trainer.accelerator
        peaks = torch.tensor([peak_memory_gib()], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            peaks = accelerator.gather(peaks)
        summary = self.summary(state, config)
        summary["peak_memory_gib_per_rank"] = [round(float(x), 3) for x in peaks.reshape(-1)]
        if accelerator.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, RUN_SUMMARY), "w") as f:
                json.dump(summary, f, indent=2)
            plot_losses(summary, os.path.join(output_dir, LOSS_CURVE))
        return summary


def attach_throughput(trainer, peak_tflops_per_device: float | None = None) -> ThroughputCallback:
    """Add the callback first, so the Trainer's own printing/reporting callbacks already see the added metrics."""
    callback = ThroughputCallback(trainer, peak_tflops_per_device)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def plot_losses(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    train = summary["losses"]
    axes.plot([p["step"] for p in train], [p["loss"] for p in train], label="train loss")
    evals = summary["eval_losses"]
    if evals:
        axes.plot([p["step"] for p in evals], [p["eval_loss"] for p in evals], "o-", label="eval loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    rate = summary.get("tokens_per_second")
    axes.set_title(f"{summary['global_steps']} steps, {summary['num_processes']} x {summary['device']}"
                   + (f", {rate:.0f} tokens/s" if rate else ""))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def quiet_other_ranks() -> None:
    """One set of progress bars and info logs for a multi-process run: only the main process shows them (each rank
    runs the same dataset preparation, so N ranks would print N copies of every bar)."""
    if os.environ.get("RANK", "0") == "0":
        return
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
