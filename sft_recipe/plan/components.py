"""The memory components both estimates (gpu.py, cpu.py) are built from: base weights, trainable parameters, the
saved adapter, optimizer state, activations and FSDP all-gather buffers. Each formula is in its function's docstring;
the notation is the package's (sft_recipe/plan/__init__.py)."""

from __future__ import annotations

import math

from sft_recipe.plan.inputs import Distribution, Workload
from sft_recipe.plan.result import Row
from sft_recipe.plan.shape import ModelShape

# ---- activation coefficients (bytes per token per decoder layer), Llama-style block (RMSNorm, RoPE, SwiGLU) ----
# Measured with autograd's saved-tensor hooks on LlamaForCausalLM + LoRA (all-linear), SDPA/flash attention, for
# fp32 (a=4) and bf16 weights under bf16 autocast (a=2); tests/unit/test_plan.py re-measures them.
#   saved per token per layer = ACT_H[a]*h + ACT_I[a]*i + ACT_KV[a]*kv + a*r*m + ACT_C0[a]
# a*h terms: the two RMSNorms keep fp32 copies of their input whatever a is, which is why ACT_H does not halve.
ACT_H = {4: 24, 2: 24}
ACT_I = {4: 16, 2: 8}      # gate, up, act(gate), act*up: 4 tensors of width i
ACT_KV = {4: 8, 2: 4}      # rotated k and v
ACT_C0 = {4: 232, 2: 120}  # per-token scalars (RMSNorm statistics, attention log-sum-exp, ...)

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


def base_weight_bytes(shape: ModelShape, w: Workload) -> tuple[float, float, str]:
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


def count_trainable(shape: ModelShape, w: Workload) -> tuple[int, int]:
    """(trainable parameters, bytes each). LoRA: fp32 (PEFT upcasts adapters), except QLoRA where TRL casts A/B to
    bf16 (DoRA magnitudes stay fp32); `w.adapter_bytes` where another stack kept them otherwise (Answer.AI's pure
    bf16). Full fine-tuning: every base parameter, in the load dtype."""
    if not w.lora:
        return shape.total_params, w.load_bytes
    count = shape.lora_params(w.lora_r, _targets(w), w.dora)
    if w.adapter_bytes:
        return count, w.adapter_bytes
    return count, (2 if w.quant and not w.dora else 4)


def fully_trained(shape: ModelShape, w: Workload) -> tuple[int, int, int, str]:
    """(parameters trained in full beside the adapter, their tensors, bytes each, what they are): the modules
    --lora_modules_to_save names (a copy of each) and, with --train_new_tokens, the added tokens' rows of the
    embedding and the output layer. fp32 (the trainer upcasts them: train/trainer.py upcast_trainable_half_params),
    in the load dtype beside a quantized base. The one count the memory plan and the disk estimate both use."""
    if not w.lora:
        return 0, 0, 0, ""
    chosen = [(params, tensors) for leaf, params, tensors in shape.leaf_params if leaf in w.modules_to_save]
    params, tensors = sum(p for p, _ in chosen), sum(t for _, t in chosen)
    what = [f"{', '.join(w.modules_to_save)} in full"] if params else []
    if w.train_new_tokens and w.extra_vocab:
        params, tensors = params + 2 * w.extra_vocab * shape.hidden_size, tensors + 2
        what.append(f"2 x {w.extra_vocab} new-token rows x {shape.hidden_size}")
    return params, tensors, (w.load_bytes if w.quant else 4), " + ".join(what)


def fully_trained_bytes(shape: ModelShape, w: Workload) -> tuple[float, str]:
    """Memory of `fully_trained`: the parameters, their gradients and their optimizer state."""
    params, _, each, what = fully_trained(shape, w)
    if not params:
        return 0.0, ""
    opt, _ = optimizer_bytes(shape, w, params, each)
    return params * each * 2 + opt, f"{what}: {params:,} x {each} B, gradients, {w.optimizer} state"


# The peak a mixed root unit adds, per root parameter (bench/use_orig_params.py, 2 CPU ranks, a 512 x 4 Llama whose
# root holds 8.76M parameters, 33.4 MiB in fp32): +35 MiB per rank with an fp32 root (LoRA) and +34 MiB with a bf16
# one (QLoRA, bf16 storage and mixed precision), where a bf16 gradient alone would be 16.7: 4 bytes either way. Of
# that, +17 MiB is what the rows cost on any engine (FSDP2 + new rows, same bench: PEFT's merged weights), not yet
# planned elsewhere; docs/memory-and-speed.md.
MIXED_UNIT_GRADIENT_BYTES = 4


