"""FLOPs per trained token and the device peak behind MFU (the run record's `mfu`).

Model FLOPs per trained token (the formula behind `mfu`), with N = all weights of the model, N_t = trainable ones,
L layers, d hidden size, S sequence length:
    forward 2N + backward through activations 2N + weight gradients 2N_t (+ 2N recompute with gradient checkpointing)
    + attention scores 12*L*d*S (4*L*d*S forward, twice that backward; + 4*L*d*S with recompute).
Frozen weights need no weight gradient, so LoRA costs ~4N per token rather than full fine-tuning's 6N. In a
mixture-of-experts model N counts each expert layer's active fraction (top-k / experts). Quantized base weights count
as N too: they are dequantized and multiplied at full size. `mfu` = achieved FLOPs per second per device
/ the device's peak dense bf16 FLOPs; it is an estimate (packing makes S the packed length, an upper bound for
attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """(weights each token multiplies, trainable) as the model's user sees them: 4-bit packed weights count their real
    element count; routed experts (fused or listed, found from the structure: sft_recipe/model/structure.py) count
    their active fraction top-k / experts, since only the routed experts run for a token; shared experts, dense
    layers and routers count whole (the memory plan counts every expert: they are all held)."""
    from sft_recipe.model.structure import active_expert_fraction, routed_expert_parameter_ids

    active = active_expert_fraction(model)
    routed = routed_expert_parameter_ids(model) if active < 1 else set()
    total = trainable = 0
    for p in model.parameters():
        numel = p.numel()
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None and getattr(quant_state, "shape", None) is not None:
            numel = int(torch.Size(quant_state.shape).numel())
        if id(p) in routed:
            numel = int(numel * active)
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
