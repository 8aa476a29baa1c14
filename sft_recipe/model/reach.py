"""What training actually runs of a model, asked of the model and the libraries themselves (usually on the meta
device, so a 70B costs what the tiny model costs), never of a list of family names. The ground floor: imports torch,
transformers and peft only.

- `backbone`: the module TRL's SFTTrainer runs before the output head. Its fused LM head (TRL 1.16, always on) calls
  `model.base_model` and multiplies the last hidden state by the output head's weight: anything else the causal LM
  holds is skipped (`head_bypassed_modules`).
- `reached_linears`: the linear layers (`is_linear`) that backbone calls *and* whose output the loss's gradient
  reaches, seen by one forward and backward on the meta device with a few token ids (shapes only, no arithmetic).
  Cross-attention of a decoder built for an encoder (TrOCR, Marian, Whisper) and projections whose weight a kernel
  reads directly (Mamba's `dt_proj`) are never called; a top-k indexer's projections (DeepSeek-V3.2-style sparse
  attention) are called but only select; a linear subclass whose forward takes or gives other widths than its
  weight's (DeepSeek-V4's grouped output projection) cannot carry LoRA's added output: all-linear leaves these out
  and a named target there is refused.
  None when the backbone cannot run on the meta device (a data-dependent op, even on transformers' compile-time
  branches): nothing is left out then.
- `peft_refused`: the module names PEFT's own compatibility check refuses for this model (PEFT 0.21 keeps Mamba-based
  models' `out_proj`/`conv1d` out of LoRA), asked of PEFT with each name.
- `gradient_checkpointing_support`: what the model class declares (`supports_gradient_checkpointing`).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import torch

from sft_recipe.model.shape import features, is_linear


def decoder_of(model):
    """The model's decoder: `get_decoder()`, or else its one child that is itself a transformers model (Llama-4's
    text model answers `get_decoder()` with itself); None when it names none apart from itself."""
    from transformers import PreTrainedModel

    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    except (AttributeError, NotImplementedError):
        decoder = None
    if isinstance(decoder, torch.nn.Module) and decoder is not model:
        return decoder
    models = [child for child in model.children() if isinstance(child, PreTrainedModel)]
    return models[0] if len(models) == 1 else None


def backbone(model):
    """The module TRL's fused LM head runs: `model.base_model`, or -- where the class's `base_model_prefix` names no
    child (Llama-4's text model) and compat.trl_fused_head points it at the decoder -- the decoder."""
    if model.base_model is not model:
        return model.base_model
    return decoder_of(model) or model


def head_bypassed_modules(model) -> list[str]:
    """Modules holding parameters outside the backbone and the output head: BERT-style prediction heads
    (`cls.predictions.transform`), ELECTRA's generator head. TRL's fused LM head never runs them, so the loss it
    trains would not be this model's. Empty for every decoder-only causal LM."""
    inside = {id(m) for m in backbone(model).modules()}
    head = model.get_output_embeddings()
    head_parts = {id(m) for m in head.modules()} if head is not None else set()
    return [name for name, module in model.named_modules()
            if id(module) not in inside and id(module) not in head_parts
            and any(True for _ in module.parameters(recurse=False))]


def reached_linears(model, tokens: int = 8) -> frozenset[str] | None:
    """Full names of the linear layers that training can change: the backbone's forward calls them and the loss's
    gradient reaches their output (so a LoRA beside them would move). Seen on a twin of the model on the meta device
    (bf16: fused-expert kernels take no fp32; eager attention), one forward and one backward of a few token ids.
    A linear whose output only feeds a selection (DeepSeek-V3.2's top-k indexer) is called but gets no gradient.
    Asked once per (class, config) in a process: the plan, the validation and the load all ask of one model."""
    key = _key(model)
    if key is not None and key in _REACHED:
        return _REACHED[key]
    reached = _probe_trained_linears(model, tokens)
    if key is not None:
        _REACHED[key] = reached
    return reached


_REACHED: dict = {}
_FORWARD_FAILS: dict = {}  # (class, config) -> the error of a forward that failed on the model's own config


def _key(model):
    """(class, config as JSON): what the probe's answers are kept by; None for a config that does not serialise
    (probed each time, and its forward failure not kept)."""
    try:
        return type(model), model.config.to_json_string()
    except Exception:  # noqa: BLE001 -- any serialisation failure means: not cached
        return None


def forward_failure(model) -> str | None:
    """The error with which the model's own forward failed on the meta device (a shape its config makes impossible:
    key/value heads that do not divide the query heads, a rotary size beyond the head), or None: it ran, or only the
    meta device stopped it. Asks reached_linears, which probes once per (class, config)."""
    reached_linears(model)
    return _FORWARD_FAILS.get(_key(model))


@contextlib.contextmanager
def _compile_time_branches(on: bool):
    """transformers' `is_tracing` true (it asks `torch.compiler.is_compiling`) while the probe runs, when `on`."""
    if not on:
        yield
        return
    with mock.patch("torch.compiler.is_compiling", lambda: True):
        yield


def _probe_trained_linears(model, tokens: int) -> frozenset[str] | None:
    config = copy.deepcopy(model.config)
    try:
        with torch.device("meta"):
            twin = type(model)._from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    except Exception:  # noqa: BLE001 -- a class that cannot be rebuilt so is simply not probed
        return None
    trained: set[str] = set()
    misfits: set[str] = set()

    def watch(module, args, out, name):
        # LoRA adds lora_B(lora_A(x)) of shape [..., out_features] to the output: a linear subclass whose forward
        # takes or gives other widths (DeepSeek-V4's grouped o_a_proj) cannot carry one.
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not isinstance(out, torch.Tensor) or (x.shape[-1], out.shape[-1]) != features(module):
            misfits.add(name)
        elif out.requires_grad:
            out.register_hook(lambda grad: trained.add(name))

    hooks = [m.register_forward_hook(lambda module, args, out, name=name: watch(module, args, out, name))
             for name, m in twin.named_modules() if is_linear(m)]
    twin.train()
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    # The default cache first: the no-cache path of most models asks .item() of a mask, a hybrid's cache of linear
    # layers needs none. Then both again with transformers' compile-time branches (`is_tracing`: no data-dependent
    # control flow, the same modules called): the packed-sequence check of Jamba's and Inkling's masks reads a
    # value, which meta tensors have not. Tried last so that what every other model runs stays its eager path.
    attempts = [(cache, traced) for traced in (False, True) for cache in ({}, {"use_cache": False})]
    try:
        for n, (cache, traced) in enumerate(attempts):
            trained.clear()
            misfits.clear()
            try:
                with _compile_time_branches(traced):
                    out = backbone(twin)(input_ids=ids, **cache)
                    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                    hidden.float().sum().backward()
                break
            except Exception as e:  # noqa: BLE001 -- data-dependent ops cannot run on meta: the next attempt, or unknown
                if n == len(attempts) - 1:
                    # Every attempt failed. An error that is not the meta device's own (a value asked of a tensor
                    # that has none) is the model's forward failing on its config: the first step would fail so.
                    if "meta" not in str(e).lower() and _key(model) is not None:
                        _FORWARD_FAILS[_key(model)] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    return None
    finally:
        for hook in hooks:
            hook.remove()
    trained -= misfits
    return frozenset(trained) or None  # none at all: nothing the probe can trust (RWKV's recurrence on meta)


def peft_refused(model, names) -> dict[str, str]:
    """{module name: PEFT's reason} for the names PEFT's LoRA compatibility check refuses on this model."""
    from peft import LoraConfig

    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # a PEFT without the check refuses nothing up front
        return {}
    config = LoraConfig(target_modules=["placeholder"])
    refused = {}
    for name in names:
        try:
            check(config, model, name.rsplit(".", 1)[-1])
        except ValueError as e:
            refused[name] = str(e).split(". Please")[0]
    return refused


def gradient_checkpointing_support(model) -> bool:
    return bool(getattr(type(model), "supports_gradient_checkpointing", False))
