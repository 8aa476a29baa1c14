"""The loss and attention terms of the memory plan (components.LOSS_IMPLS, components.attention_rows) against what
the ops really allocate, measured with sft_recipe.measure.PeakLiveBytes; the tracker against known allocations; and
the phase rule: the loss and the layers' backward are not simultaneous, so the peak counts the larger."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.loss.loss_utils import ForCausalLMLoss

from sft_recipe.measure import PeakLiveBytes
from sft_recipe.plan import model_shape, parse_train_flags, workload
from sft_recipe.plan.components import LOSS_IMPLS, activation_rows, attention_rows, loss_phase_bytes
from tests.helpers import REPO

LLAMA_7B = str(REPO / "sft_recipe" / "plan" / "models" / "llama-2-7b")


def test_the_tracker_counts_fresh_storages_and_not_views_and_frees_what_torch_frees():
    x = torch.zeros(256, 256)  # made before: not counted
    with PeakLiveBytes() as peak:
        view = x.t()  # a view of x: no new memory
        y = x + 1  # 256 KiB
        z = y * 2  # 256 KiB more
        del y  # freed
        w = z.sum()
    assert peak.peak_bytes == 2 * 256 * 256 * 4
    assert peak.live_bytes == 256 * 256 * 4 + w.element_size()  # z and the scalar remain
    del view


def _loss_peak(tokens: int, vocab: int, hidden: int, keep_logits: bool, fake: bool) -> tuple[int, int]:
    """Peak and remaining bytes of lm_head -> transformers' causal-LM loss (fp32 logits) -> backward, beyond the
    head's weight and the hidden states; `keep_logits`: the caller holds the fp32 logits until backward ends."""
    with FakeTensorMode() if fake else torch.device("cpu"):
        head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        hidden_states = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        with PeakLiveBytes() as peak:
            logits = head(hidden_states).float()  # transformers <= 4.44's forward; ForCausalLMLoss upcasts too
            loss = ForCausalLMLoss(logits, labels, vocab_size=vocab)
            if not keep_logits:
                del logits
            loss.backward()
        return peak.peak_bytes, peak.live_bytes


@pytest.mark.parametrize("impl,keep", [("full-logits", False), ("full-logits-kept", True)])
def test_the_full_logits_terms_are_what_the_loss_allocates(impl, keep):
    """Measured on real CPU tensors at a small size and on fake ones at a 7B's vocabulary and a B=2 x 2048 batch:
    the ops' outputs are the same tensors on CUDA. Within 5% (the hidden-state gradient and small per-token
    tensors come on top of the T x V terms)."""
    shape = model_shape(LLAMA_7B)
    for tokens, vocab, hidden, fake in ((384, 3000, 64, False), (4096, shape.vocab_size, shape.hidden_size, True)):
        peak, kept = _loss_peak(tokens, vocab, hidden, keep, fake)
        formula = (16 if keep else 12) * tokens * vocab
        assert formula <= peak <= 1.05 * formula, (impl, tokens, peak / (tokens * vocab))
        assert (kept >= 4 * tokens * vocab) == keep  # what the layers' backward still sees
    assert set(LOSS_IMPLS) == {"trl-chunked", "full-logits", "full-logits-kept"}


def _workload(*flags):
    model_args, data_args, _, training_args = parse_train_flags(
        ["--model_name_or_path", LLAMA_7B, "--use_peft_lora", "True", "--packing", "True",
         "--gradient_checkpointing", "True", "--bf16", "True", *flags], "cuda")
    return workload(model_args, data_args, training_args, "cuda")


def test_on_gpus_the_loss_counts_only_beyond_the_layer_phase_and_a_kept_logits_tensor_counts_throughout():
    shape = model_shape(LLAMA_7B)
    w = _workload("--per_device_train_batch_size", "4", "--max_seq_len", "2048")
    for impl in LOSS_IMPLS:
        wi = replace(w, loss_impl=impl)
        rows = {r.name: r.bytes for r in activation_rows(shape, wi, "cuda")}
        layer_phase = sum(v for k, v in rows.items() if k not in ("activations: checkpoints",
                                                                  "activations: loss, beyond the layer phase"))
        assert rows["activations: loss, beyond the layer phase"] == pytest.approx(
            max(0.0, loss_phase_bytes(shape, wi) - layer_phase))
        assert ("activations: logits kept through backward" in rows) == (impl == "full-logits-kept")
    # 8192 tokens of a 32000 vocabulary: the full fp32 logits' 12 x T x V outgrow the recomputed layer, TRL's tiles
    # do not.
    chunked = {r.name: r.bytes for r in activation_rows(shape, w, "cuda")}
    full = {r.name: r.bytes for r in activation_rows(shape, replace(w, loss_impl="full-logits"), "cuda")}
    assert chunked["activations: loss, beyond the layer phase"] == 0
    assert full["activations: loss, beyond the layer phase"] > 0
    # On CPU glibc keeps the freed pages of one phase for the next: the loss is summed (measured on CPU RSS).
    cpu = {r.name: r.bytes for r in activation_rows(shape, w, "cpu")}
    assert cpu["activations: loss"] == pytest.approx(loss_phase_bytes(shape, w))


def test_eager_attention_saves_its_fp32_softmax_and_the_cast_and_packed_sdpa_one_mask():
    """transformers' eager_attention_forward keeps B*H*S^2*(4 + a) bytes for backward (measured: what remains live
    after the forward, beyond its output); flash-attn adds no S^2 term; SDPA over packed rows one bool mask."""
    import types

    from transformers.models.llama.modeling_llama import eager_attention_forward

    B, H, S, D = 2, 4, 256, 32
    module = types.SimpleNamespace(num_key_value_groups=1, training=True)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with PeakLiveBytes() as peak:
        out, _ = eager_attention_forward(module, q, k, v, None, scaling=D ** -0.5, dropout=0.0)
    saved = peak.live_bytes - out.numel() * out.element_size()
    assert saved == B * H * S * S * (4 + 2)

    shape = replace(model_shape(LLAMA_7B), attention="eager")
    w = _workload("--per_device_train_batch_size", "2", "--max_seq_len", "1024")
    (row,) = attention_rows(shape, w)
    assert row.bytes == 2 * shape.num_heads * 1024 ** 2 * (4 + w.compute_bytes)  # the recomputed layer's
    no_checkpointing = attention_rows(shape, replace(w, gradient_checkpointing=False))[0].bytes
    assert no_checkpointing == shape.num_layers * row.bytes
    assert attention_rows(shape, replace(w, flash_attention=True)) == []
    (mask,) = attention_rows(model_shape(LLAMA_7B), w)  # SDPA, packed
    assert mask.bytes == 2 * 1024 ** 2 and attention_rows(model_shape(LLAMA_7B), replace(w, packing=False)) == []
