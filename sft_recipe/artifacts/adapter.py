"""Save the final adapter safely and prove it is complete.

A silently empty adapter after hours of GPU time is the worst failure this tool can have, so every save is checked
against what the adapter *should* hold, computed independently from the base model's config on the meta device
(no weights, so it costs the same for a 70B as for the tiny model).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sft_recipe import compat

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_CHECK_EXIT_CODE = 5  # a saved adapter failed its check: kept apart for inspection, nothing replaced


class AdapterCheckError(RuntimeError):
    pass


@dataclass
class AdapterReport:
    adapter_dir: str
    tensors: int = 0
    lora_tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        status = "OK" if self.ok else "FAILED"
        head = f"adapter check {status}: {self.adapter_dir}: {self.tensors} tensors ({self.lora_tensors} LoRA)"
        return head + "".join(f"\n  - {p}" for p in self.problems)


def embedding_leaf_name(model) -> str:
    """Leaf name of the model's input embedding (`embed_tokens` for Llama-style models)."""
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding).rsplit(".", 1)[-1]


def saved_embedding_rows(adapter_dir, embedding_name: str = "embed_tokens") -> int | None:
    """Rows of the full input-embedding matrix an adapter holds (saved when training resized the vocabulary), else
    None: `...embed_tokens.weight`, a `modules_to_save` copy, or `...token_adapter.base_layer.weight` with trainable
    tokens -- never a LoRA matrix or a trainable-tokens delta, which hold only some rows."""
    from safetensors import safe_open

    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        return None
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            if embedding_name in key.split(".") and key.endswith(".weight") and ".lora_" not in key \
                    and "_delta" not in key:
                shape = f.get_slice(key).get_shape()
                if len(shape) == 2:  # the matrix, not a norm the embedding holds (Inkling's embed_norm)
                    return shape[0]
    return None


