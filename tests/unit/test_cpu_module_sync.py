"""The test-only relaxation (compat.allow_fsdp1_module_sync_on_cpu) is still needed: without it, torch and
accelerate refuse FSDP1's sync_module_states on a CPU machine. The relaxation itself is tested in a fresh process
(it patches process-wide, and no test in this process may see it):
tests/test_compat_fresh_process.py::test_the_relaxation_lets_the_cpu_build_the_sync_init_and_pass_cpu_tensors; the
real launches that use it are in tests/e2e/test_quantized_once.py."""

from __future__ import annotations

import pytest
import torch

from sft_recipe import compat
from tests.helpers import REPO


def test_accelerate_still_refuses_to_build_the_sync_init_without_an_accelerator(monkeypatch):
    import accelerate.utils.dataclasses as accelerate_dataclasses
    from accelerate.utils import FullyShardedDataParallelPlugin

    # A machine without CUDA, also on a lent GPU machine (the unit lane runs there too): what accelerate asks.
    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: False)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(RuntimeError, match="no available devices"):
        FullyShardedDataParallelPlugin(sync_module_states=True)


def test_torch_still_refuses_to_sync_cpu_tensors():
    import torch.distributed.fsdp._init_utils as fsdp_init

    with pytest.raises(ValueError, match="CPU parameters or buffers when `sync_module_states=True`"):
        fsdp_init._check_module_states_for_sync_module_states([torch.zeros(2)])


def test_this_process_never_installed_the_relaxation():
    assert not compat.fsdp1_module_sync_allowed_on_cpu()
    assert "allow_fsdp1_module_sync_on_cpu" not in (REPO / "train.py").read_text()


