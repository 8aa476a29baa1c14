"""Merge a saved LoRA/DoRA adapter into its base model and write a plain model folder.

    python merge_adapter.py --adapter_dir runs/demo --output_dir runs/demo-merged
    python -m sft_recipe.merge --adapter_dir runs/demo --output_dir runs/demo-merged      (the same)

The upstream guide says merging after FSDP training "is not supported, results in an error": under FSDP every rank
holds a shard of each weight, so `merge_and_unload()` there adds LoRA deltas to shards (or fails). This command
instead runs after training, in ONE plain process: it reloads the base unsharded from `base_model_name_or_path` (or
`--base_model_name_or_path`), sizes its embeddings to the saved tokenizer, attaches the adapter, merges, and writes
safetensors shards + config + generation config + tokenizer that load with `AutoModelForCausalLM.from_pretrained`.

QLoRA adapters are merged into the unquantized base (bf16 by default), never into a 4-bit one: 4-bit weights cannot
hold `W + B@A` without re-quantizing it. `--check` (default on) reloads the written folder and compares its logits with
base+adapter on a short prompt before the folder is published.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sft_recipe.artifacts.adapter import ADAPTER_CONFIG, embedding_leaf_name, saved_embedding_rows
from sft_recipe.artifacts.generation import add_chat_eos
from sft_recipe.errors import ConfigError
from sft_recipe.merge_checks import (  # the refusals and the logits check; callers import them from here too
    CHECK_RELATIVE_TOLERANCE,
    COMMAND,
    MergeCheckError,
    MergeError,
    check_problem,
    compute_logits,
    make_check_ids,
    merge_and_unload_unsharded,
    refuse_merge_in_fsdp,  # noqa: F401
    refuse_under_distributed_launcher,
)
from sft_recipe.model.shape import DTYPES as ALL_DTYPES
from sft_recipe.model.shape import config_dtype, read_config
from sft_recipe.train.record import RUN_RECORD  # written by train.py next to the adapter

OLDER_RUN_FACTS = "run_facts.json"  # what train.py wrote before the run record: quantization at its top level

ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MERGE_INFO = "merge_info.json"

DTYPES = {name: dtype for name, dtype in ALL_DTYPES.items() if dtype.is_floating_point}
# ----------------------------------------------------------------------------------------------------------------
# Plan: every input checked before any weight is loaded
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class MergePlan:
    adapter_dir: Path
    output_dir: Path
    base_model: str
    dtype: torch.dtype
    dtype_reason: str
    quantized_training: str | None  # "4bit"/"8bit" when the run record says so, else None
    tokenizer_source: str
    overwrite: bool = False
    check: bool = True
    check_tolerance: float | None = None  # relative; None: CHECK_RELATIVE_TOLERANCE[dtype]
    max_shard_size: str = "5GB"
    trust_remote_code: bool = False
    notes: list[str] = field(default_factory=list)


def _is_within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _training_quantization(adapter_dir: Path) -> tuple[str | None, str | None]:
    """(quantization recorded by train.py, note when it cannot be told)."""
    facts_path = adapter_dir / RUN_RECORD
    if not facts_path.is_file():
        facts_path = adapter_dir / OLDER_RUN_FACTS  # an adapter trained by an earlier version of the recipe
        if not facts_path.is_file():
            return None, None
    try:
        record = json.loads(facts_path.read_text())
        facts = record["run"] if facts_path.name == RUN_RECORD else record
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{facts_path} is unreadable; the training's quantization is unknown"
    if "quantization" not in facts:
        return None, (f"{facts_path} does not record whether training was quantized (older train.py); if this "
                      f"adapter was trained with QLoRA, pass --dtype bfloat16")
    value = facts["quantization"]
    return (str(value) if value else None), None


def _merge_dtype(config) -> torch.dtype:
    """The base config's dtype where merging in it is checked (fp32/bf16/fp16), else float32."""
    value = config_dtype(config)
    return value if value in CHECK_RELATIVE_TOLERANCE else torch.float32


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json", "tokenizer.model"))


