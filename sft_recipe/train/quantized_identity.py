"""Every rank trains on the same 4-bit base, checked at run time.

Under FSDP2, and FSDP1 without cpu_ram_efficient_loading, each rank quantizes the base itself
(sft_recipe/train/model.py), so nothing but identical inputs and identical arithmetic makes the ranks agree. A
machine with another bitsandbytes or torch build, or another CPU instruction set behind the CPU kernels, can quantize
the same file to other bytes; FSDP would then shard one rank's packed weights with another's absmax, and the
averaged gradients would be of no model at all, silently. Before any weight is wrapped, each rank takes an exact
checksum of its packed weights and of every quantization-state tensor (seconds for a 70B: one pass over its ~35 GiB)
and the ranks compare them; a rank that differs stops every rank with the fix. Where rank 0 alone loaded it
(sft_recipe/train/quantized_from_rank0.py) the others hold its quantization state and no packed weights yet: the
state is compared everywhere, packed bytes where a rank holds them."""

from __future__ import annotations

import time

from sft_recipe.errors import ConfigError
from sft_recipe.measure import quant_state_tensors, tensors_checksum


def quantized_base_fingerprint(model) -> tuple[int | None, int, int] | None:
    """(packed weights checksum, quantization state checksum, packed weights) of this rank's 4-bit base, or None
    for a base that has no quantization state. A packed weight is one that carries its quant_state; the checksum is
    None where they are all placeholders (meta: FSDP1 fills them from rank 0 as it wraps, quantized_from_rank0)."""
    packed = [p for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    if not packed:
        return None
    held = [p for p in packed if p.device.type != "meta"]
    return (tensors_checksum(held) if held else None), tensors_checksum(quant_state_tensors(model)), len(packed)


def differing_ranks(fingerprints: list) -> list[int]:
    """Ranks whose fingerprint is not rank 0's: another quantization state or count, or other packed bytes where
    both hold packed weights."""
    def differs(fp) -> bool:
        if fp is None or fingerprints[0] is None:
            return fp != fingerprints[0]
        packed_differ = fp[0] is not None and fingerprints[0][0] is not None and fp[0] != fingerprints[0][0]
        return packed_differ or fp[1:] != fingerprints[0][1:]
    return [rank for rank, fp in enumerate(fingerprints) if differs(fp)]


def check_quantized_base_identical(model, launch) -> str | None:
    """Compare the 4-bit base across ranks (a collective: every rank calls it). Returns what to log, None when there
    is nothing to compare (one process, or no 4-bit base); raises ConfigError on every rank when a rank differs."""
    import torch.distributed as dist

    started = time.perf_counter()
    mine = quantized_base_fingerprint(model)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if everyone[0] is None:
        return None
    differ = differing_ranks(everyone)
    if differ:
        raise ConfigError([
            f"the 4-bit base differs between ranks: rank{'s' if len(differ) > 1 else ''} "
            f"{', '.join(map(str, differ))} quantized it to other bytes than rank 0 (packed weights and quantization "
            f"state checksums {[fp[:2] if fp else None for fp in everyone]}). FSDP would shard one rank's packed "
            "weights with another's quantization state and train on no model at all. Every rank quantizes the same "
            "file itself, so the machines differ: the same bitsandbytes, torch and CPU kind on every machine fixes "
            "it (pip freeze | grep -iE 'bitsandbytes|torch' on each)."])
    holders = sum(fp[0] is not None for fp in everyone)
    what = ("packed weights and their quantization state" if holders == len(everyone) else
            f"quantization state; packed weights on {holders} of them, the others' filled from rank 0 at wrapping")
    return (f"the 4-bit base is identical on all {len(everyone)} ranks ({everyone[0][2]} weights: {what}; exact "
            f"checksums compared in {time.perf_counter() - started:.1f} s)")
