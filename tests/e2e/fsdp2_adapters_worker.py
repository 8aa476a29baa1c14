"""One rank of tests/e2e/test_fsdp2_adapters.py: two LoRA adapters on an FSDP2-wrapped PEFT model, measured.

Launched by the test, never by hand in normal use:
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp2_config.yaml \
        tests/e2e/fsdp2_adapters_worker.py --model_dir .tiny/model --out_dir /tmp/fsdp2_adapters

Each rank writes <out_dir>/rank<N>.json with what it observed; the test asserts on every rank's file. This script
asserts nothing itself (so one run reports every fact, not only the first surprise), except that the run really is
FSDP2 -- measuring DDP would make every fact meaningless.

Setup as train.py does it: accelerate's own FSDP2 preparation (`accelerator.prepare(model, optimizer)`) with the
CPU promotion of sft_recipe.compat, cpu_ram_efficient_loading (rank 0 loads, others start on meta), fp32.
LoRA targets every linear layer *and* lm_head, so that one adapter layer lives in the unit accelerate creates with
`reshard_after_forward=False` ([final norm, lm_head]) -- the unit where PEFT's flag changes can miss the shards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STEPS_PER_PHASE = 3
LEARNING_RATE = 1e-2
BATCH_SEQUENCES = 2
SEQUENCE_TOKENS = 16
FIRST_NON_SPECIAL_TOKEN_ID = 3  # <unk>, <s>, </s> are 0..2 in the tiny tokenizer
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()

    from sft_recipe.startup import freeze_imports, prepare_tool_imports

    prepare_tool_imports()  # as train.py (sft_recipe/startup.py): no cyclic collector, the models scan cached
    from sft_recipe import compat
    from sft_recipe.config.launch_env import read_launch_env

    launch = read_launch_env()
    compat.install(launch)

    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from sft_recipe.compat.fsdp2_adapters import (
        adapter_parameters,
        check_optimizer_covers,
        disable_adapter_fsdp2,
        set_adapter_fsdp2,
        set_requires_grad_fsdp2,
    )

    freeze_imports()
    torch.manual_seed(0)
    # The unsharded base model, loaded before the process group exists so that every rank gets real weights.
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()

    accelerator = Accelerator()
    rank = accelerator.process_index
    facts: dict = {"rank": rank, "world_size": accelerator.num_processes,
                   "distributed_type": str(accelerator.distributed_type),
                   "fsdp_version": getattr(accelerator.state.fsdp_plugin, "fsdp_version", None)}
    if facts["distributed_type"] != "DistributedType.FSDP" or facts["fsdp_version"] != 2:
        raise SystemExit(f"not an FSDP2 run: {facts}")

    vocab = reference.config.vocab_size
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as in data parallelism

    def batch():
        ids = torch.randint(FIRST_NON_SPECIAL_TOKEN_ID, vocab, (BATCH_SEQUENCES, SEQUENCE_TOKENS), generator=generator)
        return ids

    def build(optimizer_over: str):
        """A PEFT model with adapters "a" (active) and "b", prepared for FSDP2 by accelerate.

        optimizer_over="both": both adapters made trainable for building the optimizer, then "b" frozen again --
        before wrapping, to show that what matters is being in the optimizer, not being trainable when wrapped.
        optimizer_over="trainable": the optimizer gets the trainable parameters only, as transformers' Trainer does.
        """
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
        model = get_peft_model(base, config, adapter_name="a")
        model.add_adapter("b", config)
        if optimizer_over == "both":
            model.set_requires_grad(["a", "b"], True)
        params = [p for p in model.parameters() if p.requires_grad]
        model.set_adapter("a")
        # No weight decay: AdamW would then move nothing without a gradient, so "unchanged" is exact.
        optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
        return accelerator.prepare(model, optimizer)

    def groups(model) -> dict[str, dict[str, torch.nn.Parameter]]:
        """Parameters by role: adapter a / b in decoder layers or in lm_head, and the frozen base."""
        out = {"a_layers": {}, "a_lm_head": {}, "b_layers": {}, "b_lm_head": {}}
        adapter_ids = set()
        for adapter in ("a", "b"):
            for name, param in adapter_parameters(model, adapter).items():
                out[f"{adapter}_{'lm_head' if name.split('.lora_')[0].endswith('lm_head') else 'layers'}"][name] = param
                adapter_ids.add(id(param))
        out["base"] = {n: p for n, p in model.named_parameters() if id(p) not in adapter_ids}
        return out

    def registered_are_dtensors(model) -> dict[str, bool]:
        return {g: all(isinstance(p, DTensor) for p in ps.values()) for g, ps in groups(model).items()}

    def requires_grad(model) -> dict[str, list[bool]]:
        """Sorted set of requires_grad per group, read from what is registered now (DTensors when resharded)."""
        return {g: sorted({p.requires_grad for p in ps.values()}) for g, ps in groups(model).items()}

    def with_grad(model) -> dict[str, int]:
        return {g: sum(p.grad is not None for p in ps.values()) for g, ps in groups(model).items()}

    def snapshot(model) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's shard of every parameter; only valid when every unit is resharded (after a step)."""
        shards = {}
        for g, ps in groups(model).items():
            if not all(isinstance(p, DTensor) for p in ps.values()):
                raise RuntimeError(f"snapshot while {g} is gathered: the measurement would compare full tensors")
            shards[g] = {n: p.to_local().detach().clone() for n, p in ps.items()}
        return shards

    def changed(before, after) -> dict[str, int]:
        """Per group, how many parameters' local shards differ at all (0 means bit-identical)."""
        return {g: sum(not torch.equal(before[g][n], after[g][n]) for n in before[g]) for g in before}

    def step(model, optimizer) -> dict:
        loss = model(input_ids=(ids := batch()), labels=ids).loss
        accelerator.backward(loss)
        grads = with_grad(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # a None grad is what keeps AdamW from moving a frozen adapter
        return {"loss": loss.item(), "with_grad": grads}

    def steps_with_changes(model, optimizer, count: int, before) -> list[dict]:
        """Train `count` steps from weights `before`; after each, which groups changed in that step."""
        out = []
        for _ in range(count):
            record = step(model, optimizer)
            after = snapshot(model)
            record["changed"] = changed(before, after)
            out.append(record)
            before = after
        return out

    def counts(model) -> dict[str, int]:
        return {g: len(ps) for g, ps in groups(model).items()}

    # ---- Setup the guide's way round: both adapters in the optimizer ---------------------------------------------
    model, optimizer = build("both")
    units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts["setup"] = {
        "fsdp2_units": units,
        "params_per_group": counts(model),
        "in_optimizer_per_group": {g: sum(id(p) in in_optimizer for p in ps.values())
                                   for g, ps in groups(model).items()},
        "optimizer_params": len(in_optimizer),
        "registered_are_dtensors": registered_are_dtensors(model),
        "requires_grad": requires_grad(model),
    }
    model.train()
    start = snapshot(model)

    # ---- 1: train "a", switch with plain set_adapter("b") right after a step, train "b" -------------------------
    phase_a = [step(model, optimizer) for _ in range(STEPS_PER_PHASE)]
    after_a = snapshot(model)
    model.set_adapter("b")  # every unit was resharded by backward: the flags land on the DTensors
    switch_flags = requires_grad(model)
    phase_b = [step(model, optimizer) for _ in range(STEPS_PER_PHASE)]
    after_b = snapshot(model)
    facts["switch_between_steps"] = {
        "phase_a": phase_a, "phase_b": phase_b, "requires_grad_after_switch": switch_flags,
        "changed_by_phase_a": changed(start, after_a), "changed_by_phase_b": changed(after_a, after_b),
        "changed_since_start": changed(start, after_b),
    }

    # ---- 2: PEFT's set_requires_grad on resharded units reaches the DTensors and decides the gradients -----------
    def grads_of_one_backward() -> dict[str, int]:
        loss = model(input_ids=(ids := batch()), labels=ids).loss
        accelerator.backward(loss)
        out = with_grad(model)
        optimizer.zero_grad(set_to_none=True)
        return out

    # "a" made trainable while "b" alone is active: the flag reaches a's DTensors, but an inactive adapter is not
    # in the forward, so it still gets no gradient (PEFT semantics, not FSDP's).
    model.set_requires_grad("a", True)
    inactive_on = {"requires_grad": requires_grad(model), "registered_are_dtensors": registered_are_dtensors(model),
                   "with_grad": grads_of_one_backward()}
    # Both active (the tuner-level call: PeftModel.set_adapter takes one name) and both trainable: both get
    # gradients; then set_requires_grad("a", False) alone decides that "a" gets none.
    model.base_model.set_adapter(["a", "b"])
    both_active = {"requires_grad": requires_grad(model), "with_grad": grads_of_one_backward()}
    model.set_requires_grad("a", False)
    both_active_a_off = {"requires_grad": requires_grad(model), "with_grad": grads_of_one_backward()}
    model.set_adapter("b")
    facts["set_requires_grad"] = {"inactive_a_on": inactive_on, "both_active": both_active,
                                  "both_active_a_off": both_active_a_off,
                                  "weights_changed": changed(after_b, snapshot(model))}

    # ---- 3: disable_adapter gives the base model's logits; leaving it restores the adapter's ----------------------
    before_eval = snapshot(model)
    model.eval()
    eval_ids = batch()
    with torch.no_grad():
        base_logits = reference(input_ids=eval_ids).logits
        adapter_logits = model(input_ids=eval_ids).logits.clone()
        with model.disable_adapter():
            disabled_logits = model(input_ids=eval_ids).logits.clone()
        restored_logits = model(input_ids=eval_ids).logits.clone()
    facts["disable_adapter"] = {
        "disabled_vs_base_max_abs": (disabled_logits - base_logits).abs().max().item(),
        "disabled_equals_base": torch.equal(disabled_logits, base_logits),
        "restored_vs_adapter_max_abs": (restored_logits - adapter_logits).abs().max().item(),
        "restored_equals_adapter": torch.equal(restored_logits, adapter_logits),
        "adapter_vs_base_max_abs": (adapter_logits - base_logits).abs().max().item(),
    }
    model.train()

    # ---- 4: the pitfall: plain set_adapter after an eval forward (the lm_head unit is still gathered) -------------
    gathered = registered_are_dtensors(model)
    model.set_adapter("a")
    facts["plain_switch_while_gathered"] = {
        "registered_are_dtensors_at_switch": gathered,
        "steps": steps_with_changes(model, optimizer, STEPS_PER_PHASE, before_eval),
        "requires_grad_after_steps": requires_grad(model),  # all resharded now: these are the DTensors' flags
    }

    # ---- 5: the pitfall at the exit of a plain disable_adapter (active: "a") --------------------------------------
    before_eval = snapshot(model)
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        model(input_ids=batch())
    model.train()
    facts["plain_disable_adapter_exit"] = {"steps": steps_with_changes(model, optimizer, 2, before_eval),
                                           "requires_grad_after_steps": requires_grad(model)}

    # ---- 6: the workaround (sft_recipe.compat.fsdp2_adapters) in the same situations -------------------------
    before_eval = snapshot(model)
    model.eval()
    with torch.no_grad():
        model(input_ids=batch())  # leaves the lm_head unit gathered, as in 4
    model.train()
    set_adapter_fsdp2(model, "b")
    fixed_switch = {"requires_grad_at_switch": requires_grad(model),
                    "registered_are_dtensors_at_switch": registered_are_dtensors(model),
                    "steps": steps_with_changes(model, optimizer, 2, before_eval)}
    before_eval = snapshot(model)
    model.eval()
    with torch.no_grad(), disable_adapter_fsdp2(model):
        model(input_ids=batch())
    model.train()
    fixed_disable = {"requires_grad_after_exit": requires_grad(model),
                     "steps": steps_with_changes(model, optimizer, 2, before_eval)}
    model.eval()
    with torch.no_grad():
        model(input_ids=batch())
    model.train()
    set_requires_grad_fsdp2(model, "a", True)
    fixed_requires_grad = {"requires_grad": requires_grad(model)}
    set_requires_grad_fsdp2(model, "a", False)
    # The optimizer check while the lm_head unit is gathered: it must compare the DTensors, not the gathered copies.
    model.eval()
    with torch.no_grad():
        model(input_ids=batch())
    model.train()
    gathered_at_check = registered_are_dtensors(model)
    try:
        check_optimizer_covers(model, optimizer, ["a", "b"])
        check_error = None
    except ValueError as error:
        check_error = str(error)
    facts["workaround"] = {"set_adapter": fixed_switch, "disable_adapter": fixed_disable,
                           "set_requires_grad": fixed_requires_grad,
                           "optimizer_check_while_gathered": {"registered_are_dtensors": gathered_at_check,
                                                              "error": check_error}}

    # ---- 7: optimizer built over the trainable parameters only (Trainer's way): "b" can never learn ---------------
    model2, optimizer2 = build("trainable")
    in_optimizer2 = {id(p) for group in optimizer2.param_groups for p in group["params"]}
    refusals = {}
    for label, call in (("check_optimizer_covers", lambda: check_optimizer_covers(model2, optimizer2, "b")),
                        ("set_adapter_fsdp2", lambda: set_adapter_fsdp2(model2, "b", optimizer=optimizer2))):
        try:
            call()
            refusals[label] = None
        except ValueError as error:
            refusals[label] = str(error)
    model2.train()
    model = model2  # step() and the snapshots read `model`
    optimizer = optimizer2
    step(model, optimizer)
    model.set_adapter("b")
    before_b = snapshot(model)
    facts["optimizer_without_b"] = {
        "in_optimizer_per_group": {g: sum(id(p) in in_optimizer2 for p in ps.values())
                                   for g, ps in groups(model).items()},
        "refusals": refusals,
        "steps": steps_with_changes(model, optimizer, 2, before_b),
    }

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    compat.exit_skipping_teardown(0, launch.world_size)


if __name__ == "__main__":
    main()
