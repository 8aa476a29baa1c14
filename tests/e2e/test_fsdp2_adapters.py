"""Two LoRA adapters on an FSDP2-wrapped PEFT model: what works, what silently does not, and the workaround.

One real launch: `ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp2_config.yaml
tests/e2e/fsdp2_adapters_worker.py` on 2 CPU processes over gloo. accelerate rather than bare torchrun because the
wrapping under test is accelerate's FSDP2 preparation (the one train.py gets): its unit layout, the
`reshard_after_forward=False` tail unit for [final norm, lm_head], the optimizer's switch to the DTensor
parameters, and cpu_ram_efficient_loading. Each rank writes what it saw; every test asserts on both ranks.

The PEFT guide's FSDP2 note says `set_adapter()` / `set_requires_grad()` (and, in some cases, the exit of
`disable_adapter()`) reshard the FSDP2 units so that `requires_grad` changes reach the sharded parameters.
peft 0.21.2 (this stack) does not do that. What holds here:
- between optimizer steps (every unit resharded by backward) the plain PEFT calls work: only the active adapter
  gets gradients and moves, the other adapter and the frozen base stay bit-identical;
- `disable_adapter()` gives exactly the base model's logits and its exit restores the adapter's exactly;
- after a forward without backward (evaluation), a unit that does not reshard after forward (accelerate's
  [norm, lm_head] unit; the root) is still gathered: the flag change lands on the gathered copy, the next all-gather
  overwrites it, and a LoRA on lm_head trains for one step and then silently stops (pinned below);
- the workaround, `sft_recipe.compat.fsdp2_adapters` (reshard every unit before the PEFT call), fixes both cases;
- an adapter missing from the optimizer gets gradients but never moves (transformers' Trainer builds the optimizer
  over the parameters trainable at that moment); being frozen when wrapped is fine if it is in the optimizer.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import REPO, accelerate_launch, free_port, launch_env, run_command

WORKER = REPO / "tests" / "e2e" / "fsdp2_adapters_worker.py"
STEPS_PER_PHASE = 3  # the worker's phase length
ADAPTER_GROUPS = ("a_layers", "a_lm_head", "b_layers", "b_lm_head")
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ranks(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_adapters")
    cmd = [*accelerate_launch(),
           "--config_file", str(REPO / "configs" / "cpu" / "fsdp2_config.yaml"),
           "--main_process_port", str(free_port()),
           str(WORKER), "--model_dir", str(tiny.model_dir), "--out_dir", str(out)]
    started_s = time.monotonic()
    result = run_command(cmd, out, env=launch_env(), timeout=LAUNCH_TIMEOUT_S)
    print(f"fsdp2 adapters launch: {time.monotonic() - started_s:.1f} s")
    assert result.returncode == 0, result.output[-6000:]
    facts = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [f["rank"] for f in facts] == [0, 1]
    return facts


def _all(observed: dict, sizes: dict, *groups: str) -> bool:
    """Every parameter of these groups counted (all changed / all have gradients), every other group zero."""
    return all(observed[g] == (sizes[g] if g in groups else 0) for g in observed)


def test_really_fsdp2_with_dtensor_shards_and_both_adapters_in_the_optimizer(ranks):
    for facts in ranks:
        assert facts["distributed_type"] == "DistributedType.FSDP" and facts["fsdp_version"] == 2
        assert facts["world_size"] == 2
        setup = facts["setup"]
        # accelerate's layout: root (the PeftModel), embeddings, one unit per decoder layer, the lm_head tail.
        assert setup["fsdp2_units"] == ["<root>", "base_model.model.model.embed_tokens",
                                        "base_model.model.model.layers.0", "base_model.model.model.layers.1",
                                        "base_model.model.lm_head"], setup["fsdp2_units"]
        assert all(setup["registered_are_dtensors"].values())
        sizes = setup["params_per_group"]
        assert sizes["a_layers"] == sizes["b_layers"] == 2 * 7 * 2  # lora_A + lora_B, 7 linears, 2 layers
        assert sizes["a_lm_head"] == sizes["b_lm_head"] == 2
        # The optimizer holds exactly both adapters' DTensor parameters (accelerate switched them), no base weight.
        assert setup["in_optimizer_per_group"] == {**{g: sizes[g] for g in ADAPTER_GROUPS}, "base": 0}
        assert setup["optimizer_params"] == sum(sizes[g] for g in ADAPTER_GROUPS)
        # "b" was frozen before wrapping; that is allowed (it still trains after the switch, below).
        assert setup["requires_grad"] == {"a_layers": [True], "a_lm_head": [True], "b_layers": [False],
                                          "b_lm_head": [False], "base": [False]}


def test_switch_between_steps_trains_only_the_active_adapter(ranks):
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        run = facts["switch_between_steps"]
        assert len(run["phase_a"]) == len(run["phase_b"]) == STEPS_PER_PHASE
        for record in run["phase_a"]:
            assert _all(record["with_grad"], sizes, "a_layers", "a_lm_head"), record
        assert run["requires_grad_after_switch"] == {"a_layers": [False], "a_lm_head": [False],
                                                     "b_layers": [True], "b_lm_head": [True], "base": [False]}
        for record in run["phase_b"]:
            assert _all(record["with_grad"], sizes, "b_layers", "b_lm_head"), record
        # Every parameter of the active adapter's shard moved; the other adapter and the base are bit-identical.
        assert _all(run["changed_by_phase_a"], sizes, "a_layers", "a_lm_head"), run["changed_by_phase_a"]
        assert _all(run["changed_by_phase_b"], sizes, "b_layers", "b_lm_head"), run["changed_by_phase_b"]
        assert run["changed_since_start"]["base"] == 0


def test_set_requires_grad_reaches_the_dtensor_shards_and_decides_gradients(ranks):
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        grad_flags = facts["set_requires_grad"]
        inactive_on = grad_flags["inactive_a_on"]
        assert all(inactive_on["registered_are_dtensors"].values())
        assert inactive_on["requires_grad"]["a_layers"] == inactive_on["requires_grad"]["a_lm_head"] == [True]
        # Trainable is not active: "a" is not in the forward, so it gets no gradient.
        assert _all(inactive_on["with_grad"], sizes, "b_layers", "b_lm_head"), inactive_on
        both = grad_flags["both_active"]
        assert _all(both["with_grad"], sizes, *ADAPTER_GROUPS), both
        a_off = grad_flags["both_active_a_off"]
        assert a_off["requires_grad"]["a_layers"] == a_off["requires_grad"]["a_lm_head"] == [False]
        assert _all(a_off["with_grad"], sizes, "b_layers", "b_lm_head"), a_off
        assert not any(grad_flags["weights_changed"].values())  # backward only, no optimizer step


def test_disable_adapter_gives_base_logits_and_its_exit_restores_the_adapter(ranks):
    for facts in ranks:
        check = facts["disable_adapter"]
        # Same fp32 weights and the same ops as the unsharded base model in the same process: bit-identical.
        assert check["disabled_equals_base"], check
        assert check["restored_equals_adapter"], check
        assert check["adapter_vs_base_max_abs"] > 0.1, check  # the adapters really change the output


def test_pitfall_plain_set_adapter_after_an_eval_forward_trains_the_lm_head_lora_once(ranks):
    """peft 0.21.2: not what the guide describes. If this fails, check whether PEFT now reshards in set_adapter
    (then the workaround is no longer needed; update sft_recipe/compat/fsdp2_adapters.py and docs/guide-caveats.md)."""
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        run = facts["plain_switch_while_gathered"]
        # The eval forward left the [norm, lm_head] unit gathered; the decoder layers were resharded.
        gathered = run["registered_are_dtensors_at_switch"]
        assert gathered["a_lm_head"] is False and gathered["b_lm_head"] is False
        assert gathered["a_layers"] is True and gathered["b_layers"] is True
        first, *later = run["steps"]
        assert _all(first["changed"], sizes, "a_layers", "a_lm_head"), first  # the gathered copy's flag, once
        for record in later:  # then the all-gather copies the DTensor's stale flag back: lm_head's "a" is frozen
            assert _all(record["with_grad"], sizes, "a_layers"), record
            assert _all(record["changed"], sizes, "a_layers"), record
        assert run["requires_grad_after_steps"]["a_lm_head"] == [False]  # active, yet not trainable
        assert run["requires_grad_after_steps"]["b_lm_head"] == [True]  # inactive, yet trainable


def test_pitfall_plain_disable_adapter_exit_after_a_forward_freezes_the_lm_head_lora(ranks):
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        first, second = facts["plain_disable_adapter_exit"]["steps"]
        assert _all(first["changed"], sizes, "a_layers", "a_lm_head"), first
        assert _all(second["changed"], sizes, "a_layers"), second
        assert facts["plain_disable_adapter_exit"]["requires_grad_after_steps"]["a_lm_head"] == [False]


def test_workaround_reaches_the_shards_in_the_same_situations(ranks):
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        fix = facts["workaround"]
        switch = fix["set_adapter"]
        assert all(switch["registered_are_dtensors_at_switch"].values())
        assert switch["requires_grad_at_switch"] == {"a_layers": [False], "a_lm_head": [False],
                                                     "b_layers": [True], "b_lm_head": [True], "base": [False]}
        for record in switch["steps"] + fix["disable_adapter"]["steps"]:
            assert _all(record["with_grad"], sizes, "b_layers", "b_lm_head"), record
            assert _all(record["changed"], sizes, "b_layers", "b_lm_head"), record
        assert fix["disable_adapter"]["requires_grad_after_exit"] == switch["requires_grad_at_switch"]
        assert fix["set_requires_grad"]["requires_grad"]["a_lm_head"] == [True]  # after an eval forward too
        check = fix["optimizer_check_while_gathered"]
        assert check["registered_are_dtensors"]["a_lm_head"] is False  # gathered copies registered...
        assert check["error"] is None  # ...yet both adapters are found in the optimizer (it reshards first)


def test_an_adapter_missing_from_the_optimizer_gets_gradients_but_never_moves(ranks):
    for facts in ranks:
        sizes = facts["setup"]["params_per_group"]
        run = facts["optimizer_without_b"]
        assert run["in_optimizer_per_group"] == {"a_layers": sizes["a_layers"], "a_lm_head": sizes["a_lm_head"],
                                                 "b_layers": 0, "b_lm_head": 0, "base": 0}
        for record in run["steps"]:
            assert _all(record["with_grad"], sizes, "b_layers", "b_lm_head"), record
            assert not any(record["changed"].values()), record  # silently: nothing learns
        # The helper refuses the switch up front, naming the adapter, a parameter and the fix.
        for message in run["refusals"].values():
            assert message is not None
            assert "adapter 'b'" in message and "lora_A.b.weight" in message and "not in the optimizer" in message
            assert "set_requires_grad" in message
