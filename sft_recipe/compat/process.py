"""torch 2.13 + gloo: a finished rank can abort in interpreter teardown; bitsandbytes 0.50: a CPU evaluation re-lays
out 4-bit weights in place."""

from __future__ import annotations

import os


def exit_skipping_teardown(code: int, world_size: int) -> None:
    """End a rank of a multi-process run without Python's interpreter teardown.

    Bug (torch 2.13 + gloo, CPU, intermittent: seen about once in 40 launches): after a rank has finished, saved and
    destroyed its process group, interpreter teardown can destroy a still-joinable C++ thread -- "terminate called
    without an active exception", SIGABRT -- so torchrun reports a finished (or cleanly preempted) run as failed.
    So the exit handlers libraries registered run first (`atexit`: W&B's run finish, which transformers' callback
    leaves to it -- skipped, an offline run kept only its header and an online one ended as crashed; the removal of
    a temporary datasets cache; logging's shutdown), then streams are flushed and the process exits at once.
    When it can go: `bench/parity.py` run in a loop (about 80 launches) shows no SIGABRT without this.
    """
    import atexit
    import sys

    if world_size <= 1:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter's teardown would run first; the teardown itself is the bug
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def restore_bnb_4bit_storage_layout(model) -> int:
    """Put 4-bit weights that bitsandbytes re-laid out for CPU inference back in their stored layout; returns how many.

    Behaviour (bitsandbytes 0.50, CPUs with AVX512-BF16 only): a `Linear4bit` forward in eval mode without grad
    rewrites its packed weight bytes into a CPU-kernel layout (`packing_format_for_cpu`); `state_dict()` converts
    them back. The values are the same, the bytes are not, so the run record's exact frozen-weight checksum after an
    evaluation said "frozen weights CHANGED" (seen with QLoRA under DDP, where only rank 0's save converted its
    copy back). The checksum runs on the stored layout, as a saved state dict holds it.
    When it can go: `tests/unit/test_record.py::test_a_cpu_evaluation_does_not_change_frozen_4bit_bytes` passes
    without this call (or bitsandbytes stops re-laying out weights in place).
    """
    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
    except ImportError:
        return 0
    restored = 0
    for module in model.modules():
        # The registered parameter, not `module.weight`: PEFT's trainable-token and modules-to-save wrappers answer
        # `weight` by merging their rows into the base weight, which under FSDP1 is a flat shard (IndexError at the
        # end of a QLoRA run with --train_new_tokens; bench/use_orig_params.py found it).
        weight = module._parameters.get("weight")
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            restored += 1
    return restored