def mixed_unit_gradient_bytes(shape: ModelShape, w: Workload, d) -> tuple[float, float, str]:
    """(unsharded, sharded) bytes of the gradient FSDP1 gives a unit whose flat parameter mixes trained and frozen
    weights, and what they are. Only `fsdp_use_orig_params: true` allows such a unit (false refuses to flatten it),
    and the flat parameter then gets a gradient as large as itself, zeros where frozen (torch's FSDP1 note on
    use_orig_params). PEFT's wrap policy gives LoRA layers units of their own, so decoder units stay wholly frozen;
    the root unit (embeddings, final norm, head) mixes when --train_new_tokens trains rows of its embedding and
    head. The unsharded gradient (compute dtype) lives from the head's backward, the first, to the root's
    reduce-scatter after the embedding's, the last: through the activations' peak. The sharded one (load dtype, /G)
    is made at that reduce-scatter, when the activations are gone, and kept to the optimizer step: it adds to the
    peak only where it is kept elsewhere (the host, under offload). Bytes per root parameter at the peak:
    MIXED_UNIT_GRADIENT_BYTES, measured."""
    if not (d.kind == "fsdp" and d.fsdp_version == 1 and d.use_orig_params and w.lora and w.train_new_tokens
            and w.extra_vocab):
        return 0.0, 0.0, ""
    root = shape.root_params
    return (root * MIXED_UNIT_GRADIENT_BYTES, root * w.load_bytes / d.shard_group,
            f"root unit ({root:,} embedding, norm and head params) x {MIXED_UNIT_GRADIENT_BYTES} B, unsharded "
            "through the backward (measured)")


def adapter_bytes(shape: ModelShape, w: Workload) -> tuple[float, str]:
    """What the saved adapter holds, which is all the final save gathers (sft_recipe/artifacts/gather.py): the trainable
    tensors, plus the whole input embedding and output head when the vocabulary was resized (PEFT saves both)."""
    trainable, tbytes = count_trainable(shape, w)
    total, formula = float(trainable * tbytes), f"{trainable:,} x {tbytes} B"
    if w.extra_vocab and w.lora:
        total += 2 * shape.vocab_size * shape.hidden_size * w.load_bytes
        formula += f" + 2 x V*h*{w.load_bytes} (resized embedding + head)"
    return total, formula


def optimizer_bytes(shape: ModelShape, w: Workload, trainable: int, param_bytes: int) -> tuple[float, str]:
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


# How the loss is computed, and what it holds on the GPU (bytes; T tokens, V vocabulary, h hidden, a activation bytes).
LOSS_IMPLS = {
    # TRL 1.16's fused head (trl/kernels/chunked_logprob.py, the Triton branch every CUDA run takes; Liger's kernels
    # leave it in place: TRL turns Liger's own fused linear cross-entropy off): tiles of 4096 tokens x 32768 vocabulary
    # entries, never the T x V logits.
    "trl-chunked": "T*h*(4+2a) + 2*min(T,4096)*min(V,32768)*a",
    # The full fp32 logits of a model's own loss (transformers' ForCausalLMLoss upcasts them; transformers <= 4.44 did
    # it in the model's forward): fp32 logits and log-softmax, then their gradients: 12 x T*V, measured with
    # sft_recipe.measure.PeakLiveBytes (tests/unit/test_plan_loss.py).
    "full-logits": "12*T*V",
    # The same, with the caller holding the model's output (its fp32 logits) until backward ends, as Answer.AI's
    # fsdp_qlora train.py does (`output = model(...)`, then `loss.backward()`): 16 x T*V at the loss, and 4 x T*V
    # through every layer's backward.
    "full-logits-kept": "16*T*V, and 4*T*V kept through the layers' backward",
}


def loss_phase_bytes(shape: ModelShape, w: Workload) -> float:
    """What the loss holds at its peak, at the end of the forward (LOSS_IMPLS)."""
    a, T, h, V = w.compute_bytes, w.tokens, shape.hidden_size, shape.vocab_size
    if w.loss_impl == "trl-chunked":
        return T * h * (4 + 2 * a) + 2 * min(T, 4096) * min(V, 32768) * a
    return (16 if w.loss_impl == "full-logits-kept" else 12) * T * V