def plan_merge(adapter_dir: str | os.PathLike, output_dir: str | os.PathLike, *, base_model_name_or_path: str | None
               = None, dtype: str = "auto", overwrite: bool = False, check: bool = True,
               check_tolerance: float | None = None, max_shard_size: str = "5GB",
               trust_remote_code: bool = False) -> MergePlan:
    """Check every input (reading only small json files and the base's config) and decide what to do."""
    refuse_under_distributed_launcher()
    adapter = Path(adapter_dir).expanduser().resolve()
    out = Path(output_dir).expanduser().resolve()
    if not adapter.is_dir():
        raise MergeError(f"--adapter_dir {adapter_dir}: no such folder. Fix: pass the output_dir of the training run "
                         f"(it holds adapter_config.json and adapter_model.safetensors).")
    if not (adapter / ADAPTER_CONFIG).is_file() or not any((adapter / f).is_file() for f in ADAPTER_WEIGHT_FILES):
        present = sorted(p.name for p in adapter.iterdir())[:8]
        raise MergeError(f"--adapter_dir {adapter_dir} holds no saved adapter ({ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHT_FILES[0]} needed; found {present}). Fix: pass the folder train.py saved the "
                         f"final adapter to (its --output_dir), not a checkpoint-N folder or the base model.")

    from peft import PeftConfig

    try:
        peft_config = PeftConfig.from_pretrained(str(adapter))
    except Exception as e:  # malformed or unknown adapter type
        raise MergeError(f"--adapter_dir {adapter_dir}: {ADAPTER_CONFIG} cannot be read ({type(e).__name__}: {e}). "
                         f"Fix: point at an adapter saved by PEFT.") from e
    if peft_config.is_prompt_learning:
        raise MergeError(f"--adapter_dir {adapter_dir}: a {peft_config.peft_type} adapter adds virtual tokens and "
                         f"has no weights to merge. Fix: use it with PeftModel.from_pretrained; merging needs "
                         f"LoRA/DoRA.")
    base = base_model_name_or_path or peft_config.base_model_name_or_path
    if not base:
        raise MergeError(f"--adapter_dir {adapter_dir}: {ADAPTER_CONFIG} names no base_model_name_or_path. Fix: pass "
                         f"--base_model_name_or_path <the model the adapter was trained on>.")

    # The output: never the adapter or the base, never a half-written or silently replaced folder.
    base_path = Path(base).expanduser()
    protected = [("the adapter folder", adapter)] + ([("the base model", base_path.resolve())]
                                                      if base_path.exists() else [])
    for what, path in protected:
        if _is_within(path, out):  # out is it, or holds it: --overwrite would delete it (a subfolder of it is fine)
            suggestion = adapter.parent / f"{adapter.name}-merged"
            raise MergeError(f"--output_dir {output_dir} is or contains {what} ({path}); replacing it would "
                             f"destroy it. Fix: choose a new folder, e.g. {suggestion}.")
    if out.exists() and not out.is_dir():
        raise MergeError(f"--output_dir {output_dir} is a file. Fix: choose a folder path.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise MergeError(f"--output_dir {output_dir} exists and is not empty. Fix: choose a new folder, or pass "
                         f"--overwrite to replace it (the new model is written beside it and swapped in at the end).")

    try:
        config = read_config(base, trust_remote_code)
    except Exception as e:
        source = ("--base_model_name_or_path" if base_model_name_or_path
                  else f"base_model_name_or_path in {ADAPTER_CONFIG}")
        raise MergeError(f"{source} = {base!r}: its config cannot be loaded ({type(e).__name__}: {e}). Fix: pass "
                         f"--base_model_name_or_path with a local folder or Hub id of the unquantized base.") from e
    from sft_recipe.train.gptq import gptq_merge_refusal

    if refusal := gptq_merge_refusal(base, config):
        raise MergeError(refusal)
    if getattr(config, "quantization_config", None):
        raise MergeError(f"base model {base!r} is a quantized checkpoint (its config has quantization_config); "
                         f"LoRA deltas cannot be added to quantized weights without re-quantizing them. Fix: pass "
                         f"--base_model_name_or_path with the original bf16/fp16/fp32 model.")

    quantized, note = _training_quantization(adapter)
    notes = [note] if note else []
    if dtype == "auto":
        if quantized:
            chosen, reason = torch.bfloat16, f"QLoRA ({quantized} training per {RUN_RECORD}): bf16 base, not 4-bit"
        else:
            chosen, reason = _merge_dtype(config), "the base config's dtype"
    elif dtype in DTYPES:
        chosen, reason = DTYPES[dtype], "--dtype"
    else:
        raise MergeError(f"--dtype {dtype}: unknown. Fix: one of auto, {', '.join(DTYPES)}.")
    if check_tolerance is not None and not check_tolerance > 0:
        raise MergeError(f"--check_tolerance {check_tolerance}: must be > 0 (a fraction of the logit scale). "
                         f"Fix: leave it out for the dtype's default ({CHECK_RELATIVE_TOLERANCE[chosen]:g}).")
    if _has_tokenizer(adapter):
        tokenizer_source = str(adapter)
    else:
        tokenizer_source = base
        notes.append(f"{adapter} has no tokenizer; the base model's is copied")
    return MergePlan(adapter_dir=adapter, output_dir=out, base_model=base, dtype=chosen, dtype_reason=reason,
                     quantized_training=quantized, tokenizer_source=tokenizer_source, overwrite=overwrite,
                     check=check, check_tolerance=check_tolerance, max_shard_size=max_shard_size,
                     trust_remote_code=trust_remote_code, notes=notes)


