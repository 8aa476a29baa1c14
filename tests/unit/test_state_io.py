"""Checkpoint state without pickles: RNG, optimizer and scheduler round-trip exactly through safetensors/JSON, and a
sharded-checkpoint index that would run code when unpickled is refused before torch reads it."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import PosixPath

import numpy as np
import pytest
import torch

from sft_recipe.artifacts.checkpoints import mark_complete, resolve_resume
from sft_recipe.artifacts.state_io import (
    load_optimizer,
    load_rng_state,
    load_scheduler,
    save_optimizer,
    save_rng_state,
    save_scheduler,
    unsafe_dcp_metadata,
)


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    save_rng_state(tmp_path / "rng_state.safetensors")
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng_state(tmp_path / "rng_state.safetensors")
    assert _draws() == expected


def _trained_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
    return model, optimizer, scheduler


def test_optimizer_and_scheduler_round_trip(tmp_path):
    _, optimizer, scheduler = _trained_optimizer(0)
    save_optimizer(optimizer, tmp_path / "optimizer.safetensors")
    save_scheduler(scheduler, tmp_path / "scheduler.json")
    _, fresh_optimizer, fresh_scheduler = _trained_optimizer(1)
    load_optimizer(fresh_optimizer, tmp_path / "optimizer.safetensors")
    load_scheduler(fresh_scheduler, tmp_path / "scheduler.json")
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert isinstance(fresh_optimizer.param_groups[0]["betas"], tuple)
    for index, state in saved["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(loaded["state"][index][name], value, rtol=0, atol=0)
    assert fresh_scheduler.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 3
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def _dcp_checkpoint(folder):
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.ones(2, 2)}, checkpoint_id=str(folder), no_dist=True)


def test_a_real_dcp_index_passes_the_allow_list(tmp_path):
    _dcp_checkpoint(tmp_path / "pytorch_model_fsdp_0")
    assert (tmp_path / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert unsafe_dcp_metadata(tmp_path) == []


class _ByGetattr:
    """Pickles as `getattr(target, name)`: the form CPython 3.11.2 gives an enum member (3.11.7: by value)."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


def test_an_enum_member_pickled_by_getattr_passes_and_no_other_getattr_does(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    folder = tmp_path / "pytorch_model_fsdp_0"
    folder.mkdir()
    index = folder / ".metadata"
    index.write_bytes(pickle.dumps({"format": _ByGetattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")}))
    assert b"getattr" in index.read_bytes() and unsafe_dcp_metadata(tmp_path) == []
    # an admitted type's method, which the next opcode would call: PosixPath.write_text(path, text)
    index.write_bytes(pickle.dumps(_ByGetattr(PosixPath, "write_text")))
    (problem,) = unsafe_dcp_metadata(tmp_path)
    assert "builtins.getattr(<class 'pathlib.PosixPath'>, 'write_text') is not part of" in problem


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_dcp_index_that_would_run_code_is_refused_without_running_it(tmp_path):
    checkpoint = tmp_path / "out" / "checkpoint-4"
    _dcp_checkpoint(checkpoint / "pytorch_model_fsdp_0")
    marker = tmp_path / "code-ran"
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    mark_complete(checkpoint, 4)

    problems = unsafe_dcp_metadata(checkpoint)
    assert len(problems) == 1 and "mkdir" in problems[0]
    path, problems = resolve_resume("latest", str(tmp_path / "out"))
    assert path == str(checkpoint)
    assert len(problems) == 1 and "would unpickle it" in problems[0] and "start fresh" in problems[0]
    assert not marker.exists()


def test_state_that_json_cannot_hold_is_refused(tmp_path):
    class Scheduler:
        def state_dict(self):
            return {"fn": object()}

    from sft_recipe.artifacts.state_io import StateFileError

    with pytest.raises(StateFileError, match="without pickling"):
        save_scheduler(Scheduler(), tmp_path / "scheduler.json")
    assert not list(tmp_path.iterdir())  # nothing half-written