def attention_rows(shape: ModelShape, w: Workload) -> list[Row]:
    """What the attention kernel adds on a GPU beyond the per-token terms (flash-attn and SDPA's flash and
    memory-efficient kernels keep O(S) per head: a log-sum-exp, in ACT_C0).
    - eager (a class without SDPA: transformers' eager_attention_forward): each layer saves the fp32 softmax and its
      cast to the compute dtype, B*H*S^2*(4 + a): once for the recomputed layer under checkpointing, L times without.
    - SDPA with packed rows (no flash-attn): transformers' sdpa_mask builds one boolean block-causal mask from the
      position ids, B*S^2 bytes, shared by the layers."""
    B, S, a = w.micro_batch, w.seq_len, w.compute_bytes
    if w.flash_attention:
        return []
    if shape.attention == "eager":
        per_layer = B * shape.num_heads * S * S * (4 + a)
        layers = 1 if w.gradient_checkpointing else shape.num_layers
        return [Row("activations: eager attention weights", layers * per_layer,
                    f"{layers} x B*H*S^2*(4+a), H={shape.num_heads} (the class has no SDPA)")]
    if w.packing:
        return [Row("activations: packed attention mask", B * S * S, "B*S^2 bytes (SDPA's block-causal mask)")]
    return []


def activation_rows(shape: ModelShape, w: Workload, device: str) -> list[Row]:
    """Activations of one micro-batch (T = B*S tokens).

    - saved for backward: without checkpointing L*T*c; with it only each layer's input, L*T*h*a. Both are held
      through the whole backward.
    - recomputed layer (checkpointing only): T*c, one layer's activations rebuilt during its backward.
    - backward working set: 2*T*(h + i)*a, gradients flowing through the widest block.
    - the loss (loss_phase_bytes, LOSS_IMPLS: TRL's chunked head by default). On CUDA the loss runs before any
      layer's backward and is freed before the first recompute: peak = saved + max(loss, layer phase), the layer
      phase being recomputed layer + working set (+ logits a caller keeps). The loss row counts what it adds beyond
      the layer phase. On CPU the sum: glibc keeps the freed pages of one phase in RSS for the next (measured).
    - with --activation_offloading (CUDA only; see offloaded_activation_bytes): what autograd saves goes to host RAM,
      and the GPU keeps only the tensors in flight: with checkpointing 2*T*h*a (the layer input brought back for its
      recompute, and the previous one until its copy event), without it T*c (at most one layer's saved tensors:
      TRL's forward stash of 5 tensors, the current and previous backward node). The recomputed layer, the working
      set and the loss stay on the GPU (with --use_reentrant the recomputed layer passes through TRL's hook
      too, copied out and back within its own backward: counted whole here, an upper bound).
    """
    a, T, L, h, i = w.compute_bytes, w.tokens, shape.num_layers, shape.hidden_size, shape.intermediate_size
    c = activation_bytes_per_token_per_layer(shape, w, device)
    offload = w.activation_offloading and device == "cuda"
    rows = []
    if w.gradient_checkpointing and offload:
        rows.append(Row("activations: checkpoints in flight", 2 * T * h * a,
                        f"2*T*h*a, T={T}, a={a} (L*T*h*a offloaded to host RAM)"))
        rows.append(Row("activations: recomputed layer", T * c, f"T*c, c={c:,.0f} B/token/layer"))
    elif w.gradient_checkpointing:
        rows.append(Row("activations: checkpoints", L * T * h * a, f"L*T*h*a, T={T}, a={a}"))
        rows.append(Row("activations: recomputed layer", T * c, f"T*c, c={c:,.0f} B/token/layer"))
    elif offload:
        rows.append(Row("activations: saved, in flight", T * c,
                        f"T*c, T={T}, c={c:,.0f} B/token/layer (L*T*c offloaded to host RAM)"))
    else:
        rows.append(Row("activations: saved", L * T * c, f"L*T*c, T={T}, c={c:,.0f} B/token/layer"))
    rows.append(Row("activations: backward working set", 2 * T * (h + i) * a, "2*T*(h+i)*a"))
    if device == "cuda":
        rows += attention_rows(shape, w)
    if w.loss_impl == "full-logits-kept":
        rows.append(Row("activations: logits kept through backward", 4 * T * shape.vocab_size,
                        "4*T*V (the caller holds the fp32 logits)"))
    loss = loss_phase_bytes(shape, w)
    formula = LOSS_IMPLS[w.loss_impl]
    if device != "cuda":
        rows.append(Row("activations: loss", loss, f"{formula} ({w.loss_impl})"))
        return rows
    layer_phase = sum(r.bytes for r in rows[1:])  # rows[0] (checkpoints or saved) is held through both phases
    beyond = max(0.0, loss - layer_phase)
    rows.append(Row("activations: loss, beyond the layer phase", beyond,
                    f"{w.loss_impl}: {formula} = {loss / 2**30:.2f} GiB at the end of the forward, freed before the "
                    f"layers' backward ({layer_phase / 2**30:.2f} GiB): only the excess counts"))
    return rows


