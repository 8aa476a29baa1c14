"""Will it fit? A per-rank memory plan for a training run, from the model's config alone.

    python -m sft_recipe.plan --config_file configs/fsdp_config.yaml --gpu_memory_gib 80 [train.py flags]
    python -m sft_recipe.plan --config_file configs/fsdp_config.yaml --gpu_memory_gib 80 \
        --config recipes/llama2_70b_lora.yaml --model_name_or_path configs/models/llama-2-70b

The planner takes the same flags and accelerate YAML as training plus the memory of one GPU, builds the model on the
meta device (its config only: no weight is downloaded, read or allocated, so a 70B costs what the tiny model costs),
and prints, per rank: base weights, LoRA/DoRA parameters, gradients, optimizer state, activations, FSDP all-gather
buffers and framework overhead; host RAM per node; a verdict (fits or not, headroom); and when it does not fit, the
cheapest changes that make it fit, in order, each with its predicted per-GPU memory.

Notation used in every formula below (all sizes in bytes unless a name says otherwise):

    P      parameters of the base model;  Q  of them in the linear layers bitsandbytes quantizes (every nn.Linear but
           the output head);  L  decoder layers;  h  hidden size;  i  MLP width;  kv = key/value heads x head_dim;
           V  vocabulary (rows of the output head)
    N      processes (ranks);  n  ranks per machine;  G  ranks a parameter is sharded over
           (FULL_SHARD / SHARD_GRAD_OP / FSDP2: N;  HYBRID_SHARD: n;  NO_SHARD, DDP, one process: 1)
    b      bytes per base weight as loaded: 4 (fp32, how the recipe loads LoRA runs, as upstream), or the 4-bit
           storage dtype's size (QLoRA under FSDP loads the model in --bnb_4bit_quant_storage_dtype)
    a      bytes per activation element: 2 with bf16/fp16 (mixed precision or a bf16 model), else 4
    B, S   micro-batch (--per_device_train_batch_size) and sequence length (--max_length); T = B x S tokens per
           step (packing fills rows to S; without packing S is the worst case, the longest row)
    r      LoRA rank;  m  adapted linear layers per decoder layer;  D  sum of their input widths
    U      parameters of one FSDP unit: a decoder layer (TRANSFORMER_BASED_WRAP wraps each), or the root unit
           (embeddings, final norm, output head)

The component formulas are in the docstrings of the `_...` functions below, each next to the code computing it.
Everything here was measured against this stack (torch 2.13, transformers 5.24, trl 1.16, peft 0.21,
bitsandbytes 0.50): activation coefficients against autograd's saved tensors of a real model
(tests/unit/test_plan.py), CPU peak RSS against real `accelerate launch` runs (bench/memory_plan.py). The GPU
numbers are a prediction of `torch.cuda.max_memory_allocated` plus the CUDA context; nvidia-smi shows the caching
allocator's *reserved* memory, typically 5-15% more (`allocator_reserve` row).

Where the published figures of the guide's two runs come from: PEFT's "Use PEFT and FSDP" guide (72-80 GB/GPU for
LoRA on 8x80 GB; QLoRA on 2x24 GB: 19.6 GB/GPU with CPU offload and ~107 GB host RAM, 35.6 GB/GPU without). The
Llama-2-70B config in configs/models/llama-2-70b is written from the published architecture (see its README.txt).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .args import ConfigError

GIB = 2 ** 30
UPSTREAM_SAVE_ROW = "upstream's final save (rank 0)"
MIB = 2 ** 20
REPO = Path(__file__).resolve().parents[1]

# Hub ids whose architecture ships with the recipe, so the guide's recipes plan offline.
KNOWN_MODEL_CONFIGS = {"meta-llama/Llama-2-70b-hf": REPO / "configs" / "models" / "llama-2-70b"}

# The guide's published per-GPU figures (GiB as nvidia-smi shows them) for its two runs.
PUBLISHED = {
    "lora-8x80": {"gpu_gib": (72.0, 80.0), "what": "LoRA r=8 all-linear, 8x80 GB, FULL_SHARD, bf16, seq 2048"},
    "qlora-2x24-offload": {"gpu_gib": (19.6, 19.6), "host_gib": 107.0,
                           "what": "QLoRA, 2x24 GB, FULL_SHARD + CPU offload"},
    "qlora-2x24": {"gpu_gib": (35.6, 35.6), "what": "QLoRA, 2x24 GB, FULL_SHARD, no offload"},
}

# ---- activation coefficients (bytes per token per decoder layer), Llama-style block (RMSNorm, RoPE, SwiGLU) ----
# Measured with autograd's saved-tensor hooks on LlamaForCausalLM + LoRA (all-linear), SDPA/flash attention, for
# fp32 (a=4) and bf16 weights under bf16 autocast (a=2); tests/unit/test_plan.py re-measures them.
#   saved per token per layer = ACT_H[a]*h + ACT_I[a]*i + ACT_KV[a]*kv + a*r*m + ACT_C0[a]
# a*h terms: the two RMSNorms keep fp32 copies of their input whatever a is, which is why ACT_H does not halve.
ACT_H = {4: 24, 2: 24}
ACT_I = {4: 16, 2: 8}      # gate, up, act(gate), act*up: 4 tensors of width i
ACT_KV = {4: 8, 2: 4}      # rotated k and v
ACT_C0 = {4: 232, 2: 120}  # per-token scalars (RMSNorm statistics, attention log-sum-exp, ...)

# ---- CPU calibration (peak RSS per rank, Linux glibc malloc, torch 2.13 CPU, 1 thread per rank) ----
# Process after importing torch + transformers + trl + peft (~480 MiB) and building tokenizer, data and trainer:
CPU_FIXED_MIB = 530.0
# glibc keeps freed activation memory in the heap: the RSS growth of a training step is this many times the saved
# activations of ALL layers without checkpointing (L*T*c). Fitted on 77M-parameter 1024x8 Llama runs with T = 256 and
# 1024 tokens (bench/memory_plan.py): without checkpointing 1.9-2.1; with it 1.0 (T=256) to 1.3 (T=1024) -- the
# heap keeps more than the live activations, so checkpointing lowers CPU peaks less than GPU peaks.
CPU_HEAP_FACTOR_NO_CHECKPOINTING = 2.0
CPU_HEAP_FACTOR_CHECKPOINTING = 1.2
# 4-bit runs, relative to the same LoRA run: with checkpointing they grew 0.56x (in-process) to 0.74-0.79x (FSDP2);
# without it 1.0-1.8x (three launches of one setup: 249, 369 and 439 MiB). Measured averages, not derived.
CPU_HEAP_FACTOR_4BIT = {True: 0.8, False: 1.4}  # keyed by gradient checkpointing
# FSDP on gloo: extra heap per rank during a step, in unsharded decoder layers (all-gather buffers, gloo's flat
# copies, gradient reduce-scatter inputs): 4.7-6.7 layers without checkpointing, 0-1.6 with it (the activation
# heap absorbs them). FSDP2's ranks differ from each other by up to ~100 MiB from launch to launch, either way.
CPU_FSDP_STEP_UNITS = {False: 5.5, True: 1.0}  # keyed by gradient checkpointing

# ---- GPU framework overhead defaults ----
DEFAULT_CUDA_CONTEXT_GIB = 1.0   # CUDA context + cuBLAS workspaces + NCCL buffers, per process
DEFAULT_ALLOCATOR_RESERVE = 0.10  # caching allocator: reserved beyond allocated, as a fraction of the transient part
DEFAULT_HOST_RUNTIME_GIB = 3.0   # host RSS of one CUDA PyTorch process (libraries, kernels, Python)

OPTIMIZER_STATE = {
    # name: (bytes per trainable parameter, or None = param dtype bytes x this many states, note)
    "adamw_torch": ("param", 2), "adamw_torch_fused": ("param", 2), "adamw_torch_xla": ("param", 2),
    "adamw_torch_npu_fused": ("param", 2), "adamw_anyprecision": ("param", 2), "paged_adamw_32bit": (4.0, 2),
    "adamw_bnb_8bit": (1.0 + 4 / 256, 2), "adamw_8bit": (1.0 + 4 / 256, 2), "paged_adamw_8bit": (1.0 + 4 / 256, 2),
    "adamw_torch_8bit": (1.0 + 4 / 256, 2), "adamw_torch_4bit": (0.5 + 4 / 128, 2),
    "lion_32bit": (4.0, 1), "paged_lion_32bit": (4.0, 1), "lion_8bit": (1.0 + 4 / 256, 1),
    "paged_lion_8bit": (1.0 + 4 / 256, 1), "sgd": ("param", 0), "adagrad": ("param", 1), "rmsprop": ("param", 1),
    "ademamix": ("param", 3), "ademamix_8bit": (1.0 + 4 / 256, 3), "adafactor": ("factored", 1),
}
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


# ====================================================================================================== model shape


@dataclass(frozen=True)
class Linear:
    name: str  # leaf name: q_proj, down_proj, ...
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from the architecture, counted on the meta device."""

    source: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    kv_width: int  # num_key_value_heads x head_dim
    head_dim: int
    vocab_size: int
    total_params: int
    layer_params: int  # one decoder layer (an FSDP unit)
    root_params: int  # everything outside the decoder layers (embeddings, final norm, output head)
    quantizable_params: int  # Q: weights of nn.Linear layers other than the output head
    quantizable_linears: int
    largest_linear_params: int
    layer_linears: tuple[Linear, ...]  # the nn.Linear layers of one decoder layer
    root_linears: tuple[Linear, ...]  # nn.Linear outside the layers (the output head, ...)
    output_head: str  # leaf name of the output head
    checkpoint_bytes: int  # size of the weights on disk (safetensors files, else P x config dtype)

    def lora_params(self, r: int, targets: str | list[str], dora: bool = False) -> int:
        """LoRA parameters: sum over adapted linears of r*(in + out) (A is r x in, B is out x r); DoRA adds a magnitude
        vector of `out` per adapted linear. 'all-linear' adapts every linear but the output head (PEFT's rule)."""
        total = 0
        for lin in self.adapted_linears(targets):
            total += r * (lin.in_features + lin.out_features) + (lin.out_features if dora else 0)
        return total

    def adapted_linears(self, targets: str | list[str]) -> list[Linear]:
        per_layer = [lin for lin in self.layer_linears if _targeted(lin.name, targets, self.output_head)]
        root = [lin for lin in self.root_linears if _targeted(lin.name, targets, self.output_head)]
        return per_layer * self.num_layers + root

    def adapted_per_layer(self, targets: str | list[str]) -> list[Linear]:
        return [lin for lin in self.layer_linears if _targeted(lin.name, targets, self.output_head)]