# ----------------------------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class MergeResult:
    output_dir: Path
    dtype: torch.dtype
    tensors: int
    files: int
    size_bytes: int
    vocab_rows: int
    seconds: float
    check: dict | None  # {"max_abs_diff", "tolerance", "tokens", "adapter_effect", "logit_scale"}

    def summary(self) -> str:
        line = (f"merged model written to {self.output_dir}: {self.tensors} tensors in {self.files} safetensors "
                f"file(s), {self.size_bytes / 2**20:.1f} MiB, dtype {str(self.dtype).removeprefix('torch.')}, "
                f"vocab {self.vocab_rows}, {self.seconds:.1f} s")
        if self.check is None:
            return line + "; logits check skipped (--no-check)"
        c = self.check
        return (line + f"; check OK: max|merged - (base+adapter)| logits = {c['max_abs_diff']:.3g} on {c['tokens']} "
                f"tokens (tolerance {c['tolerance']:.3g}; the adapter itself moves them by {c['adapter_effect']:.3g})")


def _add_eos_to_generation_config(model, tokenizer) -> None:
    """The model learned to end answers with the chat format's end of turn (chatml: <|im_end|>); `generate()` stops
    only at the generation config's EOS ids, so add it there, keeping the base's (the adapter's own
    generation_config.json holds the same ids: artifacts.generation)."""
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        add_chat_eos(gen, tokenizer)


def _written_tensors(folder: Path) -> tuple[int, int, int]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    tensors = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors += len(list(f.keys()))
    return tensors, len(files), sum(p.stat().st_size for p in files)