def pinned(nbytes: float) -> float:
    """Bytes torch's pinned host allocator takes for one tensor: its size rounded up to a power of two (torch 2.13
    CachingHostAllocator, with the default pinned_max_round_threshold), kept cached for reuse by the next step."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 1 else float(nbytes)


def offloaded_activation_bytes(shape: ModelShape, w: Workload) -> tuple[float, str]:
    """Host RAM one rank pins for TRL 1.16's activation offloading (`--activation_offloading True`), 0 without it.

    TRL wraps each training step (forward and backward) in `OffloadActivations`, a saved_tensors_hooks context:
    every tensor autograd saves that is on the GPU, at least 1024 bytes and not a parameter is copied to pinned host
    memory in the forward and brought back when its backward node runs. Measured with the same hooks on a Llama +
    LoRA (2 layers minus 1 layer):
    - with non-reentrant checkpointing (the recipe's default), what reaches the outer hook is each layer's input
      only (T*h*a per layer); the recomputation in backward saves under torch's own hook and stays on the GPU:
          L x pinned(T*h*a)
      with --use_reentrant True (the QLoRA recipe's) the recomputation runs under TRL's hook as well: each recomputed
      layer's saved tensors are copied out and back during its backward, + one layer's T*c (the pinned blocks are
      reused layer after layer)
    - without checkpointing, every saved tensor of every layer: L*T*c, each term rounded as its tensors are
          L*T*(ACT_H*h*r(h) + ACT_I*i*r(i) + ACT_KV*kv*r(kv) + the rest),  r(x) = pinned(T*x*a) / (T*x*a)
    - plus outside the layers (final norm's fp32 input, the fused head's input): T*h*(4 + a), measured 3-6 x h per
      token.
    pinned(): torch's pinned host allocator rounds each tensor up to a power of two and caches the blocks, so the
    host holds this through the run. Per machine: x ranks on it (gpu.host_ram_rows).
    """
    if not w.activation_offloading:
        return 0.0, "no activation offloading"
    a, T, L, h, i = w.compute_bytes, w.tokens, shape.num_layers, shape.hidden_size, shape.intermediate_size
    outside = T * h * (4 + a)
    c = activation_bytes_per_token_per_layer(shape, w, "cuda")
    if w.gradient_checkpointing:
        total = L * pinned(T * h * a) + outside
        formula = "L x pinned(T*h*a) + T*h*(4+a) (layer inputs, pinned to powers of 2)"
        if w.reentrant_checkpointing:
            total, formula = total + T * c, formula + " + T*c (reentrant recompute of one layer)"
        return total, formula
    kv = shape.kv_width
    terms = [(h, ACT_H[a] * h), (i, ACT_I[a] * i), (kv, ACT_KV[a] * kv)]  # (tensor width, bytes per token)
    rounded = sum(part * pinned(T * x * a) / (T * x * a) for x, part in terms) + c - sum(p for _, p in terms)
    return L * T * rounded + outside, "L*T*c with each tensor pinned to a power of 2 + T*h*(4+a)"


def gather_bytes(shape: ModelShape, w: Workload, d: Distribution) -> tuple[float, str]:
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
    # The unit FSDP gathers at once: one decoder layer (TRANSFORMER_BASED_WRAP), as many layers as reach
    # fsdp_min_num_params (SIZE_BASED_WRAP), or the whole model as one unit (NO_WRAP: nothing is ever sharded away
    # while it computes).
    layers_per_unit = 1
    policy = d.wrap_policy if not w.lora else "TRANSFORMER_BASED_WRAP"  # a LoRA run is wrapped by PEFT's policy
    if policy == "SIZE_BASED_WRAP":
        layers_per_unit = min(shape.num_layers, max(1, -(-d.min_num_params // max(1, shape.layer_params))))
    if policy == "NO_WRAP":
        total, formula = root + shape.num_layers * layer, "the whole model (NO_WRAP: one unit)"
    elif d.reshards_after_forward:
        units = min(2 * layers_per_unit, shape.num_layers)
        total, formula = root + units * layer, f"root + 2 x unit of {layers_per_unit} layer(s)"
    else:
        total, formula = root + shape.num_layers * layer, "every unit (no reshard after forward)"
    if dequant:
        total += dequant
        formula += " + dequantized largest linear"
    return total, formula