def _targeted(name: str, targets: str | list[str], output_head: str) -> bool:
    if targets == "all-linear":
        return name != output_head
    return name in targets


def resolve_model_config_dir(model_name_or_path: str) -> tuple[str, str | None]:
    """Where to read the config: a local folder with config.json as is; a Hub id shipped in KNOWN_MODEL_CONFIGS from
    the shipped copy (offline); any other Hub id through AutoConfig (needs the Hub or its cache). Returns
    (path or id, note)."""
    local = Path(model_name_or_path)
    if (local / "config.json").is_file():
        return str(local), None
    if model_name_or_path in KNOWN_MODEL_CONFIGS:
        shipped = KNOWN_MODEL_CONFIGS[model_name_or_path]
        return str(shipped), f"architecture of {model_name_or_path} from {shipped.relative_to(REPO)} (offline copy)"
    return model_name_or_path, None


def model_shape(model_name_or_path: str, trust_remote_code: bool = False, extra_vocab: int = 0) -> ModelShape:
    """Count the architecture on the meta device: no weight is read or allocated.

    extra_vocab: rows the run adds to the embeddings (chat-template tokens), counted in embeddings and output head.
    """
    import torch

    from .model import meta_model

    where, note = resolve_model_config_dir(model_name_or_path)
    try:
        model = meta_model(where, trust_remote_code)
    except Exception as e:  # offline Hub id, missing folder, custom code not trusted
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError([
            f"--model_name_or_path {model_name_or_path}: its config could not be read ({first}). Fix: pass a local "
            "folder holding config.json (the planner never needs weights), e.g. configs/models/llama-2-70b for "
            "Llama-2-70B, or log in / go online for a Hub id."]) from None
    if extra_vocab:
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + extra_vocab, mean_resizing=False)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError([f"--model_name_or_path {model_name_or_path}: no decoder layer class found "
                           f"(_no_split_modules={sorted(layer_classes)}); the planner needs a transformer with "
                           "repeated decoder layers, as FSDP's TRANSFORMER_BASED_WRAP does."])
    output = model.get_output_embeddings()
    output_head = next(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is output)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    total = sum(p.numel() for p in model.parameters())
    layer_params = sum(p.numel() for p in layers[0].parameters())
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    layer_linears = tuple(Linear(n.rsplit(".", 1)[-1], m.in_features, m.out_features)
                          for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear))
    root_linears = tuple(Linear(n.rsplit(".", 1)[-1], m.in_features, m.out_features)
                         for n, m in linears if id(m.weight) not in in_layers)
    quantizable = [m for _, m in linears if m is not output]
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dtype = getattr(text, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    files = list(Path(where).glob("*.safetensors")) if Path(where).is_dir() else []
    checkpoint_bytes = sum(f.stat().st_size for f in files) or total * dtype.itemsize
    return ModelShape(
        source=note or where,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_layers=len(layers),
        kv_width=kv_heads * head_dim,
        head_dim=head_dim,
        vocab_size=output.weight.shape[0],
        total_params=total,
        layer_params=layer_params,
        root_params=total - layer_params * len(layers),
        quantizable_params=sum(m.weight.numel() for m in quantizable),
        quantizable_linears=len(quantizable),
        largest_linear_params=max(m.weight.numel() for _, m in linears),
        layer_linears=layer_linears,
        root_linears=root_linears,
        output_head=output_head,
        checkpoint_bytes=checkpoint_bytes,
    )


# ============================================================================================= what the run does


@dataclass(frozen=True)
class Distribution:
    """How the run is spread, from the accelerate YAML (or the launcher's environment) and --num_processes."""

    kind: str  # "single", "ddp" or "fsdp"
    num_processes: int
    num_machines: int = 1
    fsdp_version: int = 1
    sharding: str = "FULL_SHARD"
    offload: bool = False
    cpu_ram_efficient_loading: bool = False
    mixed_precision: str = "no"  # accelerate's mixed_precision: no|bf16|fp16

    @property
    def per_machine(self) -> int:
        return max(1, self.num_processes // max(1, self.num_machines))

    @property
    def shard_group(self) -> int:
        """G: ranks each parameter is split over."""
        if self.kind != "fsdp" or self.sharding == "NO_SHARD":
            return 1
        if self.sharding.startswith("HYBRID"):
            return self.per_machine
        return self.num_processes

    @property
    def reshards_after_forward(self) -> bool:
        return self.sharding in ("FULL_SHARD", "HYBRID_SHARD")

    def describe(self) -> str:
        if self.kind == "single":
            return "1 process"
        if self.kind == "ddp":
            return f"DDP, {self.num_processes} processes"
        off = ", CPU offload" if self.offload else ""
        return f"FSDP{self.fsdp_version} {self.sharding}, {self.num_processes} processes{off}"


@dataclass(frozen=True)
class Workload:
    """What one rank computes, from the train.py flags."""

    micro_batch: int
    grad_accum: int
    seq_len: int
    packing: bool
    gradient_checkpointing: bool
    lora: bool
    lora_r: int
    lora_targets: str | tuple[str, ...]
    lora_dropout: float
    dora: bool
    quant: str | None  # None, "4bit", "8bit"
    double_quant: bool
    load_bytes: int  # b: bytes per base weight as loaded
    compute_bytes: int  # a
    optimizer: str
    flash_attention: bool
    extra_vocab: int

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


# ========================================================================================================= the plan


@dataclass
class Row:
    name: str
    bytes: float
    formula: str
    where: str = "gpu"  # gpu|host

    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class LadderStep:
    change: str
    how: str
    per_rank_gib: float
    fits: bool


@dataclass
class MemoryPlan:
    device: str
    model: str
    setup: str
    budget_gib: float
    rows: list[Row]
    phases: dict[str, float]  # phase -> per-rank peak bytes
    host_rows: list[Row]
    host_peak_bytes: float
    notes: list[str] = field(default_factory=list)
    ladder: list[LadderStep] = field(default_factory=list)
    per_rank_bytes: list[float] = field(default_factory=list)  # peak of each rank (rank 0 can differ)

    @property
    def peak_bytes(self) -> float:
        return max(self.per_rank_bytes) if self.per_rank_bytes else max(self.phases.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def headroom_gib(self) -> float:
        return self.budget_gib - self.peak_gib

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "model": self.model, "setup": self.setup, "budget_gib": self.budget_gib,
            "peak_gib": round(self.peak_gib, 3), "headroom_gib": round(self.headroom_gib, 3), "fits": self.fits,
            "per_rank_gib": [round(b / GIB, 3) for b in self.per_rank_bytes],
            "per_rank_mib": [round(b / MIB, 1) for b in self.per_rank_bytes],
            "phases_gib": {k: round(v / GIB, 3) for k, v in self.phases.items()},
            "rows": [{"name": r.name, "gib": round(r.gib(), 3), "formula": r.formula} for r in self.rows],
            "host_rows": [{"name": r.name, "gib": round(r.gib(), 3), "formula": r.formula} for r in self.host_rows],
            "host_peak_gib": round(self.host_peak_bytes / GIB, 3),
            "ladder": [asdict(s) for s in self.ladder], "notes": list(self.notes),
        }

    def render(self) -> str:
        unit = "GiB"
        what = "GPU memory per rank" if self.device == "cuda" else "peak RSS per rank (CPU run)"
        lines = [f"memory plan: {self.model}", f"  setup: {self.setup}", f"  {what}:"]
        width = max(len(r.name) for r in self.rows) + 2
        for r in self.rows:
            lines.append(f"    {r.name:<{width}}{r.gib():>9.2f} {unit}   {r.formula}")
        lines.append(f"    {'peak (largest phase)':<{width}}{self.peak_gib:>9.2f} {unit}   phases: " + ", ".join(
            f"{k} {v / GIB:.2f}" for k, v in self.phases.items()))
        if self.per_rank_bytes and len(set(round(b) for b in self.per_rank_bytes)) > 1:
            lines.append("    per rank: " + ", ".join(f"rank {i} {b / GIB:.2f}" for i, b in
                                                       enumerate(self.per_rank_bytes)))
        if self.host_rows:
            lines.append("  host RAM per machine:")
            hw = max(len(r.name) for r in self.host_rows) + 2
            for r in self.host_rows:
                lines.append(f"    {r.name:<{hw}}{r.gib():>9.2f} {unit}   {r.formula}")
            lines.append(f"    {'peak':<{hw}}{self.host_peak_bytes / GIB:>9.2f} {unit}")
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines.append(f"verdict: {verdict} in {self.budget_gib:g} GiB per "
                     f"{'GPU' if self.device == 'cuda' else 'rank'}: peak {self.peak_gib:.2f} GiB, headroom "
                     f"{self.headroom_gib:+.2f} GiB")
        if self.ladder:
            lines.append("cheapest changes that make it fit, in order (each includes the ones above it):")
            for k, s in enumerate(self.ladder, 1):
                mark = "fits" if s.fits else "still too big"
                lines.append(f"  {k}. {s.change}: {s.per_rank_gib:.2f} GiB per rank ({mark})   {s.how}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


# ============================================================================================== the formulas


def _base_weight_bytes(shape: ModelShape, w: Workload) -> tuple[float, float, str]:
    """Base weights as loaded: (shardable bytes, replicated bytes, formula).

    - not quantized: P x b (shardable).
    - 4-bit: packed weights Q/2 + the rest (P - Q) x b, both shardable (FSDP flattens the packed storage like any
      parameter); NF4/FP4 constants are replicated on every rank (they live in each weight's quant_state, not in a
      parameter FSDP shards): one absmax per block of 64 weights -- fp32 (Q/64 x 4) without double quantization; with
      it, uint8 (Q/64) plus an fp32 absmax per 256 blocks (Q/64/256 x 4) and a 256-entry fp32 code per linear.
    - 8-bit: Q x 1 + an fp32 scale per output row + (P - Q) x b (8-bit weights cannot be sharded).
    """
    P, Q, b = shape.total_params, shape.quantizable_params, w.load_bytes
    if w.quant == "4bit":
        if w.double_quant:
            const = Q / 64 + Q / 64 / 256 * 4 + shape.quantizable_linears * 256 * 4
            cformula = "Q/64 + Q/64/256*4"
        else:
            const = Q / 64 * 4
            cformula = "Q/64*4"
        return Q / 2 + (P - Q) * b, const, f"Q/2 + (P-Q)*{b} sharded; constants {cformula} replicated"
    if w.quant == "8bit":
        rows = sum(lin.out_features for lin in shape.layer_linears) * shape.num_layers
        return 0.0, Q + 4 * rows + (P - Q) * b, f"Q*1 + 4*rows + (P-Q)*{b} (not shardable)"
    return P * b, 0.0, f"P*{b}"


def _trainable(shape: ModelShape, w: Workload) -> tuple[int, int]:
    """(trainable parameters, bytes each). LoRA: fp32 (PEFT upcasts adapters), except QLoRA where TRL casts A/B to
    bf16 (DoRA magnitudes stay fp32). Full fine-tuning: every base parameter, in the load dtype."""
    if not w.lora:
        return shape.total_params, w.load_bytes
    count = shape.lora_params(w.lora_r, _targets(w), w.dora)
    return count, (2 if w.quant and not w.dora else 4)


def adapter_bytes(shape: ModelShape, w: Workload) -> tuple[float, str]:
    """What the saved adapter holds, which is all the final save gathers (sft_recipe/gather.py): the trainable
    tensors, plus the whole input embedding and output head when the vocabulary was resized (PEFT saves both)."""
    trainable, tbytes = _trainable(shape, w)
    total, formula = float(trainable * tbytes), f"{trainable:,} x {tbytes} B"
    if w.extra_vocab and w.lora:
        total += 2 * shape.vocab_size * shape.hidden_size * w.load_bytes
        formula += f" + 2 x V*h*{w.load_bytes} (resized embedding + head)"
    return total, formula


def _optimizer_bytes(shape: ModelShape, w: Workload, trainable: int, param_bytes: int) -> tuple[float, str]:
    """Optimizer state per trainable parameter: AdamW keeps 2 moments in the parameter's dtype (2 x 4 bytes for fp32
    LoRA); 8-bit optimizers keep 2 x (1 byte + an fp32 absmax per 256 values); Lion 1 moment; SGD without momentum
    none; Adafactor factored second moments, 4 x (rows + cols) per matrix."""
    kind, states = OPTIMIZER_STATE.get(w.optimizer, ("param", 2))
    if kind == "factored":
        if w.lora:
            mats = [(w.lora_r, lin.in_features) for lin in shape.adapted_linears(_targets(w))] + \
                   [(lin.out_features, w.lora_r) for lin in shape.adapted_linears(_targets(w))]
            return sum(4 * (r + c) for r, c in mats), "4*(rows+cols) per matrix (Adafactor)"
        return 4 * trainable ** 0.5 * 2, "4*(rows+cols) per matrix (Adafactor, approx.)"
    per = param_bytes if kind == "param" else kind
    return trainable * per * states, f"{states} x {per:g} B per trainable param ({w.optimizer})"


def _targets(w: Workload):
    return w.lora_targets if isinstance(w.lora_targets, str) else list(w.lora_targets)


def activation_bytes_per_token_per_layer(shape: ModelShape, w: Workload, device: str) -> float:
    """c: bytes autograd saves per token per decoder layer without checkpointing.

        c = ACT_H[a]*h + ACT_I[a]*i + ACT_KV[a]*kv + a*r*m + ACT_C0[a]
            + (a + mask_bytes) * D            when --lora_dropout > 0 (dropout output and mask per adapted input;
                                               mask_bytes = 1 on CUDA (bool), a on CPU)
            + 4*T + 4*h                        CPU SDPA with packed (padding-free) rows: the math kernel's
                                               block-diagonal mask, per layer
    """
    a = w.compute_bytes
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.kv_width
    adapted = shape.adapted_per_layer(_targets(w)) if w.lora else []
    c = ACT_H[a] * h + ACT_I[a] * i + ACT_KV[a] * kv + ACT_C0[a]
    if w.lora:
        c += a * w.lora_r * len(adapted)
        if w.lora_dropout > 0:
            mask = 1 if device == "cuda" else a
            c += (a + mask) * sum(lin.in_features for lin in adapted)
    if device == "cpu" and w.packing and not w.flash_attention:
        c += 4 * w.tokens + 4 * h
    return c


def _activation_rows(shape: ModelShape, w: Workload, device: str) -> list[Row]:
    """Activations of one micro-batch (T = B*S tokens).

    - saved for backward: without checkpointing L*T*c; with it only each layer's input, L*T*h*a.
    - recomputed layer (checkpointing only): T*c, one layer's activations rebuilt during its backward.
    - backward working set: 2*T*(h + i)*a, gradients flowing through the widest block.
    - output head (TRL's fused, chunked log-prob head): T*h*(4 + 2a) (fp32 gradient accumulator, saved input, cast
      back) + 2*min(T, 4096)*min(V, 32768)*a (logit tiles, forward and backward); the full T x V logits are never
      materialized.
    """
    a, T, L, h, i = w.compute_bytes, w.tokens, shape.num_layers, shape.hidden_size, shape.intermediate_size
    c = activation_bytes_per_token_per_layer(shape, w, device)
    rows = []
    if w.gradient_checkpointing:
        rows.append(Row("activations: checkpoints", L * T * h * a, f"L*T*h*a, T={T}, a={a}"))
        rows.append(Row("activations: recomputed layer", T * c, f"T*c, c={c:,.0f} B/token/layer"))
    else:
        rows.append(Row("activations: saved", L * T * c, f"L*T*c, T={T}, c={c:,.0f} B/token/layer"))
    rows.append(Row("activations: backward working set", 2 * T * (h + i) * a, "2*T*(h+i)*a"))
    head = T * h * (4 + 2 * a) + 2 * min(T, 4096) * min(shape.vocab_size, 32768) * a
    rows.append(Row("activations: output head", head, "T*h*(4+2a) + 2*min(T,4096)*min(V,32768)*a (chunked)"))
    return rows


def _gather_bytes(shape: ModelShape, w: Workload, d: Distribution) -> tuple[float, str]:
    """FSDP all-gather buffers: FULL_SHARD keeps the root unit (embeddings, norm, head: not resharded between
    forward and backward) plus 2 decoder-layer units (the one computing and the one prefetched) unsharded;
    SHARD_GRAD_OP keeps every unit unsharded from forward to backward. Gathered in the compute dtype under mixed
    precision (2 bytes), else as stored (4-bit: U/2 + non-quantized x b). With 4-bit weights the linear being
    computed is also dequantized: + largest linear x a."""
    if d.kind != "fsdp" or d.shard_group == 1:
        return 0.0, "no sharding"
    layer_q = sum(lin.in_features * lin.out_features for lin in shape.layer_linears)
    g = 2 if d.mixed_precision in ("bf16", "fp16") else w.load_bytes
    if w.quant == "4bit":
        layer = layer_q / 2 + (shape.layer_params - layer_q) * w.load_bytes
        root = shape.root_params * w.load_bytes
        dequant = shape.largest_linear_params * w.compute_bytes
    else:
        layer, root, dequant = shape.layer_params * g, shape.root_params * g, 0.0
    if d.reshards_after_forward:
        total, formula = root + 2 * layer, "root + 2 x layer unit"
    else:
        total, formula = root + shape.num_layers * layer, "every unit (no reshard after forward)"
    if dequant:
        total += dequant
        formula += " + dequantized largest linear"
    return total, formula


def _gpu_estimate(shape: ModelShape, w: Workload, d: Distribution, knobs: dict) -> tuple[list[Row], dict, list[Row]]:
    """GPU memory of one rank, and host RAM of one machine.

    train step = base weights/G (0 when offloaded) + replicated 4-bit constants + (trainable + gradients +
                 optimizer)/G (0 when offloaded) + activations + all-gather buffers
                 + allocator_reserve x (activations + buffers) + cuda_context_gib
    load+wrap  = weights/G + one decoder layer moved whole (load dtype) + cuda_context_gib
    host       = runtime (n x host_runtime_gib) + max(loading, offloaded + final save), where
                 loading     = one copy of the loaded weights on local rank 0 and none on the others
                               (cpu_ram_efficient_loading, not quantized), else one copy per rank,
                 offloaded   = (weights + trainable + gradients + optimizer) x n/G,
                 final save  = 2 x the adapter's bytes on rank 0 (gathered, then written): sft_recipe/gather.py
                               gathers only what the adapter holds. Upstream's FULL_STATE_DICT save gathers every
                               weight there instead: listed as a note, not in the peak.
    The checkpoint files also pass through the page cache (reclaimable, listed, not in the peak).
    """
    G, n = d.shard_group, d.per_machine
    shardable, replicated, wformula = _base_weight_bytes(shape, w)
    trainable, tbytes = _trainable(shape, w)
    opt, oformula = _optimizer_bytes(shape, w, trainable, tbytes)
    on_gpu = 0.0 if d.offload else 1.0
    sharded = G if d.kind == "fsdp" else 1
    rows = [
        Row("base weights", on_gpu * shardable / sharded + replicated,
            f"({wformula})" + (f" / G, G={G}" if sharded > 1 else "") + (" -- offloaded to CPU" if d.offload else "")),
        Row("LoRA/DoRA params" if w.lora else "trainable params", on_gpu * trainable * tbytes / sharded,
            f"{trainable:,} x {tbytes} B" + (f" / {G}" if sharded > 1 else "")),
        Row("gradients", on_gpu * trainable * tbytes / sharded, "same as trainable params"),
        Row("optimizer state", on_gpu * opt / sharded, oformula + (f" / {G}" if sharded > 1 else "")),
    ]
    rows += _activation_rows(shape, w, "cuda")
    gather, gformula = _gather_bytes(shape, w, d)
    if d.offload and d.kind == "fsdp":  # the shard is copied host->device before its all-gather
        gather += shape.layer_params * (2 if d.mixed_precision != "no" else w.load_bytes) / G
        gformula += " + host->device copy of a shard"
    rows.append(Row("FSDP all-gather buffers", gather, gformula))
    transient = sum(r.bytes for r in rows if r.name.startswith("activations")) + gather
    rows.append(Row("allocator reserve", knobs["allocator_reserve"] * transient,
                    f"{knobs['allocator_reserve']:.0%} of activations + buffers (reserved > allocated)"))
    rows.append(Row("framework overhead", knobs["cuda_context_gib"] * GIB,
                    "CUDA context, cuBLAS, NCCL (--cuda_context_gib)"))
    step = sum(r.bytes for r in rows)
    # Wrapping: each rank's shard plus one layer moved to the GPU whole (in the load dtype) before it is sharded.
    wrap = (on_gpu * shardable / sharded + replicated + shape.layer_params * w.load_bytes
            + knobs["cuda_context_gib"] * GIB)
    phases = {"train step": step, "load+wrap": wrap}

    # Host RAM per machine.
    full_loaded = shardable + replicated
    host = [Row("runtime", n * knobs["host_runtime_gib"] * GIB, f"{n} processes x {knobs['host_runtime_gib']:g} GiB "
                "(CUDA libraries, Python; --host_runtime_gib)", "host")]
    if d.kind == "fsdp" and d.cpu_ram_efficient_loading and not w.quant:
        load = full_loaded
        lformula = "one copy of the weights as loaded, on local rank 0; 0 on the others (cpu_ram_efficient_loading)"
    elif d.kind == "fsdp" and d.cpu_ram_efficient_loading:
        load = n * full_loaded
        lformula = (f"{n} cop{'y' if n == 1 else 'ies'} of the 4-bit weights: every rank quantizes its own (accelerate "
                    "broadcasts no Params4bit from rank 0)")
    else:
        load = n * full_loaded
        lformula = f"{n} cop{'y' if n == 1 else 'ies'} of the weights as loaded (one per process)"
    host.append(Row("loading", load, lformula, "host"))
    offloaded = 0.0
    if d.offload:
        offloaded = (shardable + (2 * trainable * tbytes + opt)) * n / G
        host.append(Row("offloaded shards", offloaded, "(weights + trainable + grads + optimizer) x n/G", "host"))
    adapter, aformula = adapter_bytes(shape, w)
    save = 2 * adapter
    host.append(Row("final save (rank 0)", save, f"2 x adapter ({aformula}): only what the adapter holds", "host"))
    notes = [Row("page cache (reclaimable)", shape.checkpoint_bytes, "checkpoint files read through the page cache",
                 "note")]
    if d.kind == "fsdp":
        notes.append(Row(UPSTREAM_SAVE_ROW, shardable + replicated,
                         "FULL_STATE_DICT gathers every weight to rank 0's RAM (not in the peak)", "note"))
    host_peak = host[0].bytes + max(load, offloaded + save)
    return rows, phases, host + notes, host_peak


def _cpu_estimate(shape: ModelShape, w: Workload, d: Distribution, rank: int) -> tuple[list[Row], dict]:
    """Peak RSS of one rank of a CPU run (fp32, gloo), measured behaviour of this stack:

    - fixed: CPU_FIXED_MIB (imports ~480 MiB + tokenizer, data, trainer).
    - checkpoint pages: safetensors are memory-mapped; every rank that reads them has the file's pages resident.
      Without FSDP the loaded tensors *are* those pages (same dtype) or keep the mapping alive (quantized models
      keep their embeddings/head in it), for the whole run. FSDP copies weights into flat shards and drops the
      mapping after wrapping. FSDP2 with cpu_ram_efficient_loading: only rank 0 reads (LoRA); QLoRA loads on every
      rank.
    - loaded copies: 4-bit: the packed weights + constants (anonymous memory); a dtype change: a copy.
    - FSDP shards: base weights / G. Wrapping also holds one unsharded unit.
    - step: trainable + gradients + optimizer state, plus the heap the step's activations leave behind: glibc keeps
      freed activation memory, so RSS grows by CPU_HEAP_FACTOR x L*T*c (c: bytes per token per layer, fp32) --
      checkpointing lowers it less than it lowers the live activations (x CPU_HEAP_FACTOR_4BIT for 4-bit runs);
      plus CPU_FSDP_STEP_UNITS unsharded decoder layers of gloo/FSDP buffers.
    - final save (rank 0): 2 x the adapter's bytes above the train step's memory (the adapter gathered, then
      written); upstream's full gather would add every weight (the `upstream's final save` host row on GPU).
    """
    shardable, replicated, _ = _base_weight_bytes(shape, w)
    trainable, tbytes = _trainable(shape, w)
    opt, _ = _optimizer_bytes(shape, w, trainable, tbytes)
    G = d.shard_group
    fsdp = d.kind == "fsdp"
    reads_file = not (fsdp and d.fsdp_version == 2 and d.cpu_ram_efficient_loading and rank > 0 and not w.quant)
    file_pages = shape.checkpoint_bytes if reads_file else 0.0
    ckpt_dtype_bytes = shape.checkpoint_bytes / max(1, shape.total_params)
    same_dtype = abs(ckpt_dtype_bytes - w.load_bytes) < 0.05 * w.load_bytes
    loaded_copy = (shardable + replicated) if w.quant else (0.0 if same_dtype else shardable)
    if w.quant == "4bit":  # embeddings/head stay views of the mapping
        loaded_copy -= (shape.total_params - shape.quantizable_params) * w.load_bytes if same_dtype else 0.0
    layer_q = sum(lin.in_features * lin.out_features for lin in shape.layer_linears)
    unit = (layer_q / 2 + (shape.layer_params - layer_q) * w.load_bytes if w.quant == "4bit"
            else shape.layer_params * w.load_bytes)  # one unsharded decoder layer as stored
    fixed = CPU_FIXED_MIB * MIB
    c = activation_bytes_per_token_per_layer(shape, w, "cpu")
    heap_factor = CPU_HEAP_FACTOR_CHECKPOINTING if w.gradient_checkpointing else CPU_HEAP_FACTOR_NO_CHECKPOINTING
    if w.quant:
        heap_factor *= CPU_HEAP_FACTOR_4BIT[w.gradient_checkpointing]
    heap = heap_factor * shape.num_layers * w.tokens * c
    train_state = trainable * tbytes * 2 + opt
    rows = [Row("fixed (imports, tokenizer, data, trainer)", fixed, f"{CPU_FIXED_MIB:g} MiB measured")]
    if fsdp:
        shard = (shardable + replicated) / G
        units = CPU_FSDP_STEP_UNITS[w.gradient_checkpointing]
        fsdp_step = units * unit if G > 1 else 0.0
        rows += [
            Row("checkpoint pages + loaded copies", file_pages + loaded_copy,
                "mmapped safetensors (+ 4-bit weights), load+wrap phase only"),
            Row("base weights (shard)", shard, f"(P*b)/G, G={G}"),
            Row("trainable + grads + optimizer", train_state / G, "(2*trainable + optimizer)/G"),
            Row("activations (heap after a step)", heap, f"{heap_factor:g} x L*T*c, T={w.tokens}, c={c:,.0f}"),
            Row("FSDP step buffers", fsdp_step, f"{units:g} x one unsharded layer"),
        ]
        wrap = fixed + file_pages + loaded_copy + shard + unit
        step = fixed + shard + train_state / G + heap + fsdp_step
        phases = {"load+wrap": wrap, "train step": step}
        if rank == 0:
            phases["final save"] = step + 2 * adapter_bytes(shape, w)[0]
        return rows, phases
    rows += [
        Row("checkpoint pages (mmap)", file_pages, "safetensors file size"),
        Row("loaded copies", loaded_copy, "quantized weights / dtype conversions"),
        Row("trainable + grads + optimizer", train_state, "2*trainable + optimizer"),
        Row("activations (heap after a step)", heap, f"{heap_factor:g} x L*T*c, T={w.tokens}, c={c:,.0f}"),
    ]
    step = sum(r.bytes for r in rows)
    return rows, {"load": fixed + file_pages + loaded_copy, "train step": step}


# ================================================================================================ from the flags


def read_accelerate_config(accelerate_config: dict | str | os.PathLike | None) -> dict:
    """The accelerate YAML as a dict: a path, a dict, "env" (the launcher's FSDP_* variables, for train.py), or None
    (one process)."""
    if accelerate_config is None:
        return {"distributed_type": "NO", "num_processes": 1}
    if isinstance(accelerate_config, dict):
        return accelerate_config
    if str(accelerate_config) == "env":
        return accelerate_config_from_env()
    path = Path(accelerate_config)
    if not path.is_file():
        raise ConfigError([f"--config_file {accelerate_config}: no such file. Fix: pass an accelerate YAML, e.g. "
                           "configs/fsdp_config.yaml."])
    import yaml

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"--config_file {accelerate_config}: not valid YAML ({e})."]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"--config_file {accelerate_config}: must be a mapping (accelerate's YAML), "
                           f"not {type(raw).__name__}."])
    return raw