def _publish(tmp: Path, out: Path) -> None:
    """Swap the finished folder into place: a crash before this line leaves any previous output untouched."""
    if out.exists():
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def run_merge(plan: MergePlan, log=print) -> MergeResult:
    """Load base (unsharded, plan.dtype) + adapter in this process, merge, write to a sibling folder, check, publish."""
    refuse_under_distributed_launcher()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    for note in plan.notes:
        log(f"note: {note}")
    log(f"merging {plan.adapter_dir} into {plan.base_model} in {str(plan.dtype).removeprefix('torch.')} "
        f"({plan.dtype_reason})")
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_source, trust_remote_code=plan.trust_remote_code)
    # No quantization_config, ever: a QLoRA adapter is merged into the plain base in plan.dtype.
    base = AutoModelForCausalLM.from_pretrained(plan.base_model, dtype=plan.dtype,
                                                trust_remote_code=plan.trust_remote_code)
    base_rows = base.get_input_embeddings().weight.shape[0]
    # The adapter's saved embedding (written when training resized the vocab) fixes the row count, or it would not
    # load; otherwise grow to exactly len(tokenizer) as training did (train.model.fit_embeddings_to_tokenizer).
    saved_rows = saved_embedding_rows(plan.adapter_dir, embedding_leaf_name(base))
    rows = saved_rows if saved_rows is not None else max(base_rows, len(tokenizer))
    if rows != base_rows:
        base.resize_token_embeddings(rows, mean_resizing=False)
    if saved_rows is not None and saved_rows != len(tokenizer) and saved_rows > base_rows:
        log(f"note: the adapter's embedding has {saved_rows} rows but its tokenizer {len(tokenizer)} tokens "
            f"(padded vocab, e.g. an upstream multiple-of-8 run); the merged model keeps {saved_rows} rows")
    model = PeftModel.from_pretrained(base, str(plan.adapter_dir))
    model.eval()

    reference = base_only = ids = None
    if plan.check:
        ids = make_check_ids(tokenizer, base_rows, rows, model.peft_config[model.active_adapter])
        reference = compute_logits(model, ids)
        with model.disable_adapter():
            base_only = compute_logits(model, ids)

    # safe_merge: PEFT checks each merged weight for NaN/inf before replacing the original.
    merged = merge_and_unload_unsharded(model, safe_merge=True)
    _add_eos_to_generation_config(merged, tokenizer)
    out = plan.output_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.merging-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(str(tmp), max_shard_size=plan.max_shard_size)
        tokenizer.save_pretrained(str(tmp))
        # Free the in-memory model before the check reloads the written one: peak memory stays one model.
        del merged, model, base
        gc.collect()

        check = None
        if plan.check:
            reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), trust_remote_code=plan.trust_remote_code)
            if reloaded.dtype != plan.dtype:
                raise MergeCheckError(f"the written model loads as {reloaded.dtype}, expected {plan.dtype}")
            got = compute_logits(reloaded, ids)
            del reloaded
            scale = max(1.0, float(reference.abs().max()))
            relative = plan.check_tolerance or CHECK_RELATIVE_TOLERANCE[plan.dtype]
            check = {"max_abs_diff": float((got - reference).abs().max()), "tolerance": relative * scale,
                     "relative_tolerance": relative, "logit_scale": scale, "tokens": int(ids.shape[1]),
                     "adapter_effect": float((reference - base_only).abs().max())}
            problem = check_problem(check["max_abs_diff"], check["tolerance"], check["adapter_effect"])
            if problem is not None:
                failed = out.parent / f"{out.name}.FAILED-CHECK"
                shutil.rmtree(failed, ignore_errors=True)
                os.replace(tmp, failed)
                raise MergeCheckError(f"the merged model does not reproduce base+adapter: {problem}. Nothing was "
                                      f"written to {out}; the files are in {failed} for inspection.")
        tensors, files, size = _written_tensors(tmp)
        info = {"adapter_dir": str(plan.adapter_dir), "base_model": plan.base_model,
                "dtype": str(plan.dtype).removeprefix("torch."), "dtype_reason": plan.dtype_reason,
                "quantized_training": plan.quantized_training, "vocab_rows": rows, "check": check}
        (tmp / MERGE_INFO).write_text(json.dumps(info, indent=2))
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return MergeResult(output_dir=out, dtype=plan.dtype, tensors=tensors, files=files, size_bytes=size,
                       vocab_rows=rows, seconds=time.time() - start, check=check)


def merge_adapter(adapter_dir, output_dir, log=print, **options) -> MergeResult:
    """plan_merge + run_merge: the whole command as a function (options as plan_merge's keywords)."""
    return run_merge(plan_merge(adapter_dir, output_dir, **options), log=log)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merge_adapter.py", description=__doc__.split("\n\n")[0],
                                     epilog=f"Example: {COMMAND}")
    parser.add_argument("--adapter_dir", required=True,
                        help="folder train.py saved the final adapter to (its --output_dir)")
    parser.add_argument("--output_dir", required=True, help="new folder for the merged model")
    parser.add_argument("--base_model_name_or_path", default=None,
                        help="base model to merge into (default: base_model_name_or_path in adapter_config.json)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="dtype of the merged model. auto: bfloat16 when run_record.json says training was "
                             "quantized (QLoRA), else the base config's dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="reload the written model and compare its logits with base+adapter (default: on)")
    parser.add_argument("--check_tolerance", type=float, default=None,
                        help="allowed max logit difference as a fraction of max(1, max|logit|) "
                             "(default: 1e-4 float32, 1e-2 float16, 5e-2 bfloat16)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the base")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = merge_adapter(args.adapter_dir, args.output_dir, base_model_name_or_path=args.base_model_name_or_path,
                               dtype=args.dtype, overwrite=args.overwrite, check=args.check,
                               check_tolerance=args.check_tolerance, max_shard_size=args.max_shard_size,
                               trust_remote_code=args.trust_remote_code)
    except (MergeError, ConfigError) as e:  # ConfigError: a launcher variable that cannot be read
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, MergeCheckError) else 2
    print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
