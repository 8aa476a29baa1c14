"""The run-time check that every rank holds the same 4-bit base (sft_recipe/train/quantized_identity.py): its
fingerprint moves with any byte of the packed weights or of the quantization state, and names the ranks that
differ. The collective itself runs in real processes: tests/e2e/test_quantized_load.py."""

from __future__ import annotations

import types

import torch

from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.train.quantized_identity import (
    check_quantized_base_identical,
    differing_ranks,
    quantized_base_fingerprint,
)


def _quantized_like() -> torch.nn.Module:
    """A linear whose weight carries a quantization state, as bitsandbytes' Params4bit does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        layer.weight.quant_state = types.SimpleNamespace(absmax=torch.rand(4), code=torch.linspace(-1, 1, 16),
                                                         state2=None)
    return model


def test_the_fingerprint_moves_with_any_byte_of_the_packed_weights_or_the_state():
    model = _quantized_like()
    before = quantized_base_fingerprint(model)
    assert before is not None and before[2] == 2
    assert quantized_base_fingerprint(model) == before  # deterministic
    with torch.no_grad():
        model[1].weight.quant_state.absmax[3] += 1e-3
    moved_state = quantized_base_fingerprint(model)
    assert moved_state[0] == before[0] and moved_state[1] != before[1]
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    assert quantized_base_fingerprint(model)[0] != before[0]
    assert quantized_base_fingerprint(torch.nn.Linear(4, 4)) is None  # nothing quantized: nothing to compare


def test_the_ranks_that_differ_from_rank_0_are_named_and_one_process_compares_nothing():
    assert differing_ranks([(1, 2, 3), (1, 2, 3), (1, 9, 3), None]) == [2, 3]
    assert differing_ranks([(1, 2, 3)] * 4) == []
    assert check_quantized_base_identical(_quantized_like(), LaunchEnv()) is None  # no process group


def test_ranks_holding_placeholders_are_compared_by_their_quantization_state():
    """FSDP1 with cpu_ram_efficient_loading: only rank 0 holds packed weights before wrapping (None on the others);
    the state must still match everywhere, and packed bytes wherever two ranks both hold them."""
    assert differing_ranks([(1, 2, 3), (None, 2, 3), (None, 2, 3)]) == []
    assert differing_ranks([(1, 2, 3), (None, 9, 3), (None, 2, 4)]) == [1, 2]
    assert differing_ranks([(1, 2, 3), (5, 2, 3), (None, 2, 3)]) == [1]  # a second holder with other bytes
    model = _quantized_like()
    for layer in model:
        layer.weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"), requires_grad=False)
        layer.weight.quant_state = types.SimpleNamespace(absmax=torch.ones(4), code=torch.zeros(16), state2=None)
    placeholder = quantized_base_fingerprint(model)
    assert placeholder[0] is None and placeholder[2] == 2