def accelerate_config_from_env() -> dict:
    """Rebuild the accelerate config from what `accelerate launch` exports to each rank."""
    env = os.environ.get
    fsdp = env("ACCELERATE_USE_FSDP", "false").lower() == "true"
    world = int(env("WORLD_SIZE", "1"))
    local = int(env("LOCAL_WORLD_SIZE", str(world)))
    cfg: dict[str, Any] = {
        "distributed_type": "FSDP" if fsdp else ("MULTI_GPU" if world > 1 else "NO"),
        "num_processes": world, "num_machines": max(1, world // max(1, local)),
        "mixed_precision": env("ACCELERATE_MIXED_PRECISION", "no"),
    }
    if fsdp:
        cfg["fsdp_config"] = {
            "fsdp_version": int(env("FSDP_VERSION", "1")),
            "fsdp_sharding_strategy": env("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
            "fsdp_reshard_after_forward": env("FSDP_RESHARD_AFTER_FORWARD", "true"),
            "fsdp_offload_params": env("FSDP_OFFLOAD_PARAMS", "false").lower() == "true",
            "fsdp_cpu_ram_efficient_loading": env("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true",
        }
    return cfg


def distribution(cfg: dict, num_processes: int | None = None, training_args=None) -> Distribution:
    kind_raw = str(cfg.get("distributed_type", "NO")).upper()
    kinds = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp"}
    if kind_raw not in kinds:
        raise ConfigError([f"accelerate config: distributed_type {kind_raw} is not planned here (NO, MULTI_GPU, "
                           "MULTI_CPU, FSDP are). Fix: use one of configs/*.yaml."])
    n = int(num_processes or cfg.get("num_processes") or 1)
    if n < 1:
        raise ConfigError([f"--num_processes {n}: must be at least 1."])
    machines = int(cfg.get("num_machines") or 1)
    kind = kinds[kind_raw] if n > 1 or kind_raw == "FSDP" else "single"
    mp = str(cfg.get("mixed_precision", "no")).lower()
    if training_args is not None and getattr(training_args, "bf16", False):
        mp = "bf16"
    elif training_args is not None and getattr(training_args, "fp16", False):
        mp = "fp16"
    fc = cfg.get("fsdp_config") or {}
    version = int(fc.get("fsdp_version", 1))
    sharding = "FULL_SHARD"
    if version == 2:
        raf = fc.get("fsdp_reshard_after_forward", True)
        sharding = "FULL_SHARD" if str(raf).lower() in ("true", "1", "full_shard") else "SHARD_GRAD_OP"
    else:
        raw = fc.get("fsdp_sharding_strategy", fc.get("fsdp_reshard_after_forward", "FULL_SHARD"))
        raw = str(raw).upper()
        if raw.isdigit() and 1 <= int(raw) <= len(SHARDING_STRATEGIES):
            raw = SHARDING_STRATEGIES[int(raw) - 1]
        if raw in ("TRUE",):
            raw = "FULL_SHARD"
        if raw not in SHARDING_STRATEGIES:
            raise ConfigError([f"accelerate config: fsdp_sharding_strategy {raw} is unknown. Fix: one of "
                               f"{', '.join(SHARDING_STRATEGIES)}."])
        sharding = raw
    return Distribution(
        kind=kind, num_processes=n, num_machines=machines, fsdp_version=version, sharding=sharding,
        offload=kind == "fsdp" and bool(fc.get("fsdp_offload_params", False)),
        cpu_ram_efficient_loading=kind == "fsdp" and bool(fc.get("fsdp_cpu_ram_efficient_loading", False)),
        mixed_precision=mp,
    )


def workload(model_args, data_args, training_args, device: str, dora: bool = False) -> Workload:
    from .model import CHAT_FORMATS, DTYPES, lora_target_modules, model_dtype

    quant = "4bit" if model_args.use_4bit_quantization else ("8bit" if model_args.use_8bit_quantization else None)
    load_bytes = model_dtype(model_args).itemsize
    bf16 = bool(getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False))
    compute = 2 if (bf16 or load_bytes == 2) else 4
    if quant == "4bit" and DTYPES[model_args.bnb_4bit_compute_dtype].itemsize == 2:
        compute = 2
    fmt = CHAT_FORMATS.get(model_args.chat_template_format)
    extra_vocab = (len(fmt.extra_special_tokens) + 1) if fmt else 0  # + pad
    targets = lora_target_modules(model_args)
    seq = training_args.max_length or 1024
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name mirrors it).
    checkpointing = getattr(training_args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = training_args.gradient_checkpointing
    return Workload(
        micro_batch=training_args.per_device_train_batch_size,
        grad_accum=training_args.gradient_accumulation_steps,
        seq_len=seq,
        packing=bool(training_args.packing),
        gradient_checkpointing=bool(checkpointing),
        lora=bool(model_args.use_peft_lora),
        lora_r=model_args.lora_r,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        lora_dropout=model_args.lora_dropout,
        dora=bool(dora or getattr(model_args, "use_dora", False)),
        quant=quant,
        double_quant=bool(model_args.use_nested_quant),
        load_bytes=load_bytes,
        compute_bytes=compute,
        optimizer=str(getattr(training_args.optim, "value", training_args.optim)),
        flash_attention=bool(model_args.use_flash_attn) and device == "cuda",
        extra_vocab=extra_vocab,
    )


def _check_inputs(gpu_memory_gib, device: str, d: Distribution, w: Workload) -> None:
    problems = []
    if device not in ("cuda", "cpu"):
        problems.append(f"device {device!r}: must be 'cuda' (GPU memory) or 'cpu' (peak RSS of a CPU run).")
    try:
        budget = float(gpu_memory_gib)
        if not budget > 0:
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"--gpu_memory_gib {gpu_memory_gib!r}: must be a positive number of GiB (e.g. 80 for an "
                        "80 GB GPU, 24 for a 24 GB one).")
    if w.micro_batch < 1 or w.grad_accum < 1 or w.seq_len < 1:
        problems.append(f"--per_device_train_batch_size {w.micro_batch} / --gradient_accumulation_steps "
                        f"{w.grad_accum} / --max_length {w.seq_len}: each must be at least 1.")
    if device == "cpu" and d.offload:
        problems.append("fsdp_offload_params: true on a CPU run: torch pins the offloaded shards in page-locked "
                        "memory, which needs a GPU (\"Cannot access accelerator device\"). Fix: plan it with "
                        "--device cuda, or drop fsdp_offload_params for the CPU run.")
    if problems:
        raise ConfigError(problems)


def plan_memory(model_args, data_args, training_args, accelerate_config: dict | str | None = None,
                num_processes: int | None = None, gpu_memory_gib: float = 80.0, device: str = "cuda", *,
                cuda_context_gib: float = DEFAULT_CUDA_CONTEXT_GIB,
                allocator_reserve: float = DEFAULT_ALLOCATOR_RESERVE,
                host_runtime_gib: float = DEFAULT_HOST_RUNTIME_GIB, dora: bool = False, ladder: bool = True,
                shape: ModelShape | None = None) -> MemoryPlan:
    """Plan one run's memory. `accelerate_config`: YAML path, dict, "env" (inside `accelerate launch`) or None (one
    process). `device`: "cuda" predicts GPU memory per rank; "cpu" predicts peak RSS per rank of a CPU run."""
    cfg = read_accelerate_config(accelerate_config)
    d = distribution(cfg, num_processes, training_args)
    w = workload(model_args, data_args, training_args, device, dora)
    _check_inputs(gpu_memory_gib, device, d, w)
    if shape is None:
        shape = model_shape(model_args.model_name_or_path, bool(getattr(training_args, "trust_remote_code", False)),
                            w.extra_vocab)
    knobs = {"cuda_context_gib": cuda_context_gib, "allocator_reserve": allocator_reserve,
             "host_runtime_gib": host_runtime_gib}
    plan = _plan(shape, w, d, float(gpu_memory_gib), device, knobs)
    if ladder and not plan.fits:
        plan.ladder = fit_ladder(shape, w, d, float(gpu_memory_gib), device, knobs)
    return plan


def _plan(shape: ModelShape, w: Workload, d: Distribution, budget: float, device: str, knobs: dict) -> MemoryPlan:
    notes = []
    flags = [f"B={w.micro_batch} x accumulation {w.grad_accum}", f"seq {w.seq_len}",
             "checkpointing" if w.gradient_checkpointing else "no checkpointing",
             (f"{'DoRA' if w.dora else 'LoRA'} r={w.lora_r}" if w.lora else "full fine-tuning"),
             {"4bit": "4-bit NF4" + (" + double quant" if w.double_quant else ""), "8bit": "8-bit"}.get(w.quant, "") or
             f"weights {w.load_bytes} B", f"activations {w.compute_bytes} B", w.optimizer]
    setup = f"{d.describe()}; " + ", ".join(f for f in flags if f)
    if device == "cuda":
        rows, phases, host_rows, host_peak = _gpu_estimate(shape, w, d, knobs)
        per_rank = [max(phases.values())] * d.num_processes
        if not w.flash_attention and w.packing:
            notes.append("SDPA with packed rows builds a T x T block mask; --use_flash_attn True avoids it.")
    else:
        rows, phases = _cpu_estimate(shape, w, d, 0)
        per_rank = [max(phases.values())]
        for rank in range(1, d.num_processes):
            per_rank.append(max(_cpu_estimate(shape, w, d, rank)[1].values()))
        host_rows, host_peak = [], 0.0
        notes.append("CPU mode: constants measured on this stack with glibc malloc (see bench/memory_plan.py).")
    notes.append(f"model: {shape.source}: {shape.total_params:,} params, {shape.num_layers} layers")
    return MemoryPlan(device=device, model=shape.source, setup=setup, budget_gib=budget, rows=rows, phases=phases,
                      host_rows=host_rows, host_peak_bytes=host_peak, notes=notes, per_rank_bytes=per_rank)


def _peak(shape, w, d, budget, device, knobs) -> float:
    return _plan(shape, w, d, budget, device, knobs).peak_gib


def fit_ladder(shape: ModelShape, w: Workload, d: Distribution, budget: float, device: str,
               knobs: dict) -> list[LadderStep]:
    """The cheapest changes, applied one after the other, until the run fits:
    1. gradient checkpointing; 2. FULL_SHARD (FSDP over the same GPUs); 3. a smaller micro-batch with more
    accumulation (same global batch); 4. 4-bit weights (QLoRA, with LoRA); 5. CPU offload (GPU only); 6. more GPUs.
    A step is listed only when it lowers the peak."""
    steps: list[LadderStep] = []
    current = _peak(shape, w, d, budget, device, knobs)

    def consider(change: str, how: str, w2: Workload, d2: Distribution) -> bool:
        nonlocal w, d, current
        peak = _peak(shape, w2, d2, budget, device, knobs)
        if peak >= current - 1e-9:
            return False
        w, d, current = w2, d2, peak
        steps.append(LadderStep(change, how, round(peak, 3), peak <= budget))
        return peak <= budget

    if not w.gradient_checkpointing and consider(
            "gradient checkpointing", "--gradient_checkpointing True", replace(w, gradient_checkpointing=True), d):
        return steps
    if d.num_processes > 1 and not (d.kind == "fsdp" and d.sharding == "FULL_SHARD"):
        d2 = replace(d, kind="fsdp", sharding="FULL_SHARD")
        if consider("FULL_SHARD", "--config_file configs/fsdp_config.yaml (fsdp_sharding_strategy: FULL_SHARD)",
                    w, d2):
            return steps
    if w.micro_batch > 1:
        global_batch = w.micro_batch * w.grad_accum
        for b in [x for x in range(w.micro_batch - 1, 0, -1) if w.micro_batch % x == 0]:
            w2 = replace(w, micro_batch=b, grad_accum=global_batch // b)
            if _peak(shape, w2, d, budget, device, knobs) <= budget or b == 1:
                if consider(f"micro-batch {b}, accumulation {global_batch // b} (same global batch)",
                            f"--per_device_train_batch_size {b} --gradient_accumulation_steps {global_batch // b}",
                            w2, d):
                    return steps
                break
    if w.lora and w.quant is None:
        w2 = replace(w, quant="4bit", double_quant=True, load_bytes=2 if d.kind == "fsdp" else w.load_bytes,
                     compute_bytes=2 if device == "cuda" else w.compute_bytes)
        how = ("--use_4bit_quantization True --use_nested_quant True --bnb_4bit_quant_type nf4 "
               "--bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_storage_dtype bfloat16 --bf16 True")
        if consider("4-bit base weights (QLoRA)", how, w2, d):
            return steps
    if device == "cuda" and d.kind == "fsdp" and not d.offload:
        if consider("CPU offload", "fsdp_offload_params: true (as configs/fsdp_config_qlora.yaml)", w,
                    replace(d, offload=True)):
            return steps
    per_machine = 8 if device == "cuda" else d.per_machine
    n = d.num_processes
    for _ in range(12):
        n = n * 2 if n < per_machine else (n // per_machine + 1) * per_machine
        d2 = replace(d, kind="fsdp", num_processes=n, num_machines=max(1, math.ceil(n / per_machine)),
                     sharding=d.sharding if d.kind == "fsdp" else "FULL_SHARD")
        if _peak(shape, w, d2, budget, device, knobs) <= budget:
            consider(f"{n} GPUs" if device == "cuda" else f"{n} processes",
                     f"--num_processes {n} (global batch grows {n / d.num_processes:g}x: lower "
                     "--gradient_accumulation_steps to keep it)", w, d2)
            break
    return steps


# ================================================================================================ the guide's runs

GUIDE_SETUPS = {
    # key: (recipe, accelerate config, GPU GiB, offload override)
    "lora-8x80": ("recipes/llama2_70b_lora.yaml", "configs/fsdp_config.yaml", 80.0, None),
    "qlora-2x24-offload": ("recipes/llama2_70b_qlora.yaml", "configs/fsdp_config_qlora.yaml", 24.0, True),
    "qlora-2x24": ("recipes/llama2_70b_qlora.yaml", "configs/fsdp_config_qlora.yaml", 24.0, False),
}


def guide_plans() -> dict[str, MemoryPlan]:
    """The guide's two runs (QLoRA with and without offload) planned from the shipped recipes and configs, offline
    (the recipes name meta-llama/Llama-2-70b-hf, whose architecture ships in configs/models/llama-2-70b)."""
    plans = {}
    for key, (recipe, config, gpu_gib, offload) in GUIDE_SETUPS.items():
        model_args, data_args, _, training_args = parse_train_flags(["--config", str(REPO / recipe)], "cuda")
        cfg = dict(read_accelerate_config(REPO / config))
        if offload is not None:
            cfg["fsdp_config"] = {**cfg["fsdp_config"], "fsdp_offload_params": offload}
        plans[key] = plan_memory(model_args, data_args, training_args, cfg, None, gpu_gib, "cuda", ladder=False)
    return plans


def legacy_logits_bytes(plan_key: str, plans: dict[str, MemoryPlan]) -> float:
    """What the guide's older stack spent on the loss that today's chunked head does not, at its peak: full logits in
    bf16 (T*V*2), their fp32 copy (T*V*4) and the saved log-softmax (T*V*4). An upper bound: that peak comes before
    the recomputed layer's, which the prediction already counts."""
    recipe = GUIDE_SETUPS[plan_key][0]
    import yaml

    values = yaml.safe_load((REPO / recipe).read_text())
    tokens = int(values["per_device_train_batch_size"]) * int(values["max_seq_len"])
    vocab = 32000
    return tokens * vocab * (2 + 4 + 4)


def render_guide_comparison(plans: dict[str, MemoryPlan] | None = None) -> str:
    plans = plans or guide_plans()
    lines = ["The guide's runs (Llama-2-70B), predicted vs published (GiB per GPU):",
             f"  {'run':<22}{'predicted':>10}{'published':>12}{'+ full logits (old stack)':>27}   setup"]
    for key, plan in plans.items():
        lo, hi = PUBLISHED[key]["gpu_gib"]
        pub = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        legacy = plan.peak_gib + legacy_logits_bytes(key, plans) / GIB
        lines.append(f"  {key:<22}{plan.peak_gib:>10.1f}{pub:>12}{legacy:>27.1f}   {plan.setup}")
    host = plans["qlora-2x24-offload"].host_peak_bytes / GIB
    row = {r.name: r.bytes for r in plans["qlora-2x24-offload"].host_rows}
    upstream_save = row.get("offloaded shards", 0) + row[UPSTREAM_SAVE_ROW]
    upstream_host = (row["runtime"] + max(row["loading"], upstream_save)) / GIB
    lines.append(f"  host RAM, QLoRA + offload: predicted {host:.0f} GiB here (runtime, one loaded copy, offloaded "
                 f"shards, the adapter-only save); {upstream_host:.0f} GiB on upstream's path (its final "
                 f"FULL_STATE_DICT gather), published ~{PUBLISHED['qlora-2x24-offload']['host_gib']:g} GB")
    for key in ("lora-8x80", "qlora-2x24-offload"):
        row = {r.name: r.bytes for r in plans[key].host_rows} if key in plans else {}
        if row:
            lines.append(f"  final save, {key}: {row['final save (rank 0)'] / GIB:.2f} GiB of host RAM on rank 0 (the "
                         f"adapter, gathered then written) vs {row[UPSTREAM_SAVE_ROW] / GIB:.0f} GiB for upstream's "
                         "FULL_STATE_DICT gather of every weight")
    lines.append("  Gaps: the guide's stack materialized the full logits in fp32 for the loss (T x V x 10 bytes; the "
                 "'+ full logits' column adds them, an upper bound); nvidia-smi shows reserved memory, above what "
                 "the allocator hands out; host RAM figures also depend on the page cache the checkpoint reads fill "
                 "(not counted in the peak).")
    return "\n".join(lines)


# ======================================================================================================== the CLI


def build_cli() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sft_recipe.plan",
        description="Predict per-rank memory of a training run from the model config (no weights), the accelerate "
                    "YAML and the train.py flags; every unknown flag is passed to train.py's parser.",
        allow_abbrev=False)
    p.add_argument("--config_file", default=None, help="accelerate YAML (as for accelerate launch); none: 1 process")
    p.add_argument("--gpu_memory_gib", type=float, default=None, help="memory of one GPU (cpu mode: RAM per rank)")
    p.add_argument("--guide", action="store_true", help="print the guide's two runs, predicted vs published")
    p.add_argument("--num_processes", type=int, default=None, help="override the YAML's num_processes")
    p.add_argument("--fsdp_offload_params", default=None, choices=["true", "false"],
                   help="override the YAML's fsdp_offload_params (as the launcher flag of that name does)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cuda_context_gib", type=float, default=DEFAULT_CUDA_CONTEXT_GIB)
    p.add_argument("--allocator_reserve", type=float, default=DEFAULT_ALLOCATOR_RESERVE)
    p.add_argument("--host_runtime_gib", type=float, default=DEFAULT_HOST_RUNTIME_GIB)
    p.add_argument("--use_dora", action="store_true", help="plan DoRA instead of LoRA (adds a magnitude vector)")
    p.add_argument("--json", action="store_true", help="print MemoryPlan.to_dict() as JSON")
    return p


def parse_train_flags(train_argv: list[str], device: str):
    """train.py's own parser. Planning a GPU run on a machine without one: the CPU switch keeps transformers from
    refusing bf16, and bf16 defaults to on as TRL does on a bf16 GPU unless the flags say otherwise."""
    from .args import build_parser, explicitly_set, known_option_names, parse_args, read_recipe_yaml

    argv = list(train_argv)
    if not any(t == "--output_dir" or t.startswith("--output_dir=") for t in argv):
        argv += ["--output_dir", os.path.join(os.getcwd(), "plan-output")]  # never written
    saved = os.environ.get("ACCELERATE_USE_CPU")
    if device == "cuda":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        model_args, data_args, recipe_args, training_args = parse_args(argv)
    finally:
        if saved is None:
            os.environ.pop("ACCELERATE_USE_CPU", None)
        else:
            os.environ["ACCELERATE_USE_CPU"] = saved
    if device == "cuda":
        yaml_values = {}
        config = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--config"), None)
        if config:
            yaml_values = read_recipe_yaml(config, known_option_names(build_parser()))[0]
        if not explicitly_set(argv, yaml_values, "bf16"):
            training_args.bf16 = True
    return model_args, data_args, recipe_args, training_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = build_cli()
    ours, train_argv = cli.parse_known_args(argv)
    if ours.guide:
        print(render_guide_comparison())
        return 0
    if ours.gpu_memory_gib is None:
        print("error: --gpu_memory_gib is required: the memory of one GPU in GiB (e.g. 80), or --guide.",
              file=sys.stderr)
        return 2
    try:
        config = read_accelerate_config(ours.config_file)
        if ours.fsdp_offload_params is not None:
            config = {**config, "fsdp_config": {**(config.get("fsdp_config") or {}),
                                                "fsdp_offload_params": ours.fsdp_offload_params == "true"}}
        model_args, data_args, _, training_args = parse_train_flags(train_argv, ours.device)
        plan = plan_memory(model_args, data_args, training_args, config, ours.num_processes,
                           ours.gpu_memory_gib, ours.device, cuda_context_gib=ours.cuda_context_gib,
                           allocator_reserve=ours.allocator_reserve, host_runtime_gib=ours.host_runtime_gib,
                           dora=ours.use_dora)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if ours.json else plan.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
