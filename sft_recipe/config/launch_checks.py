"""Checks for upstream's other launch paths, run before any weight loads: Unsloth (run_unsloth_peft.sh) and plain
DDP through torchrun (run_peft_multigpu.sh)."""

from __future__ import annotations

import importlib.util


def unsloth_problems(m) -> list[str]:
    """--use_unsloth True: upstream hands the model to Unsloth's FastLanguageModel on ONE GPU. That path is not
    reproduced here; the flag is refused with why and what to run instead, before any model load."""
    if not m.use_unsloth:
        return []
    import torch

    reasons = []
    if importlib.util.find_spec("unsloth") is None:
        reasons.append("the unsloth package is not installed")
    if not torch.cuda.is_available():
        reasons.append("there is no CUDA GPU (Unsloth's kernels are CUDA/Triton only)")
    why = "; ".join(reasons) if reasons else "this recipe does not implement the Unsloth model path"
    return [f"--use_unsloth True: {why}, and this recipe trains through PEFT + TRL without Unsloth. Fix: drop "
            "--use_unsloth: `bash run_peft.sh` is the same one-GPU QLoRA run without Unsloth's kernels; for "
            "Unsloth itself use its own scripts (https://docs.unsloth.ai)."]


def ddp_problems(m, t, launch) -> list[str]:
    """Plain DDP (torchrun, or accelerate without FSDP/DeepSpeed) with reentrant activation checkpointing fails in the
    first backward: each checkpointed block re-runs its forward inside backward, and DDP's reducer sees the same
    parameters become ready twice ("Expected to mark a variable ready only once"). Upstream's multi-GPU script
    therefore passes --use_reentrant False."""
    world_size = launch.world_size
    if world_size < 2 or launch.use_fsdp or launch.use_deepspeed or not (t.gradient_checkpointing and m.use_reentrant):
        return []
    return [f"--use_reentrant True with --gradient_checkpointing True under DDP ({world_size} processes, no FSDP): "
            "DDP fails in the first backward (\"Expected to mark a variable ready only once\"), because reentrant "
            "checkpointing re-runs each block's forward inside backward. Fix: --use_reentrant False (as "
            "run_peft_multigpu.sh), or one process (run_peft.sh), or FSDP."]


def activation_offloading_problems(t, launch) -> list[str]:
    """--activation_offloading True (TRL's: saved activations move from the GPU to host RAM during forward and back
    for backward), where it is exercised: one process and FSDP2 on a GPU (bench/gpu_check.sh's lora+actoffload row).
    - Without a GPU there is nothing to offload to: TRL 1.16 asks `torch.accelerator.current_accelerator()`, which is
      None on a CPU, and the trainer fails after the model has loaded.
    - FSDP1 (flat parameters) and DeepSpeed ZeRO-3 hand the modules gathered weights that are not `nn.Parameter`s,
      and TRL tells weights from activations by that type and by storages recorded before wrapping: every gathered
      layer's weights would be copied to host RAM and back each step as if they were activations."""
    if not getattr(t, "activation_offloading", False):
        return []
    import torch

    if launch.use_cpu or getattr(t, "use_cpu", False) or not torch.cuda.is_available():
        return ["--activation_offloading True needs a CUDA GPU: it moves saved activations from the GPU to host RAM, "
                "and on a CPU run they are in host RAM already (TRL 1.16 fails looking for an accelerator). Fix: "
                "--activation_offloading False."]
    if (launch.use_fsdp and launch.fsdp_version == 1) or launch.use_deepspeed:
        engine = "FSDP1" if launch.use_fsdp else "DeepSpeed"
        return [f"--activation_offloading True under {engine}: TRL 1.16 would offload the gathered weights of every "
                "layer as if they were activations (they are not nn.Parameters there). Fix: FSDP2 "
                "(configs/fsdp2_config.yaml) or one process, or --activation_offloading False."]
    return []
