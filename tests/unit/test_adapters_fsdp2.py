"""sft_recipe.compat.fsdp2_adapters without processes: the order of operations and the refusals.

The real FSDP2 behaviour (gathered units, DTensor flags, what trains) is measured on 2 ranks in
tests/e2e/test_fsdp2_adapters.py. Here an FSDP2 unit is stood in for by a module whose `reshard()` records what
PEFT's state was at that moment, which is what the helpers promise: reshard first, then let PEFT flip the flags.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from sft_recipe.compat import fsdp2_adapters as adapters_fsdp2
from sft_recipe.compat.fsdp2_adapters import (
    adapter_parameters,
    check_optimizer_covers,
    disable_adapter_fsdp2,
    reshard_fsdp2_units,
    set_adapter_fsdp2,
    set_requires_grad_fsdp2,
)

TARGETS = ["fc1", "fc2"]
# PEFT warns that the name "a" occurs in the "lora_" prefix, which matters only when loading saved adapters by key;
# these tests never save or load, and "a"/"b" are the names the e2e test and the guide's example use.
pytestmark = pytest.mark.filterwarnings("ignore:Adapter name 'a' should not be contained")


class RecordingUnit(nn.Module):
    """Stands in for an FSDP2 unit around `inner`; each `reshard()` appends `probe()` to `log`."""

    def __init__(self, inner: nn.Module, log: list, probe):
        super().__init__()
        self.inner = inner
        self._log = log
        self._probe = probe

    def reshard(self) -> None:
        self._log.append(self._probe())


@pytest.fixture()
def peft_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=nn.Linear(8, 4)))
    # Non-zero lora_B so that disabling the adapter changes the output.
    config = LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config, adapter_name="a")
    model.add_adapter("b", config)
    return model


@pytest.fixture()
def units(monkeypatch):
    """Make the helpers treat RecordingUnit as the FSDP2 unit class."""
    monkeypatch.setattr(adapters_fsdp2, "FSDPModule", RecordingUnit)


def _flags(model, adapter: str) -> set[bool]:
    return {p.requires_grad for p in adapter_parameters(model, adapter).values()}


def test_adapter_parameters_are_exactly_that_adapters_lora_weights(peft_model):
    found = adapter_parameters(peft_model, "b")
    assert len(found) == 2 * len(TARGETS)  # lora_A and lora_B per target
    registered = dict(peft_model.named_parameters())
    for name, param in found.items():
        assert ".lora_A.b." in name or ".lora_B.b." in name
        assert registered[name] is param  # the names are the model's own parameter names
    assert adapter_parameters(peft_model, "missing") == {}


def test_set_adapter_reshards_every_unit_before_peft_changes_the_flags(peft_model, units):
    log: list = []
    probe = lambda: (peft_model.active_adapter, _flags(peft_model, "b"))  # noqa: E731
    # An outer unit around the PeftModel (the guide: PEFT itself does not reshard those) and one more level.
    wrapped = RecordingUnit(RecordingUnit(peft_model, log, probe), log, probe)

    set_adapter_fsdp2(wrapped, "b")

    assert log == [("a", {False}), ("a", {False})]  # both units, before the switch
    assert peft_model.active_adapter == "b"
    assert _flags(peft_model, "b") == {True} and _flags(peft_model, "a") == {False}


def test_set_requires_grad_reshards_first(peft_model, units):
    log: list = []
    wrapped = RecordingUnit(peft_model, log, lambda: _flags(peft_model, "b"))

    set_requires_grad_fsdp2(wrapped, "b", True)
    assert log == [{False}] and _flags(peft_model, "b") == {True}
    set_requires_grad_fsdp2(wrapped, ["a", "b"], False)
    assert log == [{False}, {True}] and _flags(peft_model, "a") == _flags(peft_model, "b") == {False}


def test_disable_adapter_reshards_at_entry_and_before_peft_reenables(peft_model, units):
    log: list = []
    lora_fc1 = peft_model.base_model.model.fc1
    wrapped = RecordingUnit(peft_model, log, lambda: (lora_fc1.disable_adapters, _flags(peft_model, "a")))
    x = torch.randn(3, 6)
    with torch.no_grad():
        adapted = peft_model(x)
        with disable_adapter_fsdp2(wrapped):
            disabled = peft_model(x)
        restored = peft_model(x)

    # Entry: adapters on and trainable. Exit: still disabled (flags off) when resharding, re-enabled after.
    assert log == [(False, {True}), (True, {False})]
    assert not torch.equal(adapted, disabled)
    assert torch.equal(adapted, restored)
    assert _flags(peft_model, "a") == {True} and lora_fc1.disable_adapters is False


def test_disable_adapter_reshards_on_exit_even_when_the_block_raises(peft_model, units):
    log: list = []
    wrapped = RecordingUnit(peft_model, log, lambda: "reshard")
    with pytest.raises(RuntimeError, match="inside"):
        with disable_adapter_fsdp2(wrapped):
            raise RuntimeError("inside")
    assert log == ["reshard", "reshard"]
    assert _flags(peft_model, "a") == {True}


def test_unknown_adapter_is_refused_before_anything_changes(peft_model, units):
    log: list = []
    wrapped = RecordingUnit(peft_model, log, lambda: "reshard")
    for call in (lambda: set_adapter_fsdp2(wrapped, "c"), lambda: set_requires_grad_fsdp2(wrapped, ["a", "c"])):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert "['c']" in message and "['a', 'b']" in message and "add_adapter" in message
    assert log == [] and peft_model.active_adapter == "a"


def test_switching_to_an_adapter_the_optimizer_lacks_is_refused(peft_model, units):
    # What transformers' Trainer builds: the optimizer over what is trainable now, i.e. adapter "a" only.
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad])
    with pytest.raises(ValueError) as error:
        set_adapter_fsdp2(peft_model, "b", optimizer=optimizer)
    message = str(error.value)
    assert "adapter 'b'" in message and "not in the optimizer" in message and "lora_A.b.weight" in message
    assert "set_requires_grad" in message  # the fix
    assert peft_model.active_adapter == "a" and _flags(peft_model, "b") == {False}  # nothing switched


def test_optimizer_over_both_adapters_passes(peft_model):
    peft_model.set_requires_grad(["a", "b"], True)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad])
    peft_model.set_adapter("a")
    check_optimizer_covers(peft_model, optimizer, ["a", "b"])
    set_adapter_fsdp2(peft_model, "b", optimizer=optimizer)  # no FSDP2 units: a plain PEFT switch
    assert peft_model.active_adapter == "b"


def test_merged_adapters_are_refused(peft_model, units):
    log: list = []
    wrapped = RecordingUnit(peft_model, log, lambda: "reshard")
    peft_model.merge_adapter(["a"])
    for call in (lambda: set_adapter_fsdp2(wrapped, "b"), lambda: set_requires_grad_fsdp2(wrapped, "b"),
                 lambda: disable_adapter_fsdp2(wrapped).__enter__()):
        with pytest.raises(ValueError, match=r"\['a'\] are merged.*unmerge_adapter"):
            call()
    assert log == [] and peft_model.active_adapter == "a"
    peft_model.unmerge_adapter()
    set_adapter_fsdp2(wrapped, "b")
    assert peft_model.active_adapter == "b"


def test_plain_models_have_no_units_and_non_peft_models_are_refused(peft_model):
    assert reshard_fsdp2_units(peft_model) == 0  # the real FSDPModule class: nothing here is wrapped
    with pytest.raises(TypeError, match="expected a PEFT model.*Sequential"):
        set_adapter_fsdp2(nn.Sequential(nn.Linear(2, 2)), "a")