def expected_adapter_tensors(adapter_dir: str, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor a correct adapter_model.safetensors in `adapter_dir` must hold.

    Built from the base model's config (meta device) and the saved adapter_config.json, with PEFT's own state-dict
    logic on an unwrapped model, so FSDP naming bugs cannot hide a missing tensor here.
    """
    from peft import PeftConfig, get_peft_model, get_peft_model_state_dict

    from sft_recipe.model.shape import meta_model

    peft_config = PeftConfig.from_pretrained(adapter_dir)
    base = meta_model(peft_config.base_model_name_or_path, trust_remote_code)
    # Embedding rows the run added are saved with the adapter: size the meta model like the saved tensors.
    saved_rows = saved_embedding_rows(adapter_dir, embedding_leaf_name(base))
    # Resized: PEFT saved the whole embedding and head. A modules_to_save copy of an embedding that kept its size
    # holds rows too, but then PEFT saves no embedding layer beside it.
    resized = saved_rows is not None and saved_rows != base.get_input_embeddings().weight.shape[0]
    if resized:
        base.resize_token_embeddings(saved_rows, mean_resizing=False)
    peft_config.inference_mode = False
    with torch.device("meta"):
        model = get_peft_model(base, peft_config)
    state = get_peft_model_state_dict(model, save_embedding_layers=resized)
    return {k: tuple(v.shape) for k, v in state.items()}


def check_adapter(adapter_dir: str, *, trained: bool = True, trust_remote_code: bool = False) -> AdapterReport:
    """Verify a saved adapter folder: files, every expected tensor with its shape, finite values, lora_B moved."""
    from safetensors import safe_open

    report = AdapterReport(adapter_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(adapter_dir, name)):
            report.problems.append(f"{name} is missing")
    if report.problems:
        return report
    try:
        expected = expected_adapter_tensors(adapter_dir, trust_remote_code)
    except Exception as e:  # unreadable config or base model config
        report.problems.append(f"could not compute the expected tensors ({type(e).__name__}: {e})")
        return report
    zero_b: list[str] = []
    with safe_open(os.path.join(adapter_dir, ADAPTER_WEIGHTS), framework="pt") as f:
        saved = set(f.keys())
        report.tensors = len(saved)
        report.lora_tensors = sum(".lora_" in k for k in saved)
        missing = sorted(set(expected) - saved)
        unexpected = sorted(saved - set(expected))
        if missing:
            report.problems.append(f"{len(missing)} of {len(expected)} expected tensors are missing, "
                                   f"e.g. {missing[:3]}")
        if unexpected:
            report.problems.append(f"{len(unexpected)} tensors the adapter config does not explain, "
                                   f"e.g. {unexpected[:3]}")
        for key in sorted(saved & set(expected)):
            tensor = f.get_tensor(key)
            if tuple(tensor.shape) != expected[key]:
                report.problems.append(f"{key}: shape {tuple(tensor.shape)}, expected {expected[key]}")
            if not torch.isfinite(tensor.float()).all():
                report.problems.append(f"{key}: holds NaN or inf")
            if trained and ".lora_B" in key and not tensor.any():
                zero_b.append(key)
    if not expected:
        report.problems.append("the adapter config matches no module of the base model (no LoRA tensors expected)")
    if zero_b:
        report.problems.append(f"{len(zero_b)} lora_B tensors are all zeros after training (never updated), "
                               f"e.g. {zero_b[:3]}")
    return report


def save_final_adapter(trainer, output_dir: str, *, verify: bool = True, trust_remote_code: bool = False) -> dict:
    """Collective: every rank calls it. Gather the adapter's tensors, write them atomically to `output_dir`, check;
    returns what the save cost (seconds, anonymous RSS added per rank, adapter MiB) for the run record.

    The files are written to a temporary folder inside `output_dir`, checked there, then moved into place, so a crash
    or a failed check never replaces a previous good adapter with a broken one. A failed check leaves the files in
    `output_dir/_adapter-FAILED-CHECK/` for inspection and raises.
    """
    from functools import partial

    from sft_recipe.artifacts.disk_full import guarded_save
    from sft_recipe.artifacts.gather import gather_adapter_state
    from sft_recipe.measure import RssWatch, save_cost

    accelerator = trainer.accelerator
    with RssWatch() as watch:
        # Only the tensors the adapter holds (keys chosen before wrapping), never the frozen base: see gather.py.
        state_dict = gather_adapter_state(accelerator, trainer.model_wrapped, trainer.adapter_keys)
        adapter_mib = sum(t.numel() * t.element_size() for t in state_dict.values()) / 2**20
        # The main process writes; every rank waits for it, and all end with DiskFull (exit 74) if the disk filled.
        guarded_save(accelerator, output_dir, partial(_write_and_check, trainer, state_dict, output_dir, verify,
                                                      trust_remote_code),
                     main_only=True, cleanup=writing_folder(output_dir), needed_bytes=int(adapter_mib * 2**20))
        del state_dict
    # The cost of this save on every rank, for the run record, and (main process) the files it wrote: the checked
    # adapter folder, what a deferred push uploads.
    cost = save_cost(accelerator, watch, adapter_mib=round(adapter_mib, 3))
    return {**cost, "files": getattr(trainer, "final_adapter_files", None)}


def writing_folder(output_dir) -> Path:
    """Where this process writes an adapter before it is checked and moved into `output_dir`. Like every folder the
    recipe keeps inside output_dir beside the adapter (_previous-run-*, _damaged-*, _adapter-FAILED-CHECK), its name
    starts with `_`, which transformers' Hub uploads of output_dir leave out."""
    return Path(output_dir) / f"_adapter-writing-{os.getpid()}"


def _count_lora_keys(state_dict: dict) -> int:
    return sum(".lora_" in k for k in state_dict)


def _write_and_check(trainer, state_dict, output_dir: str, verify: bool, trust_remote_code: bool) -> None:
    from peft import PeftModel, get_peft_model_state_dict

    model = trainer.accelerator.unwrap_model(trainer.model)
    out = Path(output_dir)
    tmp = writing_folder(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if isinstance(model, PeftModel):
        # Always save through clean module names (a no-op for unwrapped names); say when it mattered, so the
        # workaround can be dropped once peft stops needing it.
        embeddings = compat.save_embedding_layers_for(model, trust_remote_code)
        plain = _count_lora_keys(get_peft_model_state_dict(model, state_dict=state_dict))
        with compat.module_names_without_fsdp_segments(model):
            fixed = _count_lora_keys(get_peft_model_state_dict(model, state_dict=state_dict))
            if fixed > plain:
                # Expected while the workaround is needed (INFO: nothing for the user to do); its absence with a
                # newer peft is what says the workaround can go.
                logger.info("adapter keys needed the FSDP1 name fix: peft found %d LoRA tensors, %d with clean "
                            "module names (peft 0.21 bug, see sft_recipe/compat)", plain, fixed)
            model.save_pretrained(str(tmp), state_dict=state_dict, save_embedding_layers=embeddings)
    else:
        model.save_pretrained(str(tmp), state_dict=state_dict)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(str(tmp))
        _write_generation_files(trainer, model, tmp, output_dir, trust_remote_code)

    if verify and isinstance(model, PeftModel):
        # lora_B all zeros is "never updated" only where a step ran at a rate above 0 (not after a warmup's first)
        report = check_adapter(str(tmp), trained=getattr(trainer, "applied_a_nonzero_rate", True),
                               trust_remote_code=trust_remote_code)
        report.adapter_dir = str(out)  # name the folder the user will look in, not the temporary one
        print(report.summary(), flush=True)
        if not report.ok:
            failed = out / "_adapter-FAILED-CHECK"
            shutil.rmtree(failed, ignore_errors=True)
            os.replace(tmp, failed)
            raise AdapterCheckError(f"{report.summary()}\nThe files are kept in {failed} for inspection.")
    names = sorted(item.name for item in tmp.iterdir())
    for name in names:
        os.replace(tmp / name, out / name)
    tmp.rmdir()
    trainer.final_adapter_files = names


def _write_generation_files(trainer, model, folder: Path, output_dir: str, trust_remote_code: bool) -> None:
    """generation_config.json that stops at the chat format's end of turn, and the card lines that load it
    (generation.py): written with the adapter, so checkpoints' markers record it like the other files."""
    from peft import PeftModel

    from sft_recipe.artifacts.generation import text_tokenizer, trained_base_name, write_adapter_generation_files

    base = trained_base_name(model)
    if base:
        write_adapter_generation_files(folder, output_dir, base, text_tokenizer(trainer.processing_class),
                                       trust_remote_code=trust_remote_code, card=isinstance(model, PeftModel),
                                       fallback=getattr(model, "generation_config", None))
