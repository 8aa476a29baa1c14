"""Test-only: FSDP1's `sync_module_states` on a CPU machine, so what it does on GPUs can run in CPU tests.

Never installed in a user's run (train.py and compat.install do not call it;
bench/train_syncing_module_states_on_cpu.py, which tests and benches launch, does before it runs train.py). On GPUs
the same code paths run unpatched.

What stops it on CPU (torch 2.13, accelerate 1.15):
- accelerate's `FullyShardedDataParallelPlugin.__post_init__` builds the `param_init_fn` for `sync_module_states`
  on the current accelerator and raises "There are currently no available devices found" without one;
- torch's `_check_module_states_for_sync_module_states` refuses CPU tensors ("requires them to be on GPU"), though
  gloo broadcasts CPU tensors as NCCL broadcasts GPU ones.
The relaxation gives the plugin the CPU `to_empty` accelerate would have built for a GPU, and lets torch's check pass
CPU tensors; the broadcast itself is torch's own, unchanged.
When it can go: `ACCELERATE_USE_CPU=true accelerate launch` with an FSDP1 config that sets
`fsdp_sync_module_states: true` wraps a model without it (tests/unit/test_cpu_module_sync.py checks both refusals
are still there).
"""

from __future__ import annotations

import torch

_ALLOWED = {"on": False}


def allow_fsdp1_module_sync_on_cpu() -> None:
    """Install the relaxation in this process (idempotent)."""
    if _ALLOWED["on"]:
        return
    import torch.distributed.fsdp._init_utils as fsdp_init
    from accelerate.utils.dataclasses import FullyShardedDataParallelPlugin

    original_post_init = FullyShardedDataParallelPlugin.__post_init__

    def post_init_on_cpu(self, *args, **kwargs):
        try:
            original_post_init(self, *args, **kwargs)
        except RuntimeError as e:  # raised last in __post_init__, after every other setting is made
            if "no available devices" not in str(e) or not self.sync_module_states:
                raise
            self.param_init_fn = lambda module: module.to_empty(device=torch.device("cpu"), recurse=False)

    original_check = fsdp_init._check_module_states_for_sync_module_states

    def check_allowing_cpu(module_states):
        return original_check([t for t in module_states if t.device.type != "cpu"])

    FullyShardedDataParallelPlugin.__post_init__ = post_init_on_cpu
    fsdp_init._check_module_states_for_sync_module_states = check_allowing_cpu
    _ALLOWED["on"] = True


def fsdp1_module_sync_allowed_on_cpu() -> bool:
    """Whether this process installed the relaxation (validation then lets the CPU run sync module states)."""
    return _ALLOWED["on"]
